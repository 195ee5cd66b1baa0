"""`RoundPipeTrainer` with the disk tier (`--roundpipe_host_memory_budget` tiny: every bucket's optimizer copy and
state in swap files under `--roundpipe_offload_dir`): it trains as the plain Trainer does (clipping on, a cosine
schedule), and a checkpoint written with every bucket on disk resumes with every bucket on the host (and the reverse)
as the uninterrupted run goes on; the swap files are gone when the engines close."""

from __future__ import annotations

import os

import pytest
from roundpipe_testing import assert_close_lists
from test_optimizer_placement_trainer import _assert_same_weights, _close, _data, _flags, _logged, _trainer, _weights


def _disk_flags(offload_dir: str, on_disk: bool) -> list[str]:
    flags = ["--roundpipe_devices", "cpu,cpu", "--roundpipe_num_microbatches", "2",
             "--roundpipe_offload_dir", offload_dir]
    return flags + (["--roundpipe_host_memory_budget", "1e-9"] if on_disk else [])


def _assert_on_disk(trainer, on_disk: bool) -> None:
    placement = trainer.roundpipe_engine.optimizer_placement
    trainable = sorted(b.index for b in trainer.roundpipe_engine.host_store.trainable_buckets)
    assert placement.disk_buckets == (trainable if on_disk else [])


def test_the_disk_tier_trains_as_the_plain_trainer(tmp_path):
    data = _data()
    reference = _trainer(data, _flags(str(tmp_path / "plain")), roundpipe=False)
    reference.train()
    ours = _trainer(data, _flags(str(tmp_path / "rp"), *_disk_flags(str(tmp_path / "swap"), True)), roundpipe=True)
    assert float(ours.args.roundpipe_host_memory_budget) == 1e-9  # a training argument, as the command line gave it
    try:
        ours.train()
        _assert_on_disk(ours, True)
        assert any(norm > 1.0 for norm in _logged(reference, "grad_norm"))  # the clip applied
        assert_close_lists(_logged(ours, "loss"), _logged(reference, "loss"), "losses")
        assert_close_lists(_logged(ours, "grad_norm"), _logged(reference, "grad_norm"), "gradient norms", 3e-4)
        _assert_same_weights(_weights(ours), _weights(reference), rtol=1e-4, atol=5e-5)
    finally:
        _close(ours)
    assert not [n for n in os.listdir(tmp_path / "swap") if n.startswith("roundpipe-swap-")]


@pytest.mark.parametrize("saved_on_disk", [True, False])
def test_a_checkpoint_resumes_across_the_disk_and_the_host(tmp_path, saved_on_disk):
    data = _data()
    saving = ["--save_strategy", "steps", "--save_steps", "2"]
    swap = str(tmp_path / "swap")
    full = _trainer(data, _flags(str(tmp_path / "full"), *saving, *_disk_flags(swap, saved_on_disk)), roundpipe=True)
    try:
        full.train()
        _assert_on_disk(full, saved_on_disk)
        full_losses, full_weights = _logged(full, "loss"), _weights(full)
    finally:
        _close(full)
    checkpoint = str(tmp_path / "full" / "checkpoint-2")
    resumed = _trainer(data, _flags(str(tmp_path / "resumed"), *saving, *_disk_flags(swap, not saved_on_disk)),
                       roundpipe=True)
    try:
        resumed.train(resume_from_checkpoint=checkpoint)
        _assert_on_disk(resumed, not saved_on_disk)
        assert_close_lists(_logged(resumed, "loss")[2:], full_losses[2:], "steps 3-4 after resume", 1e-6)
        _assert_same_weights(_weights(resumed), full_weights, rtol=1e-6, atol=1e-7)
    finally:
        _close(resumed)
