"""Run a function on several processes joined in a gloo process group (as torchrun would start them), and collect
what each returns. A rank that hangs fails the test after `timeout_s` instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports, imported once in the fork server that forks the ranks: a rank spent about 10 s of a core
# importing these (transformers' Trainer and model modules most), and the suite starts over a hundred ranks.
PRELOAD = ("torch", "torch.distributed", "accelerate", "peft", "transformers.trainer",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3.modeling_qwen3")


def _context():
    """Ranks forked from a server that has imported `PRELOAD` (started at the first use, single-threaded: forking
    it is safe). A forked rank inherits the server's environment and folder, not the caller's, so `_spawn` passes
    both."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _rank_main(target: Callable, rank: int, world_size: int, port: int, results, args: tuple,
               reraise: bool = False, environ: dict | None = None, cwd: str | None = None) -> None:
    if environ is not None:  # the caller's, as a spawned process would have it
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      ROUNDPIPE_SUMMARY="0")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # each CPU worker is a thread; the ranks share two cores
    dist.init_process_group("gloo")
    try:
        results.put((rank, "ok", target(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", traceback.format_exc()))
        if reraise:  # the process then ends as a script dying of it does (its exit code is looked at)
            raise


class Exited:
    """What a rank that ended without reporting (e.g. `os._exit`) left: its exit code."""

    def __init__(self, code: int | None) -> None:
        self.code = code

    def __repr__(self) -> str:
        return f"Exited({self.code})"


def run_ranks(target: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """`target(rank, world_size, *args)` on `world_size` new processes; returns what each returned (or `Exited`)
    in rank order. A rank's exception fails the test with its traceback."""
    got, processes = _spawn(target, world_size, args, timeout_s, reraise=False)
    errors = [f"rank {rank}:\n{value}" for rank, (kind, value) in sorted(got.items()) if kind == "error"]
    assert not errors, "\n".join(errors)
    return [got[rank][1] if rank in got else Exited(processes[rank].exitcode) for rank in range(world_size)]


def run_ranks_side_by_side(*runs: tuple[Callable, int, tuple, float]) -> list[list[Any]]:
    """`run_ranks(target, world_size, *args, timeout_s=timeout_s)` for each (target, world_size, args, timeout_s)
    of independent runs, all started at once (a spawned rank spends seconds importing on one core: side by side,
    the runs share both); what each returned, in order."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run_ranks, target, world_size, *args, timeout_s=timeout_s)
                   for target, world_size, args, timeout_s in runs]
        return [future.result() for future in futures]


def in_turn(rank: int, world_size: int, calls: list[tuple[str, Callable, tuple]]) -> dict[str, tuple[str, Any]]:
    """A target for `run_ranks`: several independent scenarios, (key, target, args) each, one after the other on the
    same ranks (one process start for all): key -> ("ok", what `target(rank, world_size, *args)` returned) or
    ("error", its traceback)."""
    out: dict[str, tuple[str, Any]] = {}
    for key, target, args in calls:
        try:
            out[key] = ("ok", target(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported to its test by `ran`
            out[key] = ("error", traceback.format_exc())
    return out


def ran(reports: list[dict[str, tuple[str, Any]]], key: str) -> list[Any]:
    """What each rank's `key` scenario of an `in_turn` run returned, in rank order; a rank's traceback fails the
    test."""
    errors = [f"rank {rank}:\n{report[key][1]}" for rank, report in enumerate(reports) if report[key][0] == "error"]
    assert not errors, "\n".join(errors)
    return [report[key][1] for report in reports]


def run_ranks_to_exit(target: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[tuple]:
    """As `run_ranks`, but a rank's exception ends its process as it ends a script (exit code 1); returns, per
    rank, (kind "ok" / "error" / None if it reported nothing, what it returned or its traceback, its exit code)."""
    got, processes = _spawn(target, world_size, args, timeout_s, reraise=True)
    return [(*got.get(rank, (None, None)), processes[rank].exitcode) for rank in range(world_size)]


def _spawn(target: Callable, world_size: int, args: tuple, timeout_s: float, reraise: bool):
    context = _context()
    results = context.Queue()
    port = free_port()
    environ, cwd = dict(os.environ), os.getcwd()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(target, rank, world_size, port, results, args, reraise, environ, cwd))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[str, Any]] = {}
    while len(got) < world_size and time.monotonic() < deadline:
        try:
            rank, kind, value = results.get(timeout=0.2)
            got[rank] = (kind, value)
        except queue.Empty:
            if all(not p.is_alive() for p in processes):
                try:  # a result put just before its process ended
                    while True:
                        rank, kind, value = results.get(timeout=0.5)
                        got[rank] = (kind, value)
                except queue.Empty:
                    break
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()) if len(got) == world_size else 1.0)
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert not hung, f"rank(s) {hung} did not finish within {timeout_s:g} s (a hang); results so far: {got}"
    return got, processes
