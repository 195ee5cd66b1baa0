"""The engine on CUDA: parity with plain PyTorch in float32, pinned host store. Skipped without a GPU."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.execution.rng_streams import stream_seed

from toy_models import assert_close, batch, reference_loss_and_grads, run_layers, tied_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
RTOL = 1e-5


def gpu_reference(model, x, mask, y, num_mb, pass_index=0):
    """Plain PyTorch on cuda:0 with the engine's per-layer seeds (dropout masks drawn by the same generator)."""
    model = copy.deepcopy(model).cuda()
    rows, loss = x.shape[0], 0.0
    for mb, (xs, ms, ys) in enumerate(zip(*(torch.tensor_split(t.cuda(), num_mb) for t in (x, mask, y)))):
        h = (xs, ms)
        for index, layer in enumerate(model):
            torch.cuda.manual_seed(stream_seed(0, pass_index, index, mb))
            h = layer(*h) if isinstance(h, tuple) else layer(h)
        part = nn.functional.cross_entropy(h, ys) * (xs.shape[0] / rows)
        part.backward()
        loss = loss + part.detach()
    return loss.cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0", "cuda:0"]])
@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_cuda_parity_float32(devices, recompute):
    torch.backends.cuda.matmul.allow_tf32 = False
    model32 = tied_model().float()
    x, mask, y = batch(rows=11)
    x = x.float()
    ref_loss, ref_grads = reference_loss_and_grads(copy.deepcopy(model32).double(), x.double(), mask, y)
    for num_mb in (1, 3, 4, 8):
        engine = RoundPipe(copy.deepcopy(model32), RoundPipeConfig(devices=devices, num_microbatches=num_mb, seed=0,
                                                                   recompute=recompute))
        assert next(engine.module.parameters()).device.type == "cpu"
        loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        engine.synchronize()
        # Locked before the first pass, as every bucket crosses PCIe when no optimizer placed one on the GPU
        # ([Note: compute copies locked where they cross]); not at construction any more.
        assert all(b.compute.is_pinned() for b in engine._store.buckets)
        assert_close(loss.double(), ref_loss, RTOL, f"loss ({num_mb} micro-batches)")
        for name, p in engine.named_parameters():
            assert p.device.type == "cpu" and p.dtype == torch.float32
            assert_close(p.grad.double(), ref_grads[name], RTOL, f"grad of {name} ({num_mb} micro-batches)")
        engine.close()


def test_cuda_dropout_replayed():
    model32 = tied_model(dropout=0.4).float()
    x, mask, y = batch(rows=9)
    x = x.float()
    for devices in (["cuda:0"], ["cuda:0", "cuda:0"]):
        ref_loss, ref_grads = gpu_reference(model32, x, mask, y, num_mb=3)
        engine = RoundPipe(copy.deepcopy(model32), RoundPipeConfig(devices=devices, num_microbatches=3, seed=0))
        loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        engine.synchronize()
        assert_close(loss, ref_loss, RTOL, "loss")
        for name, p in engine.named_parameters():
            assert_close(p.grad, ref_grads[name], RTOL, f"grad of {name}")
        engine.close()


@pytest.mark.parametrize("placement", ["host", "device"])
def test_cuda_training_follows_staleness_rule(placement):
    """Also with the optimizer state on the GPU ([Note: optimizer placement]), whose steps are exact even with
    async_optimizer ([Note: device steps are exact])."""
    check_staleness_rule(["cuda:0", "cuda:0"], placement)


def check_staleness_rule(devices: list[str], placement: str) -> None:
    """The exact and the lagged step on `devices` against plain PyTorch's staleness rule (tests/test_multi_gpu.py
    runs it on two GPUs)."""
    import test_training
    from test_training import reference_training

    model = tied_model()
    batches = [batch(rows=9, seed=10 + k) for k in range(6)]
    for async_optimizer in (True, False):
        lagged = async_optimizer and placement == "host"
        ref_model, ref_losses = reference_training(model, batches, lagged, 4, False)
        engine = RoundPipe(copy.deepcopy(model).float(), RoundPipeConfig(devices=devices,
                                                                         num_microbatches=4,
                                                                         async_optimizer=async_optimizer,
                                                                         optimizer_placement=placement))
        optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=test_training.LRS[0],
                                                            weight_decay=0.1))
        for k, (x, mask, y) in enumerate(batches):
            loss = engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
            assert_close(loss.double(), ref_losses[k], 1e-4, f"loss {k}")
            for group in optimizer.param_groups:
                group["lr"] = test_training.LRS[k]
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        reference = dict(ref_model.named_parameters())
        for name, p in engine.module.named_parameters():
            assert_close(p.detach().double(), reference[name].detach(), 1e-4, f"weight {name}")
        engine.close()


def test_cuda_forward_pipeline_and_timing_report():
    torch.manual_seed(0)
    width, depth, rows = 1024, 16, 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
    ref = copy.deepcopy(model).cuda()
    engine = RoundPipe(model, RoundPipeConfig(devices=["cuda:0"], num_microbatches=4))
    x = torch.randn(rows, width)
    out = engine(x)
    ref_out = run_layers(ref, (x.cuda(),)).cpu()
    assert_close(out.detach(), ref_out.detach(), 1e-4, "forward output")
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
    target = torch.randn(rows, width)
    for _ in range(2):  # warm-up
        engine.forward_backward(x, labels=target, loss_fn=nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    start = time.perf_counter()
    iterations = 10
    for _ in range(iterations):
        engine.forward_backward(x, labels=target, loss_fn=nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    elapsed = (time.perf_counter() - start) / iterations
    print(f"\n[report] {depth}x Linear({width}) fp32, batch {rows}, 4 micro-batches, 1 GPU: "
          f"{elapsed * 1e3:.1f} ms/iteration (engine core, no transfer engine yet)")
    engine.close()


def test_cuda_trace_has_compute_and_copy_streams(tmp_path):
    import json

    path = tmp_path / "trace.json"
    engine = RoundPipe(tied_model().float(), RoundPipeConfig(devices=["cuda:0", "cuda:0"], num_microbatches=4,
                                                             trace_path=str(path)))
    x, mask, y = batch(rows=8)
    engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.close()
    trace = json.loads(path.read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    for suffix in ("compute", "parameter upload", "activation upload", "activation download", "gradient download"):
        assert f"d0(cuda:0) {suffix}" in tracks, (suffix, sorted(tracks))
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")


def test_weight_waits_are_traced_inside_their_tasks(tmp_path):
    """[Note: weight waits in the trace]: with the exact step the next pass's first layers wait for their weights;
    each wait is a span of the device's weights-wait track, inside one of its compute spans."""
    from accelerate_roundpipe.telemetry.report import load_task_spans, load_weight_waits, main

    path = tmp_path / "trace.json"
    engine = RoundPipe(tied_model().float(), RoundPipeConfig(devices=["cuda:0"], num_microbatches=2,
                                                             trace_path=str(path)))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    for k in range(3):
        x, mask, y = batch(rows=8, seed=k)
        engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    engine.close()
    spans, waits = load_task_spans(str(path)), load_weight_waits(str(path))
    assert waits and all(w.track == "d0(cuda:0) compute" for w in waits)
    slack = 1e-4  # the clocks of the two event pairs are read apart
    assert all(any(s.start - slack <= w.start and w.end <= s.end + slack for s in spans) for w in waits)
    assert 0.0 <= main([str(path)])["waiting_for_weights"] < 1.0


def test_host_memory_is_page_locked_at_its_exact_size_until_released():
    from accelerate_roundpipe.runtime.devices.pinned import HostMemory

    memory = HostMemory(pinned=True)
    numel = 3 * 2**20 + 5  # far from a power of two
    buffer = memory.zeros(numel, torch.float32)
    assert buffer.numel() == numel and buffer.is_pinned() and memory.locked_bytes == 4 * numel
    source = torch.arange(numel, dtype=torch.bfloat16, device="cuda")
    buffer.copy_(source, non_blocking=True)  # converted on the device, landed asynchronously
    torch.cuda.synchronize()
    assert torch.equal(buffer, source.float().cpu())
    memory.release()
    assert not buffer.is_pinned() and memory.locked_bytes == 0
    assert torch.equal(buffer, source.float().cpu())  # still valid as ordinary memory


def test_engine_store_is_page_locked_and_unlocked_at_close():
    model = tied_model().float()
    engine = RoundPipe(model, RoundPipeConfig(devices=["cuda:0"], num_microbatches=2))
    x, mask, y = batch(rows=8)
    engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    buckets = engine._store.trainable_buckets
    assert all(b.compute.is_pinned() and b.grad.is_pinned() for b in buckets)
    assert engine._store.memory.locked_bytes >= sum(b.compute.nbytes + b.grad.nbytes for b in buckets)
    engine.close()
    assert engine._store.memory.locked_bytes == 0 and not any(b.compute.is_pinned() for b in buckets)
