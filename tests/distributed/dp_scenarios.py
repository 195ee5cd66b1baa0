"""What each rank of the data-parallel tests runs (in spawned processes, see `ranks.py`), and the one-process
plain-PyTorch reference it is compared with: the same steps on the WHOLE global batch."""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common.sync import EngineClosedError
from accelerate_roundpipe.runtime.distribution.collectives import DataParallelError

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model

RTOL = 1e-10
ACCUMULATION = 2  # forward_backward calls per optimizer step
MAX_NORM = 0.05  # small enough that every step clips
LRS = [1e-2, 2e-2, 5e-3, 1e-2, 3e-2]


def global_batches(num_steps: int, rows: int) -> list[list[tuple]]:
    """Per step, ACCUMULATION global batches whose labels are masked unevenly: the last rows (the last rank's)
    keep few labels, so the ranks' label counts differ."""
    out = []
    for k in range(num_steps):
        micro = []
        for a in range(ACCUMULATION):
            x, mask, y = batch(rows=rows, seed=100 + 10 * k + a)
            y = y.clone()
            y[rows - rows // 3:-1] = -100
            y[a] = -100
            micro.append((x, mask, y))
        out.append(micro)
    return out


def rank_rows(rows: int, rank: int, world_size: int) -> slice:
    """Rank's rows of a global batch (uneven: the first ranks take one more)."""
    sizes = [rows // world_size + (1 if r < rows % world_size else 0) for r in range(world_size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def reference_run(model, batches, async_optimizer: bool, clip: bool):
    """Plain PyTorch AdamW on the whole global batch; the passes of step k compute with the weights after k steps
    (sync), or, async, every pass of step k with the weights after k-1 (staleness 1: step k-1's write-back is held
    until step k, [Note: write-backs held for the whole iteration]), as one process does. Returns the losses, the
    norms, the first step's gradients, the weights after every step and the optimizer."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LRS[0], weight_decay=0.1)
    snapshots = [copy.deepcopy(model.state_dict())]
    losses, norms, first_grads, weights = [], [], None, []
    for k, micro in enumerate(batches):
        grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for x, mask, y in micro:
            probe = copy.deepcopy(model)
            probe.load_state_dict(snapshots[k - 1 if async_optimizer and k > 0 else k])
            loss, g = reference_loss_and_grads(probe, x, mask, y)
            losses.append(loss)
            for n in grads:
                grads[n] += g[n] / ACCUMULATION
        if first_grads is None:
            first_grads = {n: g.clone() for n, g in grads.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_NORM))
        for group in optimizer.param_groups:
            group["lr"] = LRS[k]
        optimizer.step()
        optimizer.zero_grad()
        snapshots.append(copy.deepcopy(model.state_dict()))
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, norms, first_grads, weights, optimizer


def make_engine(model, **config):
    settings = dict(devices=["cpu"], num_microbatches=2, seed=0, wait_timeout_s=60)
    settings.update(config)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(**settings))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LRS[0], weight_decay=0.1))
    return engine, optimizer


def train(engine, optimizer, batches, rows: int, rank: int, world_size: int, clip: bool, deferred: bool = False,
          steps: range | None = None, on_first_grads=None):
    """The engine's side of `reference_run`, on this rank's rows; returns the losses and norms."""
    part = rank_rows(rows, rank, world_size)
    losses, norms = [], []
    if deferred:
        engine.expect_grad_scale(1.0 / ACCUMULATION)
    for k in steps if steps is not None else range(len(batches)):
        for x, mask, y in batches[k]:
            inputs, labels = (x[part], mask[part]), y[part]
            if deferred:
                loss = engine.forward_backward(*inputs, labels=labels, loss_fn=nn.functional.cross_entropy,
                                               deferred=True)
                (loss / ACCUMULATION).backward()
            else:
                loss = engine.forward_backward(*inputs, labels=labels, loss_fn=nn.functional.cross_entropy,
                                               grad_scale=1.0 / ACCUMULATION)
            losses.append(loss.detach())
        if on_first_grads is not None and k == 0:
            on_first_grads()
        if clip:
            norms.append(optimizer.clip_grad_norm_(MAX_NORM))
        for group in optimizer.param_groups:
            group["lr"] = LRS[k]
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    return losses, norms


def summed_grads(engine) -> dict[str, torch.Tensor]:
    """The sum over ranks of `engine.parameters()`' `.grad`: the global gradient ([Note: data parallel]); frozen
    parameters (no gradient) are left out."""
    engine.synchronize()
    out = {}
    for name, p in engine.named_parameters():
        if not p.requires_grad:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        out[name] = grad
    return out


def check_run(losses, norms, weights, ref, what: str) -> None:
    ref_losses, ref_norms, _, ref_weights, _ = ref
    assert len(losses) == len(ref_losses)
    for i, (loss, expected) in enumerate(zip(losses, ref_losses)):
        assert_close(loss, expected, RTOL, f"{what}: loss of pass {i}")
    for i, (norm, expected) in enumerate(zip(norms, ref_norms)):
        assert_close(torch.as_tensor(float(norm), dtype=torch.float64), expected, RTOL, f"{what}: norm of step {i}")
    for name, expected in ref_weights[-1].items():
        assert_close(weights[name], expected, RTOL, f"{what}: weight {name}")


def module_weights(engine) -> dict[str, torch.Tensor]:
    engine.synchronize()
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def identical_on_every_rank(tensors: dict[str, torch.Tensor]) -> bool:
    for tensor in tensors.values():
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor.contiguous())
        if any(not torch.equal(g, tensor) for g in gathered):
            return False
    return True


# ---------------------------------------------------------------------- scenarios (run on every rank)

def training_equals_one_process(rank: int, world_size: int, checkpoint_path: str) -> dict:
    """Sync and async, with accumulation, clipping and uneven label masks; the deferred path; a checkpoint at step
    3 resumed into fresh engines (from this rank's shard, and from a one-process optimizer state). The
    collectives go in chunks over several gloo groups, as a large model's do ([Note: data parallel])."""
    from accelerate_roundpipe.runtime.distribution import gloo_exchange

    gloo_exchange.MIN_STREAM_ELEMENTS = 8  # this tiny model's buckets then go in several chunks each
    groups_before = len(dist.distributed_c10d._world.pg_map)
    rows, num_steps = 11, 5
    model = tied_model()
    batches = global_batches(num_steps, rows)
    report = {}
    for async_optimizer in (False, True):
        ref = reference_run(model, batches, async_optimizer, clip=True)
        engine, optimizer = make_engine(model, async_optimizer=async_optimizer,
                                        devices=["cpu"] * (2 if async_optimizer else 1))
        seen: dict[str, torch.Tensor] = {}
        losses, norms = train(engine, optimizer, batches, rows, rank, world_size, clip=True,
                              on_first_grads=lambda seen=seen, engine=engine: seen.update(summed_grads(engine)))
        what = f"async={async_optimizer}"
        for name, expected in ref[2].items():
            assert_close(seen[name], expected, RTOL, f"{what}: summed gradient {name} of step 0")
        weights = module_weights(engine)
        check_run(losses, norms, weights, ref, what)
        assert identical_on_every_rank(weights)
        state = optimizer.state_dict()
        assert state["data_parallel"]["world_size"] == world_size and state["data_parallel"]["rank"] == rank
        owned = sum(v["exp_avg"].numel() for v in state["shard"]["state"].values())
        total = sum(p.numel() for p in engine.parameters())
        per_rank = sum(b.optim.numel() for b in engine.host_store.trainable_buckets) // world_size
        report[f"optimizer state elements, {what}"] = (owned, total, per_rank)
        engine.close()

        # A checkpoint after step 3, resumed into fresh engines, ends where the uninterrupted run ends.
        for source in ("shard", "one-process state"):
            first, first_optimizer = make_engine(model, async_optimizer=async_optimizer)
            train(first, first_optimizer, batches, rows, rank, world_size, clip=True, steps=range(3))
            saved = {"weights": {k: v.clone() for k, v in first.state_dict().items()},
                     "optimizer": copy.deepcopy(first_optimizer.state_dict()), "engine": first.engine_state(),
                     "lagged": first.lagged_weights()}
            if not async_optimizer and source == "shard":
                torch.save(saved["optimizer"], checkpoint_path.format(rank=rank))
            first.close()
            if source == "one-process state":  # the plain optimizer's state after 3 steps: each rank cuts its shard
                saved["optimizer"] = reference_run(model, batches[:3], async_optimizer, clip=True)[4].state_dict()
            resumed, resumed_optimizer = make_engine(model, async_optimizer=async_optimizer)
            resumed.load_state_dict(saved["weights"])
            resumed_optimizer.load_state_dict(saved["optimizer"])
            resumed.load_engine_state(saved["engine"])
            resumed.load_lagged_weights(saved["lagged"])
            losses, norms = train(resumed, resumed_optimizer, batches, rows, rank, world_size, clip=True,
                                  steps=range(3, num_steps))
            weights = module_weights(resumed)
            for name, expected in ref[3][-1].items():
                assert_close(weights[name], expected, RTOL, f"{what}, resumed from the {source}: weight {name}")
            for i, loss in enumerate(losses):
                assert_close(loss, ref[0][3 * ACCUMULATION + i], RTOL, f"{what}, resumed: loss {i}")
            resumed.close()

    # The deferred path (the integrations' `loss.backward()` commits), sync, no clip.
    ref = reference_run(model, batches, async_optimizer=False, clip=False)
    engine, optimizer = make_engine(model)
    losses, norms = train(engine, optimizer, batches, rows, rank, world_size, clip=False, deferred=True)
    check_run(losses, norms, module_weights(engine), ref, "deferred")
    engine.close()
    # Seven engines were built and closed: their process groups were destroyed with them.
    assert len(dist.distributed_c10d._world.pg_map) == groups_before, "process groups left behind by closed engines"
    return report


def small_run_and_foreign_shard(rank: int, world_size: int, checkpoint_path: str) -> None:
    """A few sync, clipped steps (the 4-process case); then a shard saved by another world size is refused."""
    rows, num_steps = 10, 3
    model = tied_model(num_blocks=2)
    batches = global_batches(num_steps, rows)
    ref = reference_run(model, batches, async_optimizer=False, clip=True)
    engine, optimizer = make_engine(model, num_microbatches=1)
    losses, norms = train(engine, optimizer, batches, rows, rank, world_size, clip=True)
    check_run(losses, norms, module_weights(engine), ref, f"{world_size} ranks")
    if checkpoint_path:
        shard = torch.load(checkpoint_path.format(rank=rank % 2))
        try:
            optimizer.load_state_dict(shard)
        except DataParallelError as error:
            assert "2 data-parallel processes" in str(error) and f"of {world_size}" in str(error), error
        else:
            raise AssertionError("a shard of another world size was loaded")
    engine.close()


def ranks_fail(rank: int, world_size: int) -> dict:
    """`a_rank_fails` for each way a rank can fail, in one pair of processes (the killed rank last)."""
    out = {}
    for how in ("raise", "stall", "exit"):
        dist.barrier()  # after a stall the ranks leave at different times
        out[how] = a_rank_fails(rank, how)
        if rank == 1 and how == "raise":  # checked here: rank 1 returns nothing, it is killed later
            assert "boom on rank 1" in out[how]["error"] and out[how]["closed"], out[how]
    return out


def a_rank_fails(rank: int, how: str) -> dict:
    """Rank 1's loss function raises (`how="raise"`) or kills its process (`"exit"`) in its third pass, or its
    training loop stalls past the timeout before that pass (`"stall"`); the other ranks must raise within the
    timeout, with a message, never hang."""
    model = tied_model(num_blocks=2)
    timeout = 20.0 if how == "raise" else 3.0

    def loss_fn(out, labels, calls=[0]):  # noqa: B006 - counts this rank's calls
        calls[0] += 1
        if rank == 1 and calls[0] == 5:  # pass 3 (two micro-batches a pass)
            if how == "exit":
                os._exit(3)
            if how == "raise":
                raise ValueError("boom on rank 1")
        return nn.functional.cross_entropy(out, labels)

    engine, optimizer = make_engine(model, wait_timeout_s=timeout, async_optimizer=True)
    x, mask, y = batch(rows=8)
    started = time.monotonic()
    try:
        for i in range(4):
            if how == "stall" and rank == 1 and i == 2:
                time.sleep(2 * timeout)  # outside the engine: only the other ranks' collectives can notice
            engine.forward_backward(x, mask, labels=y, loss_fn=loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            started = time.monotonic()
        engine.synchronize()
    except Exception as error:  # noqa: BLE001 - what the test looks at
        elapsed = time.monotonic() - started
        try:
            engine.forward_backward(x, mask, labels=y, loss_fn=loss_fn)
            closed = False
        except EngineClosedError:
            closed = True
        closing = time.monotonic()
        engine.close()
        return {"error": f"{type(error).__name__}: {error}", "elapsed": elapsed, "closed": closed,
                "timeout": timeout, "close_s": time.monotonic() - closing}
    engine.close()
    return {"error": None}


def mismatched_settings(rank: int, world_size: int) -> dict:
    """Rank 1 asks for other settings: every rank refuses at construction, listing what differs; the optimizer
    class too; an optimizer that is not element-wise is refused."""
    model = tied_model(num_blocks=2)
    out = {}
    try:
        make_engine(model, num_microbatches=2 + rank, devices=["cpu"] * (1 + rank))
    except DataParallelError as error:
        out["engine"] = str(error)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], num_microbatches=2))
    optimizer_class = torch.optim.AdamW if rank == 0 else torch.optim.SGD
    try:
        engine.wrap_optimizer(optimizer_class(engine.parameters(), lr=1e-2))
    except DataParallelError as error:
        out["optimizer"] = str(error)
    try:
        engine.wrap_optimizer(torch.optim.LBFGS(engine.parameters()))
    except DataParallelError as error:
        out["lbfgs"] = str(error)
    engine.close()
    return out


def hugging_face_loss_counts_the_global_batch(rank: int, world_size: int) -> None:
    """A tiny Llama: `forward_backward` and the stock `model(**batch).loss.backward()` (deferred) on each rank's
    rows give the loss of HF's model on the whole global batch (mean over all its label tokens, unevenly spread
    over the ranks) and, summed over the ranks, its gradients."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from accelerate_roundpipe import wrap_model

    from split_helpers import assert_same_gradients, build_model, make_batch, reference_loss

    model = build_model("llama")
    batch = make_batch("mixed")  # 3 rows with different label counts: rank 0 takes 2, rank 1 one
    reference = copy.deepcopy(model)
    expected_loss = reference_loss(reference, batch)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
    mine = {k: v[rank_rows(batch["input_ids"].shape[0], rank, world_size)] for k, v in batch.items()}
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1, wait_timeout_s=60))
    loss = engine.forward_backward(**mine)
    model.train()
    out = model(**mine)
    out.loss.backward()
    assert_close(loss, expected_loss.detach(), RTOL, "loss of forward_backward")
    assert_close(out.loss.detach(), expected_loss.detach(), RTOL, "loss of model(**batch)")
    assert_same_gradients(summed_grads(engine), {n: 2 * g for n, g in expected.items()})
    engine.close()


def first_pass_regrouped_on_every_rank(rank: int, world_size: int) -> dict:
    """[Note: first-pass backward stages] under data parallelism: a host without room for the saved inputs runs
    the first pass in backward stages of several layers on each rank (each process sizes its own host, as each
    measures its own plan afterwards), and the loss and the summed gradients are still the global batch's."""
    import sys
    from pathlib import Path
    from unittest import mock

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from accelerate_roundpipe import wrap_model
    from accelerate_roundpipe.runtime.execution import first_pass

    from split_helpers import assert_same_gradients, build_model, make_batch, reference_loss

    # no room for any saved input, restored for the scenarios after this one in the same process
    with mock.patch.object(first_pass, "SAVED_HOST_SHARE", 0.0):
        model = build_model("llama", num_hidden_layers=4)
        batch = make_batch("mixed")
        reference = copy.deepcopy(model)
        expected_loss = reference_loss(reference, batch)
        expected_loss.backward()
        expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
        mine = {k: v[rank_rows(batch["input_ids"].shape[0], rank, world_size)] for k, v in batch.items()}
        engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], wait_timeout_s=60, summary=False))
        loss = engine.forward_backward(**mine)
        sizing = engine._microbatches.sizing
        assert_close(loss, expected_loss.detach(), RTOL, "loss of the regrouped first pass")
        assert_same_gradients(summed_grads(engine), expected)
        engine.close()
    return {"stage_layers": sizing.stage_layers, "backward_stages": len(sizing.partition.backward)}


def moe_model_and_batch():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from split_helpers import build_model, make_batch

    return build_model("mixtral"), make_batch("mixed")  # 3 rows: rank 0 takes 2, rank 1 one


def moe_one_process_reference(path: str, world_size: int) -> None:
    """One process (no process group) running the whole batch as the ranks' micro-batches; saved to `path`."""
    from accelerate_roundpipe import wrap_model

    model, batch = moe_model_and_batch()
    one = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=world_size, summary=False))
    loss = one.forward_backward(**batch)
    one.synchronize()
    torch.save({"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in one.named_parameters()
                                                if p.grad is not None}}, path)
    one.close()


def mixture_of_experts_counts_the_global_tokens(rank: int, world_size: int, reference_path: str) -> None:
    """A tiny Mixtral with its router aux loss: each rank's micro-batch weighs its aux loss by its tokens over the
    GLOBAL batch's ([Note: router statistics]), so loss and summed gradients equal one process running the whole
    batch as the same micro-batches (rank r's rows are its micro-batch r). Counted per rank, the aux term would
    count world_size times."""
    from accelerate_roundpipe import wrap_model

    from split_helpers import assert_same_gradients

    model, batch = moe_model_and_batch()
    expected = torch.load(reference_path)
    mine = {k: v[rank_rows(batch["input_ids"].shape[0], rank, world_size)] for k, v in batch.items()}
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1, wait_timeout_s=60))
    loss = engine.forward_backward(**mine)
    assert_close(loss, expected["loss"], RTOL, "MoE loss with the router aux loss")
    assert_same_gradients(summed_grads(engine), expected["grads"])
    engine.close()


def lora_reference(path: str) -> None:
    """One process, PEFT LoRA on a tiny Llama, the whole batch: loss and the adapters' gradients, saved to `path`."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    from split_helpers import lora_model, make_batch, reference_loss

    model = lora_model("llama", ["q_proj", "v_proj", "down_proj"])
    loss = reference_loss(model, make_batch("mixed"))
    loss.backward()
    torch.save({"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}}, path)


def lora_counts_the_global_batch(rank: int, world_size: int, reference_path: str) -> None:
    """PEFT LoRA (frozen base weights, trainable adapters: the multi-machine fine-tune the scaling model counts on)
    across ranks: loss and the adapters' summed gradients equal plain PEFT on the whole batch, and a step leaves
    every rank with the same adapters."""
    from accelerate_roundpipe import wrap_model

    from split_helpers import assert_same_gradients, lora_model, make_batch

    model = lora_model("llama", ["q_proj", "v_proj", "down_proj"])
    batch = make_batch("mixed")
    expected = torch.load(reference_path)
    mine = {k: v[rank_rows(batch["input_ids"].shape[0], rank, world_size)] for k, v in batch.items()}
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1, wait_timeout_s=60))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad],
                                                        lr=1e-2))
    loss = engine.forward_backward(**mine)
    assert_close(loss, expected["loss"], RTOL, "LoRA loss")
    assert_same_gradients(summed_grads(engine), expected["grads"])
    optimizer.step()
    optimizer.zero_grad()
    engine.synchronize()
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and identical_on_every_rank(adapters)
    assert any(not torch.equal(adapters[n], p) for n, p in lora_model("llama", ["q_proj", "v_proj", "down_proj"])
               .named_parameters() if n in adapters), "the step changed no adapter"
    engine.close()


def clips_of_rank_shares_are_refused(rank: int, world_size: int) -> dict:
    """Under data parallelism each rank's `.grad` is its share of the gradient: a value clip, another norm type or
    a clip of some parameters would clip the shares, not the global gradient, so they are refused by name; the L2
    clip of every parameter (the Trainer's) still runs and is the global norm."""
    from accelerate_roundpipe.integrations.grad_norm import clip_grad_norm, clip_grad_value

    rows = 8
    model = tied_model()
    engine, optimizer = make_engine(model)
    refused = {}
    try:
        x, mask, y = batch(rows=rows, seed=3)
        part = rank_rows(rows, rank, world_size)
        engine.forward_backward(x[part], mask[part], labels=y[part], loss_fn=nn.functional.cross_entropy)
        params = list(engine.module.parameters())
        inf = float("inf")
        attempts = {
            "clip_grad_value_": lambda: clip_grad_value(params, [engine], 0.01),
            "clip_grad_norm_ with norm_type=inf": lambda: clip_grad_norm(params, [engine], 0.1, norm_type=inf),
            "clip_grad_norm_ that no one engine's optimizer can take": lambda: clip_grad_norm(params[:2], [engine],
                                                                                              0.1),
        }
        for what, attempt in attempts.items():
            try:
                attempt()
            except ValueError as error:
                refused[what] = str(error).startswith(what) and "data parallelism (2 processes)" in str(error)
        norm = float(clip_grad_norm(params, [engine], 0.1))
        optimizer.step()
        optimizer.zero_grad()
        engine.synchronize()
    finally:
        engine.close()
    _, expected = reference_loss_and_grads(model, x, mask, y)
    global_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in expected.values()])))
    return {"refused": refused, "norm": norm, "global_norm": global_norm, "world_size": engine.data_parallel_world_size}
