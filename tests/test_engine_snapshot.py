"""The engine's snapshot for telemetry (issue 33 item 1): the start summary printed from `RoundPipe.snapshot()` is the
text the summary printed when it read the engine's attributes by name, the snapshot is frozen plain data, and the
live metrics read the engine's counters, trace and devices."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig, wrap_model
from accelerate_roundpipe.telemetry.engine_view import (
    DataParallelView,
    DeviceView,
    EngineSnapshot,
    OptimizerView,
    PlacementView,
    StoreView,
)
from accelerate_roundpipe.telemetry.metrics import EngineCounters, MetricsWindow
from accelerate_roundpipe.telemetry.summary import PREFIX, engine_summary
from accelerate_roundpipe.telemetry.trace import TraceRecorder

from toy_models import batch, tied_model

RESIDENT = re.compile(r"; this process is resident at [0-9.]+ (GiB|MiB) now")


def _unmeasured(text: str) -> str:
    """The summary without the process's resident memory, a measurement added since 53c2517 (checked on its own in
    `test_the_host_memory_line_says_what_the_process_holds`)."""
    return RESIDENT.sub("", text)


def _summary_as_before(engine) -> str:
    """`engine_summary` as it was at 53c2517, reading the engine by attribute name: the text the snapshot's summary
    must keep."""
    config, store = engine.config, engine.host_store
    devices = ", ".join(str(d.device) for d in engine.devices)
    plan = config.resolved_plan
    replan = " for the first pass; re-planned from its measured costs (the next `plan:` line)" if plan == "measured" \
        else ""
    num_devices = len(engine.devices)
    if config.num_microbatches is not None:
        count = f"{config.num_microbatches} per pass (num_microbatches)"
    elif plan == "measured":
        count = (f"{2 * num_devices} per pass (2 x devices) on the first pass, then the measured plan's choice "
                 f"(num_microbatches to fix it)")
    else:
        count = f"{2 * num_devices} per pass (2 x devices; num_microbatches to change it), at most one per row"
    rounds = (f"{config.microbatches_per_round} per round" if config.microbatches_per_round is not None
              else "all in one round")
    optimizer = engine.optimizer
    if optimizer is None:
        described = "none wrapped yet (engine.wrap_optimizer or accelerator.prepare)"
    elif not optimizer.async_step:
        described = f"{type(optimizer.inner).__name__}, exact step (sync; async_optimizer=true for the lagged one)"
    else:
        warmup = f", the first {optimizer.exact_steps_first} exact" if optimizer.exact_steps_first else ""
        described = f"{type(optimizer.inner).__name__}, lagged one step (async, staleness 1{warmup})"
    lines = [
        f"RoundPipe is on: {num_devices} worker(s) ({devices}), {len(engine.layers)} pipeline layers",
        f"  plan: {plan}, {engine.partition}{replan}",
        f"  micro-batches: {count}, {rounds}; recompute: {config.resolved_recompute}",
        f"  optimizer: {described}",
    ]
    placement = engine.optimizer_placement
    if placement is not None:
        lines.append(f"  optimizer state: {placement.summary()}")
    lines += [f"  {name}: {value}" for name, value in engine.summary_notes.items()]
    on_device = placement.device_bytes() if placement is not None else 0
    compute = sum(b.compute.numel() * b.compute.element_size() for b in store.buckets)
    host = max(store.estimated_bytes - on_device, compute)
    size = f"{host / 2**30:.2f} GiB" if host >= 2**30 else f"{host / 2**20:.1f} MiB"
    compute_dtypes = sorted({str(b.compute.dtype).removeprefix("torch.") for b in store.buckets})
    optim_dtypes = sorted({str(b.optim.dtype).removeprefix("torch.") for b in store.buckets if b.optim is not None})
    lines += [
        f"  host memory: about {size} for the store (compute {'/'.join(compute_dtypes)}, optimizer "
        f"{'/'.join(optim_dtypes) or '-'}, with AdamW state{' of the buckets on the host' if on_device else ''}), "
        f"pinned: {'yes' if store.pin_memory else 'no'}",
        f"  trace: {config.trace_path} (written at the end of training and at exit)" if config.trace_path
        else "  trace: off (ROUNDPIPE_TRACE=path.json records one)",
        "  (ROUNDPIPE_SUMMARY=0 hides this summary)",
    ]
    return "\n".join(lines)


def _train_once(engine, optimizer) -> None:
    x, mask, y = batch(rows=8, seed=0)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    optimizer.step()
    optimizer.zero_grad()


def _printed_summary(err: str) -> str:
    lines = [line.removeprefix(PREFIX) for line in err.splitlines() if line.startswith(PREFIX)]
    return "\n".join(lines[: lines.index("  (ROUNDPIPE_SUMMARY=0 hides this summary)") + 1])


ENGINES = {
    "CPU workers, lagged, a trace, a note": dict(
        config=dict(devices=["cpu", "cpu"], num_microbatches=4, recompute="layer", async_optimizer=True),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), trace=True, note=True),
    "lagged after exact warm-up steps, rounds": dict(
        config=dict(devices=["cpu", "cpu"], async_optimizer=True, async_warmup_steps=2, microbatches_per_round=2),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "exact, default micro-batches": dict(
        config=dict(devices=["cpu", "cpu"]), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
    "every bucket's state placed on the device": dict(
        config=dict(devices=["cpu"], num_microbatches=2, optimizer_placement="device"),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "placement under a budget, the measured plan": dict(
        config=dict(devices=["cpu", "cpu"], plan="measured", optimizer_placement="device",
                    optimizer_device_budget=2e-6),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)),
}


def _engine(case: dict, tmp_path) -> RoundPipe:
    trace = dict(trace_path=str(tmp_path / "trace.json")) if case.get("trace") else {}
    return RoundPipe(tied_model(), RoundPipeConfig(**case["config"], **trace))


@pytest.mark.parametrize("name", list(ENGINES))
def test_the_summary_from_the_snapshot_is_the_text_it_was(name, tmp_path, capsys):
    case = ENGINES[name]
    engine = _engine(case, tmp_path)
    try:
        assert _unmeasured(engine_summary(engine.snapshot())) == _summary_as_before(engine)  # no optimizer yet
        optimizer = engine.wrap_optimizer(case["optimizer"](engine.parameters()))
        if case.get("note"):
            engine.summary_notes["clipping"] = "max_grad_norm=1 (a note an integration adds)"
        assert _unmeasured(engine_summary(engine.snapshot())) == _summary_as_before(engine)
        capsys.readouterr()
        _train_once(engine, optimizer)
        if engine.config.resolved_plan == "static":  # the measured plan's partition changes after the first pass
            assert _unmeasured(_printed_summary(capsys.readouterr().err)) == _summary_as_before(engine)
        assert _unmeasured(engine_summary(engine.snapshot())) == _summary_as_before(engine)
    finally:
        engine.close()


def test_the_summary_of_a_lora_model_is_the_text_it_was(capsys):
    peft = pytest.importorskip("peft")
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    try:
        adapters = [p for p in engine.parameters() if p.requires_grad]
        optimizer = engine.wrap_optimizer(torch.optim.AdamW(adapters, lr=1e-3))
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
        capsys.readouterr()
        engine.forward_backward(input_ids=ids, labels=ids)
        optimizer.step()
        printed = _unmeasured(_printed_summary(capsys.readouterr().err))
        assert printed == _summary_as_before(engine) == _unmeasured(engine_summary(engine.snapshot()))
        assert engine.snapshot().store.compute_dtypes == ("float32",)  # the frozen base in there too
    finally:
        engine.close()


def test_the_host_memory_line_says_what_the_process_holds(tmp_path):
    """The summary's host memory line ends with the process's resident memory when it is taken: beside the store's
    count, what the libraries and the caller's objects hold ([Note: saved inputs in the start summary])."""
    from accelerate_roundpipe.runtime.disk import resident_memory_bytes

    engine = _engine(ENGINES["exact, default micro-batches"], tmp_path)
    try:
        resident = engine.snapshot().store.resident_bytes
        now = resident_memory_bytes()
        assert resident is not None and now is not None and 0.5 * now < resident < 2 * now
        (line,) = [line for line in engine_summary(engine.snapshot()).splitlines() if "host memory:" in line]
        (said,) = RESIDENT.findall(line)
        assert line.endswith(" now") and said in ("MiB", "GiB")
    finally:
        engine.close()
    assert resident_memory_bytes("/nonexistent/statm") is None


def _plain(value, where: str) -> None:
    """`value` is immutable plain data all the way down: strings, numbers, None, tuples, frozen dataclasses."""
    if dataclasses.is_dataclass(value):
        assert type(value).__dataclass_params__.frozen, f"{where}: {type(value).__name__} is not frozen"
        for f in dataclasses.fields(value):
            _plain(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            _plain(item, f"{where}[{i}]")
    else:
        assert value is None or type(value) in (str, int, float, bool), f"{where}: {type(value).__name__}"


def test_the_snapshot_is_frozen_plain_data_and_does_not_follow_the_engine(tmp_path):
    engine = _engine(ENGINES["CPU workers, lagged, a trace, a note"], tmp_path)
    try:
        engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
        engine.summary_notes["clipping"] = "off"
        snapshot = engine.snapshot()
        _plain(snapshot, "snapshot")
        with pytest.raises(dataclasses.FrozenInstanceError):
            snapshot.layers = 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            snapshot.store.pinned = True
        assert snapshot.devices == (DeviceView("cpu", False, False),) * 2
        assert snapshot.optimizer == OptimizerView("AdamW", lagged=True, exact_steps_first=0)
        assert snapshot.notes == (("clipping", "off"),) and snapshot.data_parallel is None
        assert snapshot.layers == len(engine.layers) and snapshot.partition == str(engine.partition)
        engine.summary_notes["gradient accumulation"] = "2 batch(es) per optimizer step"
        assert snapshot.notes == (("clipping", "off"),)  # taken then, not a view of the engine's dict
    finally:
        engine.close()


def test_the_data_parallel_line_comes_from_the_snapshot():
    snapshot = EngineSnapshot(
        devices=(DeviceView("cuda:0", True, True),), layers=4, plan="static", partition="F[0:3] B[0:3,3:4]",
        num_microbatches=None, microbatches_per_round=None, recompute="stage", trace_path=None,
        optimizer=OptimizerView("AdamW", False, 0), placement=PlacementView("host: all 4 trainable buckets", 0),
        data_parallel=DataParallelView(rank=1, world_size=2),
        store=StoreView(3 * 2**30, 2**30, ("bfloat16",), ("float32",), pinned=True))
    lines = engine_summary(snapshot).splitlines()
    assert lines[:6] == [
        "RoundPipe is on: 1 worker(s) (cuda:0), 4 pipeline layers",
        "  plan: static, F[0:3] B[0:3,3:4]",
        "  micro-batches: 2 per pass (2 x devices; num_microbatches to change it), at most one per row, all in one "
        "round; recompute: stage",
        "  optimizer: AdamW, exact step (sync; async_optimizer=true for the lagged one)",
        "  optimizer state: host: all 4 trainable buckets",
        "  data parallel: rank 1 of 2 (gradients reduce-scattered, optimizer state sharded, weights all-gathered per "
        "bucket; gloo)",
    ]
    assert lines[6] == ("  host memory: about 3.00 GiB for the store (compute bfloat16, optimizer float32, with AdamW "
                        "state), pinned: yes")


class _Gauge:
    tracks_memory = True

    def __init__(self, peak: int) -> None:
        self.peak = peak

    def peak_allocated_bytes(self) -> int | None:
        return self.peak


def test_the_metrics_read_the_counters_trace_and_gauges_live(tmp_path):
    counters = EngineCounters()
    window = MetricsWindow(counters, None, [_Gauge(2**30), _Gauge(3 * 2**30)])
    counters.count(torch.zeros(4, 16))
    metrics = window.sample()
    assert metrics["roundpipe/tokens_per_s"] > 0 and metrics["roundpipe/gpu_peak_gib"] == 3.0
    assert "roundpipe/bubble" not in metrics and "roundpipe/mfu" not in metrics
    assert window.sample()["roundpipe/tokens_per_s"] == 0  # nothing counted since the last sample
    traced = MetricsWindow(EngineCounters(), TraceRecorder(tmp_path / "t.json"), [], flops_per_token=6.0,
                           peak_flops=1e12)
    metrics = traced.sample()
    assert "roundpipe/gpu_peak_gib" not in metrics and metrics["roundpipe/bubble"] == 0.0
    assert metrics["roundpipe/mfu"] == 0.0
