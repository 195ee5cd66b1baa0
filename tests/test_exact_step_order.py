"""[Note: exact step order] and [Note: uploads as versions land]: the exact step takes the lowest bucket whose
gradients are final, steps each bucket as it lands while the backward runs, and the next iteration's first
layers upload (and compute) before the step has written the layers above."""

from __future__ import annotations

import copy
import threading
import time

import torch

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.devices.device import Device
from accelerate_roundpipe.runtime.optimizer.optimizer import LaggedOptimizer

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model

LR = 1e-2


def _engine(model):
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu"], num_microbatches=2, async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1))
    return engine, optimizer


def _record(monkeypatch, name: str, log: list) -> None:
    """Log (what, bucket, time) around `LaggedOptimizer.<name>`, for each bucket of the list it takes first
    (`(bucket, ticket, ...)` entries)."""
    original = getattr(LaggedOptimizer, name)

    def recorded(self, entries, *args):
        log.extend((f"{name} begins", entry[0], time.monotonic()) for entry in entries)
        original(self, entries, *args)
        log.extend((f"{name} ends", entry[0], time.monotonic()) for entry in entries)

    monkeypatch.setattr(LaggedOptimizer, name, recorded)


def test_buckets_already_final_step_bottom_up_and_match_plain_adamw(monkeypatch):
    model = tied_model()
    reference = copy.deepcopy(model)
    x, mask, y = batch()
    engine, optimizer = _engine(model)
    steps: list = []
    _record(monkeypatch, "_step_buckets", steps)
    engine.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
    engine.synchronize()  # every gradient is final before the step starts
    optimizer.step()
    engine.synchronize()
    order = [min(bucket.layers) for what, bucket, _ in steps if what.endswith("begins")]
    assert order == sorted(order) and len(order) == len(engine._store.trainable_buckets)

    _, grads = reference_loss_and_grads(reference, x, mask, y, num_microbatches=2)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    for name, p in reference.named_parameters():
        p.grad = grads[name]
    plain.step()
    stepped = dict(engine.module.named_parameters())
    for name, p in reference.named_parameters():
        assert_close(stepped[name].detach(), p.detach(), rtol=1e-12, what=name)
    engine.close()


def test_buckets_step_as_their_gradients_land_while_the_backward_runs(monkeypatch):
    engine, optimizer = _engine(tied_model())
    steps: list = []
    _record(monkeypatch, "_step_buckets", steps)
    commits: list[float] = []

    def slow_commits(point: str) -> None:
        if point == "commit":
            time.sleep(0.05)
            commits.append(time.monotonic())

    x, mask, y = batch()
    with faults.injected(slow_commits):
        engine.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
        optimizer.step()
        engine.synchronize()
    begins = [(min(bucket.layers), t) for what, bucket, t in steps if what.endswith("begins")]
    top = max(layer for layer, _ in begins)
    # The top bucket lands first and is stepped at once, long before the backward's last gradient is committed.
    assert begins[0][0] == top and begins[0][1] < max(commits) - 0.04
    engine.close()


def test_the_next_forward_uploads_its_first_layers_before_the_step_is_written(monkeypatch):
    engine, optimizer = _engine(tied_model())
    log: list = []
    _record(monkeypatch, "_exact_steps", log)
    store = engine._store
    bucket_of_host = {b.compute.data_ptr(): b for b in store.buckets}
    bucket_of_host.update({b.optim.data_ptr(): b for b in store.trainable_buckets})
    original_upload = Device.upload_params_into

    def recorded_upload(self, flats, hosts):
        for host in hosts:
            log.append(("upload", bucket_of_host[host.data_ptr()], time.monotonic()))
        return original_upload(self, flats, hosts)

    monkeypatch.setattr(Device, "upload_params_into", recorded_upload)

    def slow_steps(point: str) -> None:
        if point == "optimizer.step" and threading.current_thread().name == "roundpipe-optimizer":
            time.sleep(0.03)

    x, mask, y = batch()
    engine.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
    engine.synchronize()
    with faults.injected(slow_steps):
        optimizer.clip_grad_norm_(1e-3)  # every bucket then waits for the global norm: the step goes bottom-up
        optimizer.step()
        log.append(("step queued", None, time.monotonic()))
        engine.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
        engine.synchronize()
    queued = next(t for what, _, t in log if what == "step queued")
    uploads = [(bucket.index, t) for what, bucket, t in log if what == "upload" and t > queued]
    written = {bucket.index: t for what, bucket, t in log if what == "_exact_steps ends"}
    first_upload = min(t for _, t in uploads)
    assert first_upload < max(written.values()) - 0.02  # the first layer moved while the layers above were written
    for index, t in uploads:  # and no upload read a version before it was written
        if index in written:
            assert t >= written[index], f"bucket {index} uploaded before its step was written"
    engine.close()


def _train_float32(look_every_step: bool, steps: int = 3):
    """Exact AdamW steps on a float32 model with float64 optimizer copies; `look_every_step` synchronizes (which
    writes the compute copies back) after each step."""
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, async_optimizer=False,
                                                     param_dtype=torch.float32, optimizer_dtype=torch.float64))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
    losses = []
    for step in range(steps):
        x, mask, y = batch(seed=step)
        losses.append(float(engine.forward_backward(x.float(), mask, labels=y,
                                                    loss_fn=torch.nn.functional.cross_entropy)))
        optimizer.step()
        optimizer.zero_grad()
        if look_every_step:
            engine.synchronize()
    engine._dispatch.wait_inflight()  # the workers are done (they fork the process RNG the next model draws from)
    return engine, losses


def test_exact_steps_upload_the_optimizer_copy_and_looking_changes_nothing():
    """[Note: exact step without write-back]: the devices read the stepped optimizer copy, cast to the compute
    dtype on upload, exactly what a write-back would have given them; the compute copies are written only when
    someone looks, and then hold the newest weights."""
    unseen, unseen_losses = _train_float32(look_every_step=False)
    looked, looked_losses = _train_float32(look_every_step=True)
    assert unseen_losses == looked_losses  # bit for bit: a cast on upload is the host's cast
    unseen._background.optimizer.thread.wait_idle()
    stale = [b for b in unseen._store.trainable_buckets if not torch.equal(b.compute, b.optim.to(b.compute.dtype))]
    assert stale and all(b.current_in_optim for b in stale)  # nobody looked: no write-back pass ran
    unseen.synchronize()
    for (name, a), (_, b) in zip(unseen.module.named_parameters(), looked.module.named_parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    for bucket in unseen._store.trainable_buckets:
        assert torch.equal(bucket.compute, bucket.optim.to(bucket.compute.dtype)) and not bucket.current_in_optim
    unseen.close()
    looked.close()


def _clipped_float32(in_optimizer: bool, steps: int = 3):
    engine = RoundPipe(tied_model().float(), RoundPipeConfig(devices=["cpu"], num_microbatches=2,
                                                             async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1))
    norms = []
    for step in range(steps):
        x, mask, y = batch(seed=step)
        engine.forward_backward(x.float(), mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
        if in_optimizer:
            norms.append(float(optimizer.clip_grad_norm_(1e-3)))
        else:
            engine.synchronize()
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(engine.parameters()), 1e-3)))
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    weights = {name: p.detach().clone() for name, p in engine.named_parameters()}
    engine.close()
    return norms, weights


def test_a_float32_clip_runs_inside_the_fused_kernel_as_torchs_clip(monkeypatch):
    """[Note: clip in the kernel]: no scaling pass over the gradients, and the weights torch's clip gives (to the
    rounding of a division by the scale against a multiplication by the coefficient)."""
    from accelerate_roundpipe.runtime.state.host_store import Bucket

    reference_norms, reference = _clipped_float32(in_optimizer=False)
    passes = []
    original_scale = Bucket.scale
    monkeypatch.setattr(Bucket, "scale", lambda self, ratio: (passes.append(ratio), original_scale(self, ratio)))
    norms, weights = _clipped_float32(in_optimizer=True)
    assert passes == [] and all(n > 1e-3 for n in norms)
    torch.testing.assert_close(norms, reference_norms, rtol=1e-6, atol=0)
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
