"""`benchmarks/host_bytes.py --tiny` on CPU workers: every configuration recorded, the kinds add up to the total, and
the counts are what the model's parameters say: compute copies their element size, optimizer copies and gradients
float32, AdamW's two states 8 bytes a parameter, a stock loop's accumulation a deferred buffer, a lagged look a
stash, LoRA's frozen weights one bfloat16 copy."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from benchmarks import host_bytes

    out = tmp_path_factory.mktemp("host_bytes") / "records.jsonl"
    host_bytes.main(["--tiny", "--out", str(out)])
    return {r["config"]: r for r in (json.loads(line) for line in out.read_text().splitlines())}


def model_counts(lora: bool) -> dict:
    """Parameters and compute-copy bytes of the benchmark's tiny model, from the model itself."""
    from benchmarks import host_bytes

    model = host_bytes.small_model("qwen3", host_bytes.TINY, lora)
    params = {id(p): p for p in model.parameters()}.values()
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    return {"trainable": sum(p.numel() for p in trainable), "frozen": sum(p.numel() for p in frozen),
            "trainable tensors": len(trainable), "frozen tensors": len(frozen),
            "element sizes": {p.element_size() for p in trainable}, "frozen sizes": {p.element_size() for p in frozen}}


def test_every_configuration_is_recorded(records):
    from benchmarks import host_bytes

    assert list(records) == list(host_bytes.CONFIGS)
    for record in records.values():
        assert record["devices"] == "cpu,cpu" and record["optimizer_placement"] == "host"
        assert len(record["losses"]) == host_bytes.TINY["steps"] * host_bytes.CONFIGS[record["config"]][2]
        assert record["counted_bytes"] > 0 and isinstance(record["rss_growth_bytes"], int)  # printed beside it


def test_the_kinds_add_up_to_the_total(records):
    from benchmarks.host_buffers import KINDS, TRAINABLE_KINDS

    for record in records.values():
        assert set(record["bytes"]) == set(KINDS)
        assert sum(record["bytes"].values()) == record["counted_bytes"]
        per = record["bytes_per_trainable_param"]
        assert sum(per.values()) == pytest.approx(record["host_bytes_per_trainable_param"], abs=1e-3)
        trainable_bytes = sum(record["bytes"][k] for k in TRAINABLE_KINDS)
        assert trainable_bytes / record["trainable_params"] == pytest.approx(
            record["host_bytes_per_trainable_param"], abs=1e-3)
        assert sum(record["pinned_bytes"].values()) == 0  # CPU workers page-lock nothing


@pytest.mark.parametrize("config", ["exact", "exact+clip", "exact+accumulation", "deferred+accumulation", "lagged",
                                    "lora"])
def test_the_counts_follow_the_model(records, config):
    record = records[config]
    model = model_counts(lora=config == "lora")
    n, elements = record["trainable_params"], record["trainable_elements"]
    assert n == model["trainable"] and record["frozen_params"] == model["frozen"]
    # each parameter's view is aligned in its bucket: at most 15 elements of padding each
    assert n <= elements < n + 16 * model["trainable tensors"]
    (size,) = model["element sizes"]  # bfloat16 weights; PEFT's adapters float32
    assert size == (4 if config == "lora" else 2)
    held = record["bytes"]
    assert held["compute"] == size * elements
    assert held["optimizer copies"] == 4 * elements
    # counted after zero_grad(set_to_none=True): the buckets gave their buffers back ([Note: no spare gradient buffer])
    assert held["gradients"] == 0
    assert held["optimizer states"] == 8 * n  # AdamW's exp_avg and exp_avg_sq, each shaped like its parameter
    assert held["optimizer scalars"] == 4 * model["trainable tensors"]  # fused AdamW's float32 `step` per tensor
    # the pool's free buffers: whole buckets' gradient buffers, what the steps needed at once (the gradients held
    # until their step and the downloads in flight beside them: at most one more per bucket)
    assert 0 < held["spare gradients"] <= 2 * 4 * elements and held["spare gradients"] % 4 == 0
    # the gradient buffers alive at once: every bucket's where a clip or accumulation holds them until the step
    peak = record["grad_buffers_peak_bytes"]
    assert held["spare gradients"] <= peak <= 2 * 4 * elements
    if config in ("exact+clip", "exact+accumulation", "deferred+accumulation"):
        assert peak >= 4 * elements
    # a deferred pass's pending gradients are its download buffers, given back at its resolution
    # ([Note: deferred gradient commit]): none is held after the steps
    assert held["deferred gradients"] == 0
    assert held["stashes"] == 0  # counted before any look
    assert record["after_look_bytes"]["stashes"] == (2 * elements if config == "lagged" else 0)
    if config == "lora":
        (frozen_size,) = model["frozen sizes"]
        assert frozen_size == 2
        assert model["frozen"] <= record["frozen_elements"] < model["frozen"] + 16 * model["frozen tensors"]
        assert held["frozen compute"] == frozen_size * record["frozen_elements"]  # one copy, no optimizer state
    else:
        assert held["frozen compute"] == 0 and record["frozen_bytes_per_frozen_param"] is None


def test_the_disk_tiers_staging_slots_are_counted(records):
    """The disk tier's staging slots are host memory (what the disk buckets' steps read into): counted, at most
    three slots of a bucket's 12 bytes an element (optimizer copy, two AdamW states); no other configuration has any."""
    for config, record in records.items():
        staging = record["bytes"]["disk staging"]
        if config == "exact+disk":
            assert 0 < staging <= 3 * 12 * record["trainable_elements"] and staging % 12 == 0
            # most states are in the swap files (a bucket whose slots would cost more than its state stays)
            assert record["bytes"]["optimizer states"] < 8 * record["trainable_elements"]
        else:
            assert staging == 0
