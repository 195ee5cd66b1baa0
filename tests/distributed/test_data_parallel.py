"""[Note: data parallel]: N processes (gloo, CPU workers, float64) train exactly as ONE process on the whole
global batch; checkpoints resume; failures and mismatched settings are refused, never hang."""

from __future__ import annotations

import dp_scenarios
import pytest
import ranks
import torch
from ranks import Exited, ran, run_ranks


@pytest.fixture(scope="module")
def in_turn(tmp_path_factory):
    """The independent two-rank scenarios of this module's tests that need no fault and no timing, run in turn by
    one pair of processes (one start for all); each test reads its own (`ranks.ran`), a scenario that raised on a
    rank failing it with the traceback. The training run goes last: it sets the chunking of the collectives for
    its own process. Returns the path of its step-3 optimizer shards, and the reports."""
    folder = tmp_path_factory.mktemp("dp")
    path = str(folder / "optimizer-rank{rank}.pt")
    moe_reference, lora_reference = str(folder / "moe_reference.pt"), str(folder / "lora_reference.pt")
    dp_scenarios.moe_one_process_reference(moe_reference, 2)
    dp_scenarios.lora_reference(lora_reference)
    scenarios = [("mismatched_settings", ()), ("hugging_face_loss_counts_the_global_batch", ()),
                 ("first_pass_regrouped_on_every_rank", ()),
                 ("mixture_of_experts_counts_the_global_tokens", (moe_reference,)),
                 ("lora_counts_the_global_batch", (lora_reference,)), ("clips_of_rank_shares_are_refused", ()),
                 ("training_equals_one_process", (path,))]
    return path, run_ranks(ranks.in_turn, 2, [(name, getattr(dp_scenarios, name), args) for name, args in scenarios],
                           timeout_s=480)


@pytest.fixture(scope="module")
def two_rank_checkpoint(in_turn):
    """The 2-process training run (sync and async, accumulation, clip, uneven masks, checkpoints, deferred); its
    step-3 optimizer shards are saved for the other tests."""
    path, reports = in_turn
    return path, ran(reports, "training_equals_one_process")


def test_two_processes_train_as_one_on_the_global_batch(two_rank_checkpoint):
    _, reports = two_rank_checkpoint
    for key in reports[0]:  # the ranks' optimizer states cover every element once, each at most its padded range
        owned = [report[key][0] for report in reports]
        total, per_rank = reports[0][key][1:]
        assert sum(owned) == total and max(owned) <= per_rank, (key, owned, total, per_rank)


def test_four_processes_and_a_shard_of_another_world_size(two_rank_checkpoint):
    path, _ = two_rank_checkpoint
    run_ranks(dp_scenarios.small_run_and_foreign_shard, 4, path, timeout_s=180)


def test_a_one_process_engine_refuses_a_shard(two_rank_checkpoint):
    from accelerate_roundpipe import RoundPipe, RoundPipeConfig
    from accelerate_roundpipe.runtime.distribution.collectives import DataParallelError

    path, _ = two_rank_checkpoint
    engine = RoundPipe(dp_scenarios.tied_model(), RoundPipeConfig(devices=["cpu"], summary=False))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters()))
    with pytest.raises(DataParallelError, match="2 data-parallel processes"):
        optimizer.load_state_dict(torch.load(path.format(rank=0)))
    engine.close()


@pytest.fixture(scope="module")
def failures():
    """Rank 1 raises, then stalls, then kills itself, each in the third pass of a fresh pair of engines."""
    return run_ranks(dp_scenarios.ranks_fail, 2, timeout_s=120)


def test_a_rank_whose_pass_raises_stops_the_others_at_once(failures):
    first = failures[0]["raise"]  # rank 1 checked its own error (its own ValueError) in its process
    assert "rank(s) [1]" in first["error"] and "boom on rank 1" in first["error"], first
    assert first["elapsed"] < first["timeout"] / 2 and first["closed"]  # told by rank 1, not timed out
    assert first["close_s"] < first["timeout"] / 2  # a collective its peer never joins is abandoned


def test_a_stalled_rank_makes_the_others_raise_at_the_timeout(failures):
    first = failures[0]["stall"]
    assert "label counts at the start of pass 2" in first["error"] and "peer rank" in first["error"], first
    assert first["timeout"] - 0.5 < first["elapsed"] < first["timeout"] + 5 and first["closed"]


def test_a_killed_rank_makes_the_others_raise_within_the_timeout(failures):
    first, second = failures
    assert isinstance(second, Exited) and second.code == 3
    first = first["exit"]
    assert first["error"] is not None and "peer rank" in first["error"], first
    assert first["elapsed"] < first["timeout"] + 5 and first["closed"]


def test_mismatched_settings_are_refused_at_construction(in_turn):
    for report in ran(in_turn[1], "mismatched_settings"):
        assert "num_microbatches: rank 0: 2; rank 1: 3" in report["engine"], report
        assert "number of devices: rank 0: 1; rank 1: 2" in report["engine"], report
        assert "torch.optim.adamw.AdamW" in report["optimizer"] and "torch.optim.sgd.SGD" in report["optimizer"]
        assert "LBFGS" in report["lbfgs"] and "element-wise" in report["lbfgs"]


def test_a_hugging_face_model_counts_the_labels_of_the_global_batch(in_turn):
    ran(in_turn[1], "hugging_face_loss_counts_the_global_batch")


def test_the_first_pass_is_regrouped_on_every_rank(in_turn):
    """Before: one-layer backward stages under data parallelism whatever the host had (the sizing had no
    partition: `None.backward`)."""
    reports = ran(in_turn[1], "first_pass_regrouped_on_every_rank")
    assert all(r["stage_layers"] > 1 and r["backward_stages"] < 5 for r in reports), reports


def test_the_data_parallel_setting_without_a_process_group(monkeypatch):
    from accelerate_roundpipe import RoundPipe, RoundPipeConfig

    monkeypatch.setenv("ROUNDPIPE_DATA_PARALLEL", "1")
    assert RoundPipeConfig().data_parallel is True
    with pytest.raises(ValueError, match="init_process_group"):
        RoundPipe(dp_scenarios.tied_model(), RoundPipeConfig(devices=["cpu"], summary=False))
    engine = RoundPipe(dp_scenarios.tied_model(), RoundPipeConfig(devices=["cpu"], summary=False,
                                                                  data_parallel=False))
    assert engine.data_parallel is None
    engine.close()


def test_large_collectives_are_cut_into_equal_chunks_covering_each_range():
    from accelerate_roundpipe.runtime.distribution.gloo_exchange import COLLECTIVE_STREAMS, chunk_bounds

    assert chunk_bounds(100, min_elements=1000) == [(0, 100)]  # small: one collective
    for per_rank in (8 * 2**20, 8 * 2**20 + 48, 3 * 2**20):
        bounds = chunk_bounds(per_rank, min_elements=2**20)
        assert len(bounds) == min(COLLECTIVE_STREAMS, per_rank // 2**20)
        assert bounds[0][0] == 0 and bounds[-1][1] == per_rank
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gap, no overlap
        sizes = [stop - start for start, stop in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_a_mixture_of_experts_aux_loss_counts_the_global_tokens(in_turn):
    ran(in_turn[1], "mixture_of_experts_counts_the_global_tokens")  # against moe_one_process_reference


def test_peft_lora_trains_as_one_process_across_ranks(in_turn):
    ran(in_turn[1], "lora_counts_the_global_batch")  # against lora_reference


def test_a_one_process_engine_loads_every_ranks_shard_as_the_one_process_state(two_rank_checkpoint):
    # [Note: shards of another world size]: both ranks' step-3 shards join into plain AdamW's state after 3 steps.
    path, _ = two_rank_checkpoint
    model = dp_scenarios.tied_model()
    reference = dp_scenarios.reference_run(model, dp_scenarios.global_batches(5, 11)[:3], async_optimizer=False,
                                           clip=True)[4].state_dict()
    engine, optimizer = dp_scenarios.make_engine(model)
    optimizer.load_shards([torch.load(path.format(rank=rank)) for rank in (1, 0)])
    state = optimizer.state_dict()
    assert state["state"].keys() == reference["state"].keys()
    for index, values in reference["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-10, atol=0, msg=f"{index}.{key}")
    engine.close()


def test_clips_of_each_ranks_share_are_refused_and_the_l2_clip_is_global(in_turn):
    """A value clip, another norm type or a clip of some parameters would clip each rank's share of the gradient,
    where DDP clips the global one: refused by name; the L2 clip of every parameter is the global norm."""
    for report in ran(in_turn[1], "clips_of_rank_shares_are_refused"):
        assert report["world_size"] == 2
        assert report["refused"] == {"clip_grad_value_": True, "clip_grad_norm_ with norm_type=inf": True,
                                     "clip_grad_norm_ that no one engine's optimizer can take": True}, report
        assert abs(report["norm"] - report["global_norm"]) <= 1e-10 * report["global_norm"], report
