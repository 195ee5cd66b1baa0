"""Crafted RoundPipe files in a checkpoint (issue 31 item 4): a per-rank file name or a shard naming an absurd world
size, an engine state nested deeper than the parser's stack or larger than any RoundPipe writes, counters out of
the range the engine produces, a lagged-weights key no bucket has. Each raises `CheckpointError` naming the file
(and the field), before anything is sized by it ([Note: checkpoint files], [Note: engine state ranges]), through
`accelerator.load_state` and the Trainer's resume. The loads that once sized a set by the crafted number run
under a cap on the address space, so a regression fails with MemoryError instead of eating the machine."""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama

from accelerate_roundpipe import CheckpointError, RoundPipeAccelerator, RoundPipePlugin

ENGINE_STATE = "roundpipe_engine_state.json"
LAGGED_WEIGHTS = "roundpipe_lagged_weights.safetensors"
ABSURD = 10**12


@contextlib.contextmanager
def address_space_capped(extra_bytes: int = 4 << 30):
    """At most `extra_bytes` more address space than this process has now, for the block."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = size + extra_bytes if hard == resource.RLIM_INFINITY else min(size + extra_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture
def saved(tmp_path):
    """A one-process accelerator whose `save_state` wrote every RoundPipe file (bf16 compute copies, lagged step)."""
    plugin = dict(CPU_WORKERS, param_dtype="bfloat16", async_optimizer=True)
    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(**plugin))
    model = tiny_llama()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.train()
    for seed in (0, 1):
        accelerator.backward(model(**lm_batch(seed=seed)).loss)
        optimizer.step()
        optimizer.zero_grad()
    directory = str(accelerator.save_state(str(tmp_path / "checkpoint")))
    assert {ENGINE_STATE, LAGGED_WEIGHTS, "optimizer.bin"} <= set(os.listdir(directory))
    yield accelerator, directory
    accelerator.roundpipe_engine(model).close()


def refused(accelerator, directory: str, name: str, *fields: str) -> str:
    """`load_state` raises `CheckpointError` naming the file `name` (and each of `fields`), within seconds."""
    started = time.monotonic()
    with address_space_capped(), pytest.raises(CheckpointError) as raised:
        accelerator.load_state(directory)
    message = str(raised.value)
    assert time.monotonic() - started < 30, message
    assert raised.value.path == os.path.join(directory, name) and name in message and directory in message, message
    for field in fields:
        assert f"`{field}`" in message, message
    return message


def _edit_engine_state(directory: str, drop: tuple[str, ...] = (), **changes) -> None:
    path = os.path.join(directory, ENGINE_STATE)
    with open(path) as f:
        state = json.load(f)
    for key in drop:
        state.pop(key, None)
    state.update(changes)
    with open(path, "w") as f:
        json.dump(state, f)


# ---------------------------------------------------------------------- optimizer files

def test_a_shard_name_of_an_absurd_world_size_is_refused_before_anything_is_sized(saved):
    accelerator, directory = saved
    os.remove(os.path.join(directory, "optimizer.bin"))
    crafted = f"optimizer.rank0-of-{ABSURD}.bin"
    with open(os.path.join(directory, crafted), "wb") as f:
        f.write(b"x")
    message = refused(accelerator, directory, crafted)
    assert f"a run of {ABSURD} processes" in message, message


@pytest.mark.parametrize("name, problem", [("optimizer.rank2-of-2.bin", "names rank 2 of a run of 2"),
                                           ("optimizer.rank0-of-0.bin", "names a run of 0 processes"),
                                           ("optimizer.rank01-of-2.bin", "not a name RoundPipe writes")])
def test_a_shard_name_no_run_writes_is_refused(saved, name, problem):
    accelerator, directory = saved
    os.remove(os.path.join(directory, "optimizer.bin"))
    torch.save({}, os.path.join(directory, name))
    assert problem in refused(accelerator, directory, name)


def _shard(rank: int, world_size: int) -> dict:
    return {"data_parallel": {"world_size": world_size, "rank": rank, "layout": []},
            "shard": {"state": {}, "param_groups": [{"params": []}]}}


@pytest.mark.parametrize("contents, problem", [
    ((_shard(0, ABSURD), _shard(1, ABSURD)), f"names a run of {ABSURD} processes"),
    ((_shard(1, 2), _shard(0, 2)), "holds the shard of rank 1 of 2 processes, but its name says rank 0 of 2"),
    (({"data_parallel": {"world_size": 2, "rank": 0, "layout": [[0, "w", 5, 2]]}, "shard": {}}, _shard(1, 2)),
     "shard layout"),
    (({"state": {}}, _shard(1, 2)), "no optimizer state_dict"),
], ids=["absurd-world-size", "renamed", "layout", "no-state-dict"])
def test_a_shard_whose_contents_no_run_writes_is_refused_before_the_shards_are_joined(saved, contents, problem):
    accelerator, directory = saved
    os.remove(os.path.join(directory, "optimizer.bin"))
    for rank, state in enumerate(contents):
        torch.save(state, os.path.join(directory, f"optimizer.rank{rank}-of-2.bin"))
    assert problem in refused(accelerator, directory, "optimizer.rank0-of-2.bin")


def test_a_missing_shard_of_a_large_run_names_a_few_and_counts_the_rest(tmp_path):
    from accelerate_roundpipe.integrations.multi_process import written_by_another_world_size

    (tmp_path / "optimizer.rank0-of-1000.pt").write_text("")
    (tmp_path / "optimizer.rank2-of-1000.pt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"1000 processes, but not those of rank\(s\) \[1, 3, 4\] and 995 "
                                                r"more"):
        written_by_another_world_size(str(tmp_path), "optimizer.pt", 0, 1)


# ---------------------------------------------------------------------- the engine state

@pytest.mark.parametrize("depth", [200_000, 20_000], ids=["larger-than-any-state", "deeper-than-the-stack"])
def test_an_engine_state_nested_deeply_is_refused(saved, depth):
    accelerator, directory = saved
    with open(os.path.join(directory, ENGINE_STATE), "w") as f:
        f.write("[" * depth + "]" * depth)
    message = refused(accelerator, directory, ENGINE_STATE)
    assert "bytes" in message or "nested too deeply" in message, message


@pytest.mark.parametrize("changes, fields", [
    (dict(num_passes=10**30, training_passes=10**30), ("num_passes", "training_passes")),
    (dict(seed=2**64), ("seed",)),
    (dict(next_device=7, num_devices=2), ("next_device",)),
    (dict(next_device=2), ("next_device",)),
    (dict(num_devices=0), ("num_devices",)),
    (dict(optimizer_steps=-1), ("optimizer_steps",)),
    (dict(evaluation_passes="3"), ("evaluation_passes",)),
    (dict(training_passes=5, evaluation_passes=0, num_passes=2), ("training_passes", "evaluation_passes")),
], ids=["passes", "seed", "device-index", "device-index-older", "devices", "steps", "not-a-number", "passes-sum"])
def test_an_engine_state_counter_out_of_range_is_refused_naming_the_field(saved, changes, fields):
    accelerator, directory = saved
    # A device index alone: as an older state without `num_devices` (checked against this engine's 2 devices).
    _edit_engine_state(directory, drop=("num_devices",) if set(changes) == {"next_device"} else (), **changes)
    refused(accelerator, directory, ENGINE_STATE, *fields)


def test_the_engine_state_records_its_devices_and_loads_back(saved):
    accelerator, directory = saved
    with open(os.path.join(directory, ENGINE_STATE)) as f:
        state = json.load(f)
    assert state["num_devices"] == 2 and 0 <= state["next_device"] < 2, state
    accelerator.load_state(directory)  # unedited: every field in range


def test_the_engine_refuses_an_engine_state_out_of_range_given_directly():
    from accelerate_roundpipe import RoundPipeConfig, wrap_model

    engine = wrap_model(tiny_llama(), RoundPipeConfig(**CPU_WORKERS, summary=False))
    try:
        with pytest.raises(ValueError, match=r"`num_passes` = 10{30}, not a whole number"):
            engine.load_engine_state({"seed": 0, "num_passes": 10**30, "next_device": 0})
        engine.load_engine_state({"seed": 3, "num_passes": 4, "next_device": 1})  # an older state, in range
        assert engine.engine_state()["next_device"] == 1
    finally:
        engine.close()


# ---------------------------------------------------------------------- the lagged weights

def test_a_lagged_weights_key_no_bucket_has_is_refused(saved):
    from safetensors.torch import load_file, save_file

    accelerator, directory = saved
    path = os.path.join(directory, LAGGED_WEIGHTS)
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors["9" * 5000] = tensors.pop(key)  # more digits than int() converts
    save_file(tensors, path)
    assert "holds weights for bucket" in refused(accelerator, directory, LAGGED_WEIGHTS)


# ---------------------------------------------------------------------- the Trainer's resume

@pytest.mark.parametrize("crafted", ["shard name", "nested engine state"])
def test_the_trainers_resume_refuses_a_crafted_file(tmp_path, monkeypatch, crafted):
    from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments

    for name, value in dict(ROUNDPIPE_DEVICES="cpu,cpu", ROUNDPIPE_NUM_MICROBATCHES="2",
                            ROUNDPIPE_ASYNC_OPTIMIZER="false").items():
        monkeypatch.setenv(name, value)
    rows = [{k: v[i] for k, v in lm_batch(rows=8, seed=3).items()} for i in range(8)]

    def trainer(max_steps: int):
        args = RoundPipeTrainingArguments(
            output_dir=str(tmp_path / "run"), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
            logging_steps=1, save_strategy="steps", save_steps=2, report_to=[], disable_tqdm=True, seed=0,
            use_cpu=True)
        return RoundPipeTrainer(model=tiny_llama(), args=args, train_dataset=rows)

    first = trainer(2)
    first.train()
    first.roundpipe_engine.close()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    if crafted == "shard name":
        os.remove(os.path.join(checkpoint, "optimizer.pt"))
        name = f"optimizer.rank0-of-{ABSURD}.pt"
        with open(os.path.join(checkpoint, name), "wb") as f:
            f.write(b"x")
    else:
        name = ENGINE_STATE
        with open(os.path.join(checkpoint, name), "w") as f:
            f.write("[" * 200_000 + "]" * 200_000)
    resumed = trainer(4)
    try:
        with address_space_capped(), pytest.raises(CheckpointError) as raised:
            resumed.train(resume_from_checkpoint=checkpoint)
        assert raised.value.path == os.path.join(checkpoint, name), str(raised.value)
    finally:
        if resumed.roundpipe_engine is not None:
            resumed.roundpipe_engine.close()
