"""The LM head in vocabulary shards, planned: the shard costs, the shard count against brute force, the ring filling
against the simulator, the simulated 8-GPU targets, and plans for 2-8 devices on a 24 GiB card."""

from __future__ import annotations

import math
import random

import pytest
from test_planner import brute_force, random_costs

from accelerate_roundpipe.plan.classic import compare_bubbles, split_head_plan
from accelerate_roundpipe.plan.decoder_shapes import MODEL_SHAPES, decoder_layer_flops
from accelerate_roundpipe.plan.head_split import measured_head_advice, plan_split_head, split_head_costs
from accelerate_roundpipe.plan.layer_costs import LayerCosts
from accelerate_roundpipe.plan.planner import plan_from_costs
from accelerate_roundpipe.plan.ring_fill import fill_ring, simulated_makespan
from accelerate_roundpipe.plan.schedule import TaskKind, build_schedule
from accelerate_roundpipe.plan.shape_costs import layer_costs_from_shape
from accelerate_roundpipe.plan.simulate import simulate
from accelerate_roundpipe.plan.simulate_cli import main as simulate_main
from accelerate_roundpipe.plan.stage_cost_model import PlanSettings, StageCostModel
from accelerate_roundpipe.runtime.execution.measured_plan import MeasuredPlan

GIB = 2**30


def settings(num_devices, m, budget, bw, recompute="stage"):
    return PlanSettings(num_devices=num_devices, num_microbatches=m, gpu_memory_bytes=budget, pcie_bytes_per_s=bw,
                        recompute=recompute)


def test_shard_costs_divide_the_head_and_keep_its_input():
    costs = LayerCosts(forward_s=[1, 2, 12], backward_s=[2, 4, 24], param_bytes=[5, 5, 60], grad_bytes=[5, 5, 60],
                       act_bytes=[1, 3, 7], input_bytes=[1, 4, 4], work_bytes=[1, 3, 30])
    split = split_head_costs(costs, 3)
    assert split.num_layers == 5
    assert split.forward_s == (1, 2, 4, 4, 4)
    assert split.backward_s == (2, 4, 12, 12, 12)  # 1/3 of the head's backward + the recomputation of the logits
    assert split.param_bytes[2:] == (20, 20, 20) and split.work_bytes[2:] == (10, 10, 10)
    assert split.input_bytes[2:] == (4, 4, 4) and split.act_bytes[2:] == (7, 7, 7)  # each shard reads the hidden
    assert split_head_costs(costs, 1) == costs
    with pytest.raises(ValueError, match="at least 1"):
        split_head_costs(costs, 0)


def test_shard_count_matches_brute_force_over_every_count_and_partition():
    """For each shard count, brute force over every partition (tests/test_planner.py) gives the best slowest stage
    and fewest stages; the planner's choice must be the best (slowest, stages, shards) over all counts."""
    rng = random.Random(16)
    checked = 0
    for trial in range(80):
        costs = random_costs(rng, rng.randint(2, 5))
        num_devices, m, bw = rng.randint(1, 4), rng.randint(1, 3), rng.choice([1, 4, 1000])
        budget = rng.randint(60, 400)
        max_shards = 3
        options = []
        for shards in range(1, max_shards + 1):
            found = brute_force(split_head_costs(costs, shards), num_devices, m, budget, bw, "stage")
            if found is not None:
                options.append((*found, shards))
        context = f"trial {trial}: {costs} devices={num_devices} m={m} budget={budget} bw={bw}"
        if not options:
            with pytest.raises(ValueError, match="alone needs"):
                plan_split_head(costs, settings(num_devices, m, budget, bw), max_shards)
            continue
        plan = plan_split_head(costs, settings(num_devices, m, budget, bw), max_shards)
        p = plan.planned.partition
        # Costs are small integers split in at most 3: compare with a tolerance for the thirds.
        best = min(options, key=lambda o: (round(o[0], 9), o[1], o[2]))
        assert plan.planned.slowest_stage_s == pytest.approx(best[0]), context
        assert (len(p.forward) + len(p.backward), plan.num_head_shards) == best[1:], context
        assert plan.planned.peak_stage_bytes <= budget, context
        checked += 1
    assert checked > 40


def test_simulated_makespan_is_the_simulator_on_the_built_schedule():
    rng = random.Random(3)
    for _ in range(20):
        costs = random_costs(rng, rng.randint(2, 9))
        s = settings(rng.randint(1, 5), rng.randint(1, 4), math.inf, rng.choice([1, 1000]))
        planned = plan_from_costs(costs, s)
        model = StageCostModel(costs, s)
        for iterations in (1, 3):
            tasks, start = [], 0
            for index in range(iterations):
                one = build_schedule(planned.partition, s.num_microbatches, s.num_microbatches, s.num_devices,
                                     start_device=start)
                start = (one[-1].device_index + 1) % s.num_devices
                tasks += [t._replace(round_index=index) for t in one]
            def cost(t, mb, model=model, m=s.num_microbatches):
                return model.time(t.kind, *t.span) / m

            expected = simulate(tasks, s.num_devices, cost).makespan
            assert simulated_makespan(planned.partition, model, iterations) == pytest.approx(expected)


def test_ring_filling_is_never_longer_and_keeps_memory_and_the_fused_stage():
    rng = random.Random(5)
    improved = 0
    for _ in range(40):
        costs = random_costs(rng, rng.randint(3, 12))
        s = settings(rng.randint(2, 6), rng.randint(1, 4), rng.randint(200, 600), rng.choice([2, 1000]))
        try:
            planned = plan_from_costs(costs, s)
        except ValueError:
            continue
        model = StageCostModel(costs, s)
        for iterations in (1, 4):
            filled = fill_ring(planned, costs, iterations)
            before = simulated_makespan(planned.partition, model, iterations)
            after = simulated_makespan(filled.partition, model, iterations)
            assert after <= before
            improved += after < before
            assert filled.partition.fused == planned.partition.fused
            assert filled.peak_stage_bytes <= s.gpu_memory_bytes
            assert len(filled.partition.backward) >= min(s.num_devices, costs.num_layers)
    assert improved > 5  # the filling does something


@pytest.mark.parametrize("model, sync, lagged", [("qwen3-1.7b", 0.088, 0.016), ("llama3.1-8b", 0.092, 0.017)])
def test_split_head_reaches_the_papers_bubbles_on_8_gpus(model, sync, lagged, capsys):
    """FLOP costs, 8 devices, 16 micro-batches: with the head in vocabulary shards RoundPipe sync <= 11% and async
    <= 4.5% (the paper's figures); one indivisible head gives 36.1% / 10.1% (Qwen3-1.7B)."""
    result = simulate_main(["--model", model, "--devices", "8", "--microbatches", "16", "--split-head", "--json"])
    assert result["roundpipe_sync"] <= 0.11 and result["roundpipe_async"] <= 0.045
    assert result["roundpipe_sync"] == pytest.approx(sync, abs=0.002)
    assert result["roundpipe_async"] == pytest.approx(lagged, abs=0.002)
    whole = compare_bubbles(8, 16, [c / decoder_layer_flops(MODEL_SHAPES[model])[1]
                                    for c in decoder_layer_flops(MODEL_SHAPES[model])])
    assert result["roundpipe_sync"] < whole["roundpipe_sync"] and result["roundpipe_async"] < whole["roundpipe_async"]
    # RoundPipe stays ahead of every classic schedule given the same shards.
    assert result["roundpipe_sync"] < min(result[k] for k in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"))


def test_every_head_shard_is_no_slower_than_the_slowest_decoder_stage():
    costs = decoder_layer_flops(MODEL_SHAPES["qwen3-1.7b"], 4096)
    split, planned = split_head_plan(8, 16, costs, asynchronous=False)
    model = StageCostModel(split.costs, planned.settings)
    p = planned.partition
    kinds = [TaskKind.FORWARD] * len(p.forward) + [TaskKind.BACKWARD] * (len(p.backward) - 1) + [TaskKind.FUSED]
    times = {(k, s): model.time(k, *s) for k, s in zip(kinds, p.forward + p.backward)}
    head = split.head_layers
    decoder = max(t for (k, s), t in times.items() if s.stop <= head.start and s.start > 0)
    assert all(t <= decoder * (1 + 1e-9) for (k, s), t in times.items() if s.start >= head.start)
    # 5.3 decoder layers of head, whose shards' backward also recomputes the logits (4x the forward, not 3x):
    # 8 shards of 0.66 layers, each backward stage 2.65 layers' worth, under a decoder layer's 3.
    assert split.num_head_shards == 8


def test_cli_prints_the_grid(capsys):
    simulate_main(["--model", "qwen3-1.7b", "--devices", "8", "--microbatches", "16", "--split-head", "--grid"])
    out = capsys.readouterr().out
    assert "head in 8 vocabulary shards" in out and "FB36:L36-36:r0:m0-15@d" in out and "wave | d0" in out


@pytest.mark.parametrize("name, lora", [("qwen3-1.7b", None), ("qwen3-4b", None), ("llama3.1-8b", 16)])
def test_plans_for_2_to_8_devices_on_a_24_gib_card(name, lora):
    """Shape-based costs (s4096, one sequence per micro-batch, 8 per task), 80% of 24 GiB per device, PCIe 25 GB/s:
    every device count gets a plan within the budget whose head is split, faster than the whole head's."""
    costs = layer_costs_from_shape(MODEL_SHAPES[name], 4096, lora_rank=lora)
    for num_devices in range(2, 9):
        s = settings(num_devices, 8, 0.8 * 24 * GIB, 25e9)
        plan = plan_split_head(costs, s)
        whole = plan_from_costs(costs, s)
        assert plan.num_head_shards > 1
        assert plan.planned.slowest_stage_s < whole.slowest_stage_s
        assert plan.planned.peak_stage_bytes <= s.gpu_memory_bytes
        text = str(plan)
        assert f"head in {plan.num_head_shards} vocabulary shards" in text and "<- slowest" in text
    print(plan)


def test_a_budget_too_small_for_any_shard_count_names_the_layer():
    costs = LayerCosts(forward_s=[1, 1, 4], backward_s=[2, 2, 8], param_bytes=[1, 50, 40], act_bytes=[1, 1, 1])
    with pytest.raises(ValueError, match="layer 1 alone needs"):
        plan_split_head(costs, settings(2, 1, 90, 1000), max_head_shards=4)
    # The head alone does not fit (2 x 40 + ...), two shards do.
    plan = plan_split_head(LayerCosts(forward_s=[1, 1, 4], backward_s=[2, 2, 8], param_bytes=[1, 5, 40]),
                           settings(2, 1, 60, 1000), max_head_shards=4)
    assert plan.num_head_shards >= 2 and plan.slowest_by_shards[0] == math.inf


def _flop_costs(name: str) -> LayerCosts:
    forward = decoder_layer_flops(MODEL_SHAPES[name], 4096)
    return LayerCosts(forward_s=forward, backward_s=[2 * f for f in forward])


def test_measured_costs_advise_the_shards_the_planner_picks():
    costs = _flop_costs("qwen3-1.7b")
    eight = settings(8, 16, math.inf, math.inf)
    advice = measured_head_advice(costs, eight)
    picked = plan_split_head(costs, eight).num_head_shards
    assert picked > 1 and advice is not None
    assert f"head_shards={picked}" in advice and "5.3 decoder layers" in advice
    assert measured_head_advice(costs, settings(1, 16, math.inf, math.inf)) is None  # one device: nothing beside it
    light = LayerCosts(forward_s=[1.0] * 9, backward_s=[2.0] * 9)  # a head like any layer: one layer is as good
    assert measured_head_advice(light, eight) is None


def test_the_measured_plan_logs_the_advice_for_a_head_that_can_be_cut(caplog):
    class Head:
        def __init__(self, problem):
            self.problem = problem

        def vocabulary_split_problem(self):
            return self.problem

    costs = _flop_costs("qwen3-1.7b")
    for head, expected in ((Head(None), True), (Head("soft-capping"), False), (object(), False)):
        plan = MeasuredPlan.__new__(MeasuredPlan)  # only what `_advise_head_split` reads
        plan.store = type("Store", (), {"layers": [object(), head]})()
        plan.head_advice = None
        with caplog.at_level("WARNING", logger="accelerate_roundpipe.runtime.execution.measured_plan"):
            caplog.clear()
            plan._advise_head_split(costs, settings(8, 16, math.inf, math.inf))
        assert (plan.head_advice is not None) is expected
        assert ("head_shards=" in caplog.text) is expected
