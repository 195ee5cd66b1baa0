"""Profile a window of training steps of the convergence preset, plain Trainer beside RoundPipeTrainer variants.

Issue 26 item 6 (small models): where does a step of the 168M preset spend its time, on the GPU and on the host
threads, and where does the GPU wait? Each system trains `--steps` steps on the preset's data (the convergence
benchmark's own run, `convergence_runs.train`); torch.profiler records steps `--window` (CPU and CUDA activity, every
thread); the trace is summarized (`trace_summary.py`: GPU busy time per step, kernels, copies, runtime calls, host
threads, the longest GPU idle gaps with what the host ran meanwhile) and written gzipped beside a JSON summary.

    python benchmarks/step_profile.py --preset gpu --systems hf --variant auto:optimizer_placement=auto --out DIR

The profiler slows every system; compare the systems with each other here and take throughput from
`convergence.py` runs without it.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import convergence, text_corpus, trace_summary  # noqa: E402
from benchmarks.convergence_runs import builtin_systems, parse_variant, train  # noqa: E402
from benchmarks.stack_sampler import StackSampler  # noqa: E402

PHASES = ("steps", "start-up", "evaluate")


class ProfileWindow:
    """Trainer callback: torch.profiler over one phase of a run (global step numbers, counted from 0):
    - `steps`: the steps [start, end);
    - `start-up`: from the Trainer's construction (then `train()` builds the engine, the first pass is measured and
      the plan made) to the end of step `end`;
    - `evaluate`: the evaluation the Trainer runs after step `end` (its `eval_steps` must be `end`)."""

    def __init__(self, start: int, end: int, trace_path: Path, phase: str = "steps",
                 sampler: StackSampler | None = None) -> None:
        from transformers import TrainerCallback

        window = self
        self.start, self.end, self.trace_path, self.phase = start, end, trace_path, phase
        self.sampler = sampler  # instead of the profilers: stacks sampled, the code run at full speed
        self.profiler = None
        self.python_profile: cProfile.Profile | None = None
        self.python_top = ""  # the caller thread's functions by cumulative time (start-up, evaluate)
        self.wall_s: float | None = None
        self._t0: float | None = None

        class Callback(TrainerCallback):
            def on_init_end(self, args, state, control, **kwargs):
                if window.phase == "start-up":  # train() follows; it prepares the model before on_train_begin
                    window.begin()

            def on_step_begin(self, args, state, control, **kwargs):
                if window.phase == "steps" and state.global_step == window.start:
                    window.begin()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step != window.end:  # global_step counts the step just ended
                    return
                if window.phase == "evaluate":
                    window.begin()  # the Trainer evaluates right after this callback
                else:
                    window.finish()

            def on_evaluate(self, args, state, control, **kwargs):
                if window.phase == "evaluate" and window._t0 is not None and window.wall_s is None:
                    window.finish()

        self.callback = Callback()

    def begin(self) -> None:
        if self.sampler is not None:
            self.sampler.start()
            self._t0 = time.perf_counter()
            return
        if self.phase != "steps":  # one long phase on the caller's thread: where its Python time goes, too
            self.python_profile = cProfile.Profile()
            self.python_profile.enable()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities,
                                               experimental_config=trace_summary.all_threads_config())
        self.profiler.start()
        self._t0 = time.perf_counter()

    def finish(self) -> None:
        self.wall_s = time.perf_counter() - self._t0
        if self.sampler is not None:
            self.sampler.stop()
            return
        self.thread_names = {str(t.native_id): t.name for t in threading.enumerate()}
        if self.python_profile is not None:
            self.python_profile.disable()
        self.profiler.stop()
        self.profiler.export_chrome_trace(str(self.trace_path))
        if self.python_profile is not None:
            text = io.StringIO()
            pstats.Stats(self.python_profile, stream=text).sort_stats("cumulative").print_stats(35)
            self.python_top = text.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(convergence.PRESETS), default="gpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", default="40:50", help="START:END, the steps profiled")
    parser.add_argument("--systems", default="hf", help="comma-separated built-in systems (hf, sync, async)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                        help="a RoundPipeTrainer system, as in convergence.py (repeatable)")
    parser.add_argument("--phase", choices=PHASES, default="steps",
                        help="what is profiled: the steps of --window, the start-up up to the end of the window's "
                             "last step, or the evaluation after it")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the process")
    parser.add_argument("--sampler", type=float, default=None, metavar="MS",
                        help="sample every thread's Python stack every MS ms instead of profiling (full speed; "
                             "where the wall time of a start-up or an evaluation goes)")
    parser.add_argument("--out", required=True, help="folder for <system>_trace.json.gz and step_profile.json")
    args = parser.parse_args(argv)
    start, end = (int(v) for v in args.window.split(":"))
    if not 0 <= start < end <= args.steps:
        raise SystemExit(f"--window {args.window}: need 0 <= START < END <= --steps ({args.steps})")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    systems = [builtin_systems()[n] for n in filter(None, args.systems.split(","))]
    systems += [parse_variant(text) for text in args.variant]
    p = convergence.resolve(convergence.parse_args(["--preset", args.preset]))
    sizes = dict(batch=p["batch"], seq=p["seq"], seed=p["seed"], bf16=p["bf16"],
                 num_microbatches=p["num_microbatches"] or None)
    train_texts, held_out_texts, _ = text_corpus.read_split(p["corpus_bytes"], p["holdout_every"])
    tokenizer = text_corpus.train_tokenizer(train_texts, p["vocab"])
    train_set = text_corpus.PackedBlocks(tokenizer, train_texts, p["seq"])
    eval_set = text_corpus.PackedBlocks(tokenizer, held_out_texts, p["seq"], max_blocks=8)
    model_config = convergence.qwen3_config(p)
    init, _ = convergence.initial_state(model_config, p["seed"])
    eval_every = end if args.phase == "evaluate" else 10 * args.steps
    if args.phase == "evaluate":  # the preset's held-out set, as the convergence runs evaluate it
        eval_set = text_corpus.PackedBlocks(tokenizer, held_out_texts, p["seq"], max_blocks=p["eval_blocks"])
    regime = dict(convergence.regime_settings(p, "scratch"), steps=args.steps, eval_every=eval_every)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for system in systems:
        with tempfile.TemporaryDirectory() as tmp:
            sampler = None if args.sampler is None else StackSampler(args.sampler / 1e3)
            window = ProfileWindow(start, end, Path(tmp) / "trace.json", args.phase, sampler)
            record, _ = train(system, model_config, init, train_set, eval_set, regime, sizes,
                              callbacks=(window.callback,))
            if sampler is not None:
                text = sampler.report()
                (out / f"{system.name}_{args.phase}_samples.txt").write_text(text)
                print(f"== {system.name} ({args.phase}): window {window.wall_s * 1e3:.1f} ms; whole run "
                      f"{record['tokens_per_s']:,.0f} tok/s, held-out {record['final_eval_loss']:.4f}\n{text}",
                      flush=True)
                continue
            trace = trace_summary.load(str(window.trace_path))
            name = system.name if args.phase == "steps" else f"{system.name}_{args.phase}"
            with open(window.trace_path, "rb") as src, gzip.open(out / f"{name}_trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        units = end - start if args.phase == "steps" else 1  # start-up and an evaluation: one unit each
        summary = trace_summary.summarize(trace, units, thread_names=window.thread_names)
        summary["phase"] = args.phase
        summary["host_wall_ms_per_step"] = round(window.wall_s / units * 1e3, 3)
        summary["tokens_per_s_whole_run"] = record["tokens_per_s"]
        summary["final_eval_loss"] = record["final_eval_loss"]
        summaries[system.name] = summary
        print(trace_summary.format_summary(system.name, summary), flush=True)
        if window.python_top:
            (out / f"{system.name}_{args.phase}_python.txt").write_text(window.python_top)
            print("\n".join(window.python_top.splitlines()[:60]), flush=True)
        print(f"   host wall {summary['host_wall_ms_per_step']} ms/step in the window; whole run "
              f"{record['tokens_per_s']:,.0f} tok/s (profiled), held-out {record['final_eval_loss']:.4f}", flush=True)
    written = out / f"{'step' if args.phase == 'steps' else args.phase}_profile.json"
    written.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
