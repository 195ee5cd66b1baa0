"""The integrations' data-parallel helpers without a data-parallel engine: which launches are accepted, which loss
kind a backward sees and how it is scaled (checked against plain PyTorch on two shards), per-rank file names.
([Note: one process per machine], [Note: data-parallel loss scaling])"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.integrations import multi_process as dp


@pytest.mark.parametrize("name,processes,accepted", [
    ("NO", 1, True), ("MULTI_GPU", 2, True), ("MULTI_CPU", 4, True), ("DistributedType.MULTI_GPU", 2, True),
    ("DEEPSPEED", 2, False), ("FSDP", 2, False), ("MEGATRON_LM", 2, False), ("XLA", 8, False)])
def test_distributed_types(name, processes, accepted):
    if accepted:
        dp.check_distributed_type(name, processes)
    else:
        with pytest.raises(ValueError, match=f"distributed_type={name}.*one process per machine"):
            dp.check_distributed_type(name, processes)


def test_gpu_claims_follow_cuda_visible_devices():
    assert dp.claimed_gpus(["cuda:0", "cuda:1", "cpu"], {}) == ["0", "1"]
    assert dp.claimed_gpus(["cuda:0", "cuda:1"], {"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert dp.claimed_gpus(["cpu", "cpu"], {"CUDA_VISIBLE_DEVICES": "0"}) == []


def test_one_process_per_machine_refuses_shared_gpus_only():
    # Two machines, one process each, the same GPU numbers: fine.
    dp.check_one_process_per_machine([("a", ["0", "1"]), ("b", ["0", "1"])])
    # Two processes on one machine with CPU workers, or with disjoint GPUs: fine.
    dp.check_one_process_per_machine([("a", []), ("a", [])])
    dp.check_one_process_per_machine([("a", ["0", "1"]), ("a", ["2", "3"])])
    # One process per GPU: every process sees (and by default drives) every GPU.
    claims = [("a", ["0", "1"]), ("a", ["0", "1"]), ("b", ["0"]), ("b", ["1"])]
    assert dp.shared_gpus(claims) == {"a": {"0": [0, 1], "1": [0, 1]}}
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] run on the same machine \(a\).*ROUNDPIPE_DEVICES"):
        dp.check_one_process_per_machine(claims)


def test_multi_process_run_needs_a_data_parallel_engine():
    # Fakes of what the engine provides: `engine.data_parallel` (None when it trains alone).
    alone = SimpleNamespace(data_parallel=None)
    dp.check_engine_data_parallel(alone, 1)
    with pytest.raises(ValueError, match="not data-parallel.*ROUNDPIPE_DATA_PARALLEL"):
        dp.check_engine_data_parallel(alone, 2)
    with pytest.raises(ValueError, match="not data-parallel"):
        dp.check_engine_data_parallel(object(), 2)  # an engine from before data parallelism
    dp.check_engine_data_parallel(SimpleNamespace(data_parallel=SimpleNamespace(rank=1, world_size=2)), 2)
    with pytest.raises(ValueError, match="group has 2 ranks but this run has 4"):
        dp.check_engine_data_parallel(SimpleNamespace(data_parallel=SimpleNamespace(rank=0, world_size=2)), 4)
    # A data-parallel engine under an accelerate that set itself up for one process (a CPU-only torchrun without
    # use_cpu): every rank would read the whole data set and save as the main process.
    with pytest.raises(ValueError, match="accelerate sees one process.*use_cpu true"):
        dp.check_engine_data_parallel(SimpleNamespace(data_parallel=SimpleNamespace(rank=0, world_size=2)), 1)


def test_loss_kind_tells_the_engines_nodes_apart():
    model = tiny_llama()
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    try:
        model.train()
        batch = lm_batch()
        fused = model(**batch).loss  # the deferred fused pass
        assert dp.loss_kind(fused) == dp.DEFERRED and dp.loss_kind(fused * 0.5 + 1) == dp.DEFERRED
        engine.drop_pending_gradients()
        logits = model(input_ids=batch["input_ids"]).logits  # a forward-only pipeline
        from_logits = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        assert dp.loss_kind(from_logits) == dp.PIPELINE
        fused = model(**batch).loss
        assert dp.loss_kind(fused + from_logits) == dp.MIXED
        assert dp.loss_kind(torch.ones(2, requires_grad=True).sum()) == dp.OTHER
        engine.drop_pending_gradients()
    finally:
        engine.close()
    assert dp.backward_scale(dp.PIPELINE, 4) == 0.25 and dp.backward_scale(dp.DEFERRED, 4) == 1.0
    assert dp.backward_scale(dp.PIPELINE, 1) == 1.0
    with pytest.raises(ValueError, match="no single scale"):
        dp.backward_scale(dp.MIXED, 2)


def _shard_losses(weight, rows, labels_mask, shards):
    """Per-rank token sums of a squared error (a stand-in for a token loss), and the global label count."""
    per_token = ((rows @ weight) ** 2).squeeze(-1) * labels_mask
    return [per_token[s].sum() for s in shards], labels_mask.sum()


def test_trainer_scaling_gives_the_whole_batch_gradient():
    """A loss from logits under data parallelism: what the Trainer does to it, then what RoundPipe's backward does,
    summed over two ranks as the engine sums: the gradient of the whole batch's loss on one process. (The fused
    loss's side, the factor divided out again, is checked end to end in tests/distributed.)"""
    torch.manual_seed(0)
    rows, weight = torch.randn(6, 3, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.float64)  # uneven label counts: 2 and 3
    shards, world = [slice(0, 3), slice(3, 6)], 2

    whole = weight.clone().requires_grad_()
    sums, count = _shard_losses(whole, rows, mask, [slice(0, 6)])
    (sums[0] / count).backward()

    factor = dp.trainer_loss_multiplier(True, True, count, world)
    assert factor == world and dp.trainer_loss_multiplier(False, True, count, world) == 1
    assert dp.trainer_loss_multiplier(True, True, None, world) == 1

    # A loss from logits: each rank's token sum over the global count, times the Trainer's factor, then 1/world.
    summed = torch.zeros_like(weight)
    for shard in shards:
        w = weight.clone().requires_grad_()
        (local,), _ = _shard_losses(w, rows, mask, [shard])
        loss = local / count * factor
        (loss * dp.backward_scale(dp.PIPELINE, world)).backward()
        summed += w.grad
    torch.testing.assert_close(summed, whole.grad, rtol=1e-12, atol=0)


def test_per_rank_file_names(tmp_path):
    assert dp.per_rank_name("optimizer.pt", 0, 1) == "optimizer.pt"
    assert dp.per_rank_name("optimizer.pt", 1, 2) == "optimizer.rank1-of-2.pt"
    assert dp.per_rank_name("optimizer_1.bin", 3, 4) == "optimizer_1.rank3-of-4.bin"
    names = {dp.per_rank_name("optimizer.pt", r, 4) for r in range(4)}
    assert len(names) == 4
    for r in range(2):
        (tmp_path / dp.per_rank_name("optimizer.pt", r, 2)).write_text("")
    error = dp.missing_shard_error(str(tmp_path), "optimizer.pt", 2, 4)
    assert "no optimizer.rank2-of-4.pt" in str(error)
    assert "optimizer.rank0-of-2.pt, optimizer.rank1-of-2.pt" in str(error)
