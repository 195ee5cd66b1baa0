"""What each rank of the data-parallel test of [Note: the model's own loss function] runs (spawned, see `ranks.py`):
a tiny float64 Llama whose `loss_function` is the user's, on each rank's rows of one global batch."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from dp_scenarios import RTOL, rank_rows, summed_grads

from accelerate_roundpipe import RoundPipeConfig

from toy_models import assert_close

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))


def tripled(*args, **kwargs):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return 3 * ForCausalLMLoss(*args, **kwargs)


def own_loss_on_each_rank(rank: int, world_size: int) -> str:
    """`model(**batch).loss` is the user's function on this rank's logits, as under DDP, and its backward gives the
    sum over the ranks of the plain model's gradients of their losses; `forward_backward`, whose loss is the global
    batch's, refuses. Returns the refusal."""
    from accelerate_roundpipe import wrap_model

    from split_helpers import assert_same_gradients, build_model, make_batch

    model = build_model("llama")
    model.loss_function = tripled
    batch = make_batch("mixed")  # 3 rows with different label counts: rank 0 takes 2, rank 1 one
    rows = batch["input_ids"].shape[0]
    expected, expected_loss = None, None
    for r in range(world_size):
        reference = copy.deepcopy(model)
        loss = reference(**{k: v[rank_rows(rows, r, world_size)] for k, v in batch.items()}).loss
        loss.backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        expected = grads if expected is None else {n: expected[n] + g for n, g in grads.items()}
        expected_loss = loss.detach() if r == rank else expected_loss
    mine = {k: v[rank_rows(rows, rank, world_size)] for k, v in batch.items()}
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1, wait_timeout_s=60))
    try:
        engine.forward_backward(**mine)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    model.train()
    out = model(**mine)
    out.loss.backward()
    assert_close(out.loss.detach(), expected_loss, 1e-6, "loss of model(**batch)")  # float32: HF's loss upcast
    assert_same_gradients(summed_grads(engine), expected, rtol=max(RTOL, 1e-6))
    engine.close()
    return refusal
