"""[Note: stream model]: the engine's real task paths (forward, fused, backward; recompute by stage and by layer)
run through a CPU device whose streams are ordered queues that check CUDA's ordering rules, so a missing wait, which
costs nothing on a CPU worker, fails here as it would on a GPU; and the same run gives exactly the plain CPU
device's losses and weights ([Note: devices as classes])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices import factory
from accelerate_roundpipe.runtime.devices.cpu_device import CpuDevice
from accelerate_roundpipe.runtime.devices.cuda_device import CudaDevice
from accelerate_roundpipe.runtime.devices.device import Device, Payload
from accelerate_roundpipe.runtime.devices.stream_model import ModelEvent, StreamModelDevice, StreamOrderError
from accelerate_roundpipe.runtime.state import saved_input_buffers

from toy_models import batch, tied_model

# "hand": forward stages, a fused stage and backward stages (recomputation) over two devices, saved inputs moving
# between devices (host round trips) and staying on one (the keep limit comes from gpu_memory_budget);
# "fused": every layer in the fused stage of one device (no recomputation; payloads stay on the device);
# "cast": a float32 model under float64 optimizer copies (uploads cast on the device from the newest version).
CASES = {
    "hand-stage": dict(devices=["cpu", "cpu"], forward_stages=[2, 3], backward_stages=[2, 3, 4], recompute="stage"),
    "hand-layer": dict(devices=["cpu", "cpu"], forward_stages=[2, 3], backward_stages=[2, 3, 4], recompute="layer"),
    "fused": dict(devices=["cpu"], backward_stages=[9]),
    "cast": dict(devices=["cpu", "cpu"], forward_stages=[2, 3], backward_stages=[2, 3, 4], recompute="layer",
                 optimizer_dtype=torch.float64),
}


def train(case: str, steps: int = 2):
    """Losses of `steps` AdamW steps, then the output of an evaluation pass, the final weights and the devices."""
    settings = CASES[case]
    dtype = torch.float32 if "optimizer_dtype" in settings else torch.float64
    engine = RoundPipe(tied_model(dropout=0.2).to(dtype),
                       RoundPipeConfig(num_microbatches=3, seed=0, gpu_memory_budget=1.0, **settings))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    x, mask, y = batch(rows=7)
    x = x.to(dtype)
    losses = []
    try:
        for _ in range(steps):
            losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy))
            optimizer.step()
            optimizer.zero_grad()
        engine.eval()
        with torch.no_grad():
            losses.append(engine(x, mask))
        engine.synchronize()
        weights = {n: p.detach().clone() for n, p in engine.named_parameters()}
        return losses, weights, list(engine.devices)
    finally:
        engine.close()


@pytest.fixture
def stream_model(monkeypatch):
    """Every CPU worker made from now on is a `StreamModelDevice`."""
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)


@pytest.mark.parametrize("pooled", [False, True], ids=["torch-cache", "pooled-saved-inputs"])
@pytest.mark.parametrize("case", CASES)
def test_training_through_the_stream_model_equals_the_cpu_device(case, pooled, monkeypatch):
    """Also with the saved inputs in the store's pooled blocks ([Note: saved inputs in pooled blocks])."""
    monkeypatch.setattr(saved_input_buffers, "POOLED", pooled)
    plain_losses, plain_weights, plain_devices = train(case)
    assert all(type(d) is CpuDevice for d in plain_devices)
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    losses, weights, devices = train(case)
    assert all(isinstance(d, StreamModelDevice) for d in devices)
    for loss, plain in zip(losses, plain_losses, strict=True):
        assert torch.equal(loss, plain)
    for name, weight in weights.items():
        assert torch.isfinite(weight).all(), name
        assert torch.equal(weight, plain_weights[name]), name
    log = [entry for d in devices for entry in d.log]
    # The ordering the GPU path relies on was exercised, not bypassed: uploads waited for on the compute stream,
    # downloads queued after the compute stream and waited for by the host.
    for entry in [("parameter upload", "copy to device"), ("compute", "wait for parameter upload"),
                  ("compute", "wait for activation upload"), ("gradient download", "wait for compute"),
                  ("gradient download", "copy to host"), ("activation download", "wait for compute"),
                  ("host", "wait for gradient download"), ("host", "wait for activation download")]:
        assert entry in log, entry
    if case == "cast":
        assert ("parameter upload", "copy on device") in log
    if len(devices) > 1:  # an activation from the other device: its upload waits for its download
        assert any(stream == "activation upload" and what.startswith("wait for activation download of")
                   for stream, what in log)


def test_a_layer_reading_parameters_before_their_upload_fails(stream_model, monkeypatch):
    """Skip the compute stream's wait for uploads (a bug invisible on a CPU worker): the model refuses the read."""
    monkeypatch.setattr(Device, "_use", lambda self, tensors, event: None)
    with pytest.raises(Exception) as caught:
        train("hand-stage", steps=1)
    assert "copy still in flight" in "".join(str(e) for e in _chain(caught.value))


def test_the_same_bug_passes_unnoticed_on_the_plain_cpu_device(monkeypatch):
    """Why the model exists: the CPU device finishes a copy when it is issued, so the missing wait costs nothing."""
    monkeypatch.setattr(Device, "_use", lambda self, tensors, event: None)
    losses, weights, _ = train("hand-stage", steps=1)
    assert all(torch.isfinite(loss).all() for loss in losses)


def test_a_host_read_before_the_download_event_reads_poison(stream_model, monkeypatch):
    """`Payload.host` without waiting for the copy: the losses and gradient norms read the poison (NaN)."""
    monkeypatch.setattr(Payload, "host", lambda self: self.tensors)
    losses, weights, _ = train("hand-layer", steps=1)
    assert torch.isnan(losses[0]) and torch.isnan(losses[1]).any()
    assert any(torch.isnan(weight).any() for weight in weights.values())  # stepped with poisoned gradients


def test_an_event_never_recorded_cannot_be_waited_for():
    device = StreamModelDevice(torch.device("cpu"), 0)
    with pytest.raises(StreamOrderError, match="never recorded"):
        device.compute_stream.wait_event(ModelEvent())
    with pytest.raises(StreamOrderError, match="never recorded"):
        ModelEvent().synchronize()


def test_copies_run_in_order_when_waited_for_and_only_into_page_locked_memory():
    device = StreamModelDevice(torch.device("cpu"), 0)
    source = torch.arange(4.0)
    (uploaded,), (event,) = device._upload([source], device.act_in)
    assert torch.isnan(uploaded).all() and not event.query()  # in flight: poison, not the values
    with device.compute(), pytest.raises(StreamOrderError, match="in flight"):
        uploaded * 2  # the compute stream did not wait for the upload
    device._use([uploaded], event)
    assert torch.equal(uploaded, source) and event.query()
    with device._on_stream(device.grad_out), pytest.raises(StreamOrderError, match="page-locked"):
        device._copy_to_host(torch.empty(4), uploaded)
    host, done = device._download([uploaded], device.act_out)
    assert torch.isnan(host[0]).all()
    done.synchronize()
    assert torch.equal(host[0], source)


def test_the_device_class_is_chosen_once_from_the_torch_device():
    """`make_device(torch_device, i)` gives the class of that kind of device, complete (constructing a CUDA device
    touches no GPU: its streams are made on the worker's thread)."""
    cpu, cuda = factory.make_device(torch.device("cpu"), 0), factory.make_device(torch.device("cuda", 1), 1)
    assert type(cpu) is CpuDevice and type(cuda) is CudaDevice
    assert not (cpu.is_cuda or cpu.records_kernel_time or cpu.tracks_memory)
    assert cuda.is_cuda and cuda.records_kernel_time and cuda.tracks_memory
    assert cpu.total_memory_bytes() is None and cpu.peak_allocated_bytes() is None


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__
