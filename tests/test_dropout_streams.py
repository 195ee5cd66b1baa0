"""The per-layer RNG streams: a CPU worker never draws from (or moves) the process-wide generator, whatever the user's
threads draw meanwhile ([Note: CPU worker RNG]); evaluation passes leave the training passes' streams alone
([Note: RNG streams of passes])."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices import cpu_rng
from accelerate_roundpipe.runtime.devices.cpu_rng import StreamRandom

from toy_models import Block, Embed, Head, assert_close, batch, reference_loss_and_grads, tied_model

SEED = 1234
# Masks drawn by `RandLikeDropout`, keyed by the layer's input: the forward and its recomputation see the same
# input, so they must draw the same mask. Module-level: the workers run deep copies of the layers.
_MASKS: dict[tuple[str, bytes], list[torch.Tensor]] = {}
_RECORDING = threading.Event()


class RandLikeDropout(nn.Module):
    """Dropout as many models' custom code writes it: a mask from `torch.rand_like` (no generator argument)."""

    def __init__(self, name: str, p: float = 0.4) -> None:
        super().__init__()
        self.name, self.p = name, p

    def forward(self, h: torch.Tensor, mask: torch.Tensor):
        draw = torch.rand_like(h.expand(16, *h.shape))  # larger than the mask: a wider window for a race
        if _RECORDING.is_set():
            _MASKS.setdefault((self.name, h.detach().contiguous().numpy().tobytes()), []).append(draw.clone())
        return h * (draw[0] >= self.p).to(h.dtype) / (1 - self.p), mask


def rand_like_model() -> nn.Sequential:
    torch.manual_seed(0)
    first, last = nn.Linear(6, 6), nn.Linear(6, 6)
    blocks = [Block(6) for _ in range(3)]
    return nn.Sequential(Embed(first), blocks[0], RandLikeDropout("a", 0.3), blocks[1], RandLikeDropout("b", 0.5),
                         blocks[2], Head(last)).double()


def test_recomputed_rand_like_masks_equal_the_forward_while_a_user_thread_draws():
    """The red team's case: CPU workers with recomputation, a layer drawing with `torch.rand_like`, and a user thread
    drawing `torch.rand` in a tight loop meanwhile. Every recomputed mask equals the forward's, and the gradients
    equal plain PyTorch's with the same masks."""
    model = rand_like_model()
    num_mb, passes = 8, 4
    batches = [batch(rows=24, seed=k) for k in range(passes)]  # the masks are keyed by their layer's input
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=num_mb, seed=0,
                                                             recompute="layer", microbatches_per_round=4))
    stop = threading.Event()

    def user_draws():
        while not stop.is_set():
            torch.rand(4096)

    drawer = threading.Thread(target=user_draws, daemon=True)
    _MASKS.clear()
    _RECORDING.set()
    drawer.start()
    try:
        results = []
        for x, mask, y in batches:
            loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            engine.synchronize()
            results.append((loss, {n: p.grad.clone() for n, p in engine.named_parameters()}))
            engine.zero_grad()
    finally:
        stop.set()
        drawer.join()
        _RECORDING.clear()
        engine.close()
    replayed = [masks for masks in _MASKS.values() if len(masks) > 1]
    assert len(replayed) >= passes * num_mb, "the dropout layers should be recomputed in this test"
    differing = sum(any(not torch.equal(m, masks[0]) for m in masks[1:]) for masks in replayed)
    assert differing == 0, f"{differing} of {len(replayed)} recomputed masks differ from the forward's"
    for k, ((loss, grads), (x, mask, y)) in enumerate(zip(results, batches)):
        ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y, num_microbatches=num_mb, pass_index=k)
        assert_close(loss, ref_loss, 1e-10, f"loss of pass {k}")
        for name, grad in grads.items():
            assert_close(grad, ref_grads[name], 1e-10, f"grad of {name} in pass {k}")


def _draws():
    """Random ops as layers call them, each with and without a `generator` argument of its own."""
    x = torch.randn(5, 7, dtype=torch.float64)
    probabilities = torch.rand(4, 6)
    lstm = nn.LSTM(7, 7, num_layers=2, dropout=0.4)
    return {
        "rand": lambda: torch.rand(3, 4),
        "rand float64": lambda: torch.rand(3, 4, dtype=torch.float64),
        "rand out": lambda: torch.rand(3, 4, out=torch.empty(3, 4)),
        "randn": lambda: torch.randn(11),
        "randn out": lambda: torch.randn(11, out=torch.empty(11)),
        "randint": lambda: torch.randint(9, (20,)),
        "randint low": lambda: torch.randint(-3, 9, (20,), dtype=torch.int32),
        "randint out": lambda: torch.randint(2, 9, (20,), out=torch.empty(20, dtype=torch.long)),
        "randperm": lambda: torch.randperm(13),
        "randperm out": lambda: torch.randperm(13, out=torch.empty(13, dtype=torch.long)),
        "rand_like": lambda: torch.rand_like(x),
        "rand_like float32 channels_last": lambda: torch.rand_like(torch.empty(2, 3, 4, 5).to(
            memory_format=torch.channels_last), dtype=torch.float32),
        "randn_like": lambda: torch.randn_like(x),
        "randint_like": lambda: torch.randint_like(x, 6),
        "randint_like low": lambda: torch.randint_like(x, 2, 6, dtype=torch.int64),
        "native_dropout": lambda: torch.native_dropout(x, 0.3, True),
        "dropout": lambda: nn.functional.dropout(x, 0.3),
        "alpha_dropout": lambda: nn.functional.alpha_dropout(x, 0.3, True),
        "dropout in inference mode": lambda: _inference(lambda: nn.functional.dropout(x, 0.3)),
        "feature_alpha_dropout in inference mode": lambda: _inference(
            lambda: nn.functional.feature_alpha_dropout(x[None], 0.3, True)),
        "lstm dropout": lambda: lstm(x[:, None].float())[0],
        "sdpa dropout": lambda: nn.functional.scaled_dot_product_attention(x[None], x[None], x[None], dropout_p=0.2),
        "sdpa": lambda: nn.functional.scaled_dot_product_attention(x[None], x[None], x[None]),
        "bernoulli": lambda: torch.bernoulli(probabilities),
        "uniform_": lambda: torch.empty(9).uniform_(-2, 2),
        "normal": lambda: torch.normal(x, 2.0),
        "multinomial": lambda: torch.multinomial(probabilities, 3),
        "rrelu": lambda: nn.functional.rrelu(x, training=True),
        "init": lambda: nn.init.kaiming_uniform_(torch.empty(4, 4)),
        "own generator": lambda: torch.rand(5, generator=torch.Generator().manual_seed(7)),
    }


def _inference(run):
    with torch.inference_mode():
        return run()


@pytest.mark.parametrize("name", list(_draws()))
def test_stream_draws_what_torch_draws_and_leaves_the_global_generator_alone(name):
    draw = _draws()[name]
    torch.manual_seed(SEED)
    expected = draw()
    torch.manual_seed(99)
    before = torch.random.get_rng_state()
    with StreamRandom(SEED):
        got = draw()
    assert torch.equal(torch.random.get_rng_state(), before), f"{name} moved the process-wide generator"
    as_tuple = lambda t: t if isinstance(t, tuple) else (t,)
    for g, e in zip(as_tuple(got), as_tuple(expected)):
        assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
        assert torch.equal(g, e), f"{name}: the stream drew other values than torch's op after manual_seed"


@pytest.mark.parametrize("op, call", [
    ("rand_like", lambda x: torch.rand_like(x, dtype=torch.float32)),
    ("randn_like", lambda x: torch.randn_like(x)),
    ("randint_like", lambda x: torch.randint_like(x, 7)),
])
def test_like_rewrites_for_torch_without_generator_overloads(op, call):
    """torch < 2.7 has no `rand_like.generator`: the `empty_like(...).uniform_(generator=)` rewrite draws the same."""
    x = torch.empty(3, 4, 5, dtype=torch.float64).transpose(0, 2)
    torch.manual_seed(SEED)
    expected = call(x)
    bounds = (7,) if op == "randint_like" else ()
    kwargs = {"dtype": torch.float32} if op == "rand_like" else {}
    got = cpu_rng._like(op, torch.Generator().manual_seed(SEED), x, *bounds, **kwargs)
    assert got.dtype == expected.dtype and got.stride() == expected.stride() and torch.equal(got, expected)


def _aten_ops():
    names = sorted({s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")})
    for name in names:
        packet = getattr(torch.ops.aten, name.split("::")[1])
        for overload in packet.overloads():
            yield getattr(packet, overload)


def test_every_random_op_in_torchs_registry_has_a_generator_or_a_refusal():
    """No op tagged `nondeterministic_seeded` (or taking a generator) reaches the process-wide generator: each is
    given the stream's generator, rewritten, decomposed, gated on its dropout, or refused."""
    plans = {}
    for op in _aten_ops():
        has_generator = any(a.name == "generator" for a in op._schema.arguments)
        if torch.Tag.nondeterministic_seeded in op.tags or has_generator:
            plans[str(op)] = cpu_rng._plan(op)[0]
    assert len(plans) > 100
    passing = sorted(name for name, kind in plans.items() if kind is cpu_rng._Kind.PASS)
    assert all(name.rsplit(".", 1)[0] in ("aten._fused_sdp_choice", "aten._nested_tensor_softmax_with_shape")
               for name in passing), passing
    for family in ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like"):
        for name, kind in plans.items():
            if name.rsplit(".", 1)[0] == f"aten.{family}" and "generator" not in name.rsplit(".", 1)[1]:
                assert kind in (cpu_rng._Kind.TWIN, cpu_rng._Kind.LIKE) or name.endswith("out"), (name, kind)
    refused = sorted(name for name, kind in plans.items() if kind is cpu_rng._Kind.REFUSE)
    assert all(any(word in name for word in ("cudnn", "mem_eff", "out")) for name in refused), refused


def test_a_random_op_without_a_generator_is_refused_by_name():
    with pytest.raises(RuntimeError, match="_fill_mem_eff_dropout_mask_ draws random numbers"):
        with StreamRandom(SEED):
            torch.ops.aten._fill_mem_eff_dropout_mask_(torch.empty(8), 0.5, 0, 0)
    lstm = nn.LSTM(7, 7, num_layers=2, dropout=0.4)
    with pytest.raises(RuntimeError, match="aten::lstm draws random numbers"):
        with torch.inference_mode(), StreamRandom(SEED):  # seen whole, and its decomposition would skip the dropout
            lstm(torch.randn(5, 1, 7))
    with torch.inference_mode(), StreamRandom(SEED):
        lstm.eval()(torch.randn(5, 1, 7))  # no dropout: it runs
    with StreamRandom(SEED):  # with no dropout a fused attention kernel draws nothing: it runs
        q = torch.randn(1, 2, 4, 8)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0)


def _train(eval_between: bool, steps: int = 4):
    model = tied_model(dropout=0.4)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"] * 2, num_microbatches=3, seed=5))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    losses = []
    for k in range(steps):
        x, mask, y = batch(rows=9, seed=20 + k)
        losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy))
        optimizer.step()
        optimizer.zero_grad()
        if eval_between:
            engine.eval()
            with torch.no_grad():
                engine(x, mask)
            engine.train()
    engine.synchronize()
    weights = {n: p.detach().clone() for n, p in engine.named_parameters()}
    engine.close()
    return losses, weights


def test_evaluation_forwards_between_steps_change_no_dropout_mask():
    """[Note: RNG streams of passes]: in plain PyTorch an eval-mode forward draws nothing, so the training
    that follows draws the same masks; so here."""
    plain_losses, plain_weights = _train(eval_between=False)
    eval_losses, eval_weights = _train(eval_between=True)
    for k, (a, b) in enumerate(zip(plain_losses, eval_losses)):
        assert torch.equal(a, b), f"loss of step {k}: {a.item()!r} != {b.item()!r}"
    for name, weight in plain_weights.items():
        assert torch.equal(weight, eval_weights[name]), name


def test_engine_state_keeps_both_pass_counts_and_reads_an_older_checkpoint():
    """Resume draws on exactly: both counts are saved; a checkpoint from before they were counted apart keyed the
    streams on every pass, so its pass count becomes the training count."""
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=1, seed=5))
    x, mask, _ = batch(rows=4)
    engine.eval()
    with torch.no_grad():
        engine(x, mask)
    state = engine.engine_state()
    assert (state["training_passes"], state["evaluation_passes"], state["num_passes"]) == (0, 1, 1)
    engine.load_engine_state({"seed": 5, "num_passes": 7, "next_device": 0})
    state = engine.engine_state()
    assert (state["training_passes"], state["evaluation_passes"]) == (7, 0)
    engine.close()
