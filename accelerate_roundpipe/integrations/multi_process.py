"""What the integrations do differently when several processes (one per machine) train one model.

[Note: one process per machine]
Data parallelism under RoundPipe is one process per machine (node), each running one engine over that machine's GPUs
(`ROUNDPIPE_DEVICES`), the processes forming one torch.distributed group: accelerate's MULTI_GPU or MULTI_CPU
distributed types, `torchrun --nproc-per-node 1`. Accepted: any number of machines with one process each, and several
processes on one machine when no GPU is claimed twice (CPU workers: the tests; disjoint `CUDA_VISIBLE_DEVICES`).
Refused: several processes on one machine claiming the same GPU, which is what "one process per GPU" launches do
(every process sees every GPU, and an unset `devices` means all of them); DeepSpeed, FSDP, Megatron-LM and TPU
launches (RoundPipe replaces them). The engine must have turned data parallelism on (`engine.data_parallel`, over
the whole world): a multi-process run whose engines do not reduce would train N different models.

[Note: data-parallel loss scaling]
The engine SUMS gradients across ranks, and its fused loss (a labelled batch through `model(**batch)` or
`forward_backward`) is the loss of the GLOBAL batch, the same on every rank, each rank committing its part of that
loss's gradient: `loss.backward()` with any function of it gives what one process would on the whole batch. DDP
instead AVERAGES, and scripts and the Trainer are written for that:
- a loss computed by the caller from logits (a forward-only pipeline: no labels, label smoothing,
  `compute_loss_func`) is this rank's, as under DDP; its backward is scaled by 1/world_size, so the sum over ranks is
  DDP's mean (`backward_scale`);
- `Trainer.compute_loss` multiplies the loss by num_processes when it was normalised by the global token count
  (`average_tokens_across_devices`), to undo DDP's mean. On a logits loss that stays (the 1/world_size above undoes it,
  and the logged mean over ranks is the global loss); on the engine's fused loss it is divided out again
  (`RoundPipeTrainer.compute_loss`), else gradients and logged loss would be num_processes times too large;
- the count a Trainer batch's loss is normalised by (`num_items_in_batch`) is always the global one under data
  parallelism (`average_tokens_across_devices` is forced on): each rank's part of the loss is then its token sum over
  the global count, and the sum over ranks is the whole batch's loss. The engine takes a given `num_items_in_batch`
  as that global count.
A loss mixing both kinds (the fused loss plus a term from logits of another pass) cannot be scaled right by one
factor and is refused.

[Note: collective timeouts]
Every rank must raise within `wait_timeout_s` when another dies or stalls. The engine's own collectives run on
groups made with that timeout ([Note: data parallel]); the others run on the default process group: those the
integrations add (the GPU-claim check, the staged checkpoint's agreements) and HF's (the Trainer's gathers of the
label count and the logged loss, its barriers, accelerate's `gather`). The default group is made before RoundPipe
sees it (torchrun's script, accelerate's `PartialState`, `TrainingArguments` with its `ddp_timeout`, default
1800 s), so `RoundPipeAccelerator` sets its timeout to `wait_timeout_s` when it is built (`follow_wait_timeout`):
every collective on it then times out as the engine's do, whoever issues it. The ones the integrations issue or
the Trainer issues per step are wrapped (`named_collective`) so that the error names the collective, the rank and
its peer, instead of gloo's bare "Timed out waiting" or "Connection closed by peer".
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from ..compat.accelerate_internals import state_backend
from ..compat.hf_trainer import compute_loss_process_factor
from ..compat.torch_internals import backward_node_class, default_group_store, set_default_group_timeout
from ..runtime.distribution.collectives import DataParallelError
from .checkpoint_files import CheckpointError, check_shard_name
from .process_layout import MULTI_PROCESS_TYPES, ONE_PROCESS_PER_MACHINE


def distributed_type_name(distributed_type: object) -> str:
    return str(getattr(distributed_type, "value", distributed_type)).split(".")[-1]


def check_distributed_type(distributed_type: object, num_processes: int) -> None:
    """Refuse accelerate distributed types RoundPipe replaces; accept one process, or MULTI_CPU/MULTI_GPU."""
    name = distributed_type_name(distributed_type)
    if name == "NO" and num_processes <= 1:
        return
    if name in MULTI_PROCESS_TYPES:
        return
    raise ValueError(f"this run has distributed_type={name} and num_processes={num_processes}, which RoundPipe "
                     f"replaces. For one machine launch a single process (distributed_type: NO); for several, "
                     f"distributed_type: MULTI_GPU (or MULTI_CPU) with one process per machine. "
                     f"{ONE_PROCESS_PER_MACHINE}")


# ---------------------------------------------------------------------- GPU claims per machine

def claimed_gpus(devices: Iterable[torch.device | str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The physical GPUs `devices` use: `cuda:k` is entry k of CUDA_VISIBLE_DEVICES when it is set, else GPU k."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else None
    out = []
    for device in devices:
        device = torch.device(device)
        if device.type != "cuda":
            continue
        index = device.index or 0
        out.append(names[index] if names is not None and index < len(names) else str(index))
    return out


def shared_gpus(claims: list[tuple[str, list[str]]]) -> dict[str, dict[str, list[int]]]:
    """{host: {gpu: [ranks]}} for each GPU that two or more ranks of one host claim (`claims[rank] = (host,
    gpus)`)."""
    owners: dict[str, dict[str, list[int]]] = {}
    for rank, (host, gpus) in enumerate(claims):
        for gpu in dict.fromkeys(gpus):
            owners.setdefault(host, {}).setdefault(gpu, []).append(rank)
    return {host: {gpu: ranks for gpu, ranks in by_gpu.items() if len(ranks) > 1}
            for host, by_gpu in owners.items() if any(len(r) > 1 for r in by_gpu.values())}


def check_one_process_per_machine(claims: list[tuple[str, list[str]]]) -> None:
    """Raise when ranks on one host claim the same GPU ([Note: one process per machine])."""
    shared = shared_gpus(claims)
    if not shared:
        return
    host, by_gpu = next(iter(shared.items()))
    gpu, ranks = next(iter(by_gpu.items()))
    raise ValueError(f"ranks {ranks} run on the same machine ({host}) and each drives GPU {gpu} (with "
                     f"{sum(len(g) for g in shared.values())} GPU(s) shared on {len(shared)} machine(s)): that is one "
                     f"process per GPU. {ONE_PROCESS_PER_MACHINE}")


def gather_claims(devices: Iterable[torch.device | str], timeout_s: float | None = None) -> list[tuple[str, list[str]]]:
    """Every rank's (host, claimed GPUs), gathered over the default process group (a collective: all ranks call
    it)."""
    import torch.distributed as dist

    mine = (socket.gethostname(), claimed_gpus(devices))
    claims: list = [None] * dist.get_world_size()
    with named_collective("the comparison of the GPUs each rank claims (an all-gather)", timeout_s):
        dist.all_gather_object(claims, mine)
    return claims


# ---------------------------------------------------------------------- the engine side

def engine_world(engine: object) -> tuple[int, int] | None:
    """(rank, world_size) of the engine's data-parallel group, or None when it trains alone."""
    data_parallel = getattr(engine, "data_parallel", None)
    if data_parallel is None:
        return None
    return data_parallel.rank, data_parallel.world_size


def check_engine_data_parallel(engine: object, num_processes: int) -> None:
    """A multi-process run needs engines that reduce over all processes ([Note: one process per machine])."""
    world = engine_world(engine)
    if num_processes <= 1:
        if world is not None:
            # torch.distributed has several processes but accelerate (or the Trainer) set itself up for one: each
            # rank would read the whole data set, not its share, and every rank would log and save as the main one.
            raise ValueError(
                f"the RoundPipe engine is data-parallel over {world[1]} processes, but accelerate sees one process "
                f"(distributed_type NO). On CPU-only machines accelerate and the Trainer only go distributed when "
                f"told to use the CPU: pass `--use_cpu true` (TrainingArguments(use_cpu=True)) or set "
                f"ACCELERATE_USE_CPU=true; with GPUs, launch with `accelerate launch --multi_gpu` or torchrun.")
        return
    if world is None:
        raise ValueError(f"this run has {num_processes} processes, but the RoundPipe engine is not data-parallel "
                         f"(data_parallel off, env ROUNDPIPE_DATA_PARALLEL, or an engine without data-parallel "
                         f"support): each process would train its own model on its share of the data. Turn "
                         f"data_parallel on, or launch a single process.")
    if world[1] != num_processes:
        raise ValueError(f"the RoundPipe engine's data-parallel group has {world[1]} ranks but this run has "
                         f"{num_processes} processes; the engine must reduce over every process of the run.")


# ---------------------------------------------------------------------- loss scaling

DEFERRED, PIPELINE, MIXED, OTHER = "deferred", "pipeline", "mixed", "other"


def loss_kind(loss: torch.Tensor, max_nodes: int = 100_000) -> str:
    """Which of the engine's autograd nodes `loss` reaches: the fused pass's deferred commit (`DEFERRED`), a
    forward-only pipeline (`PIPELINE`), both (`MIXED`) or neither (`OTHER`)."""
    from ..runtime.engine.engine import _PipelineBackward
    from ..runtime.execution.deferred import DeferredLoss

    deferred_node, pipeline_node = backward_node_class(DeferredLoss), backward_node_class(_PipelineBackward)
    found = set()
    stack, seen = [loss.grad_fn], set()
    while stack and len(seen) < max_nodes:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, deferred_node):
            found.add(DEFERRED)
            continue  # the engine's node: what lies behind it is the engine's anchor
        if isinstance(node, pipeline_node):
            found.add(PIPELINE)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    if len(found) == 2:
        return MIXED
    return found.pop() if found else OTHER


def backward_scale(kind: str, world_size: int) -> float:
    """What a loss of `kind` is multiplied by before its backward ([Note: data-parallel loss scaling])."""
    if world_size <= 1 or kind in (DEFERRED, OTHER):
        return 1.0
    if kind == PIPELINE:
        return 1.0 / world_size
    raise ValueError("under data parallelism this loss combines the model's own loss (a labelled batch) with a loss "
                     "computed from logits of another pass; the first is already the global batch's, the second "
                     "this rank's, and no single scale makes both right. Compute the loss from one pass: pass "
                     "`labels` and use the model's loss, or call the model without `labels` and compute the whole "
                     "loss from its logits.")


def trainer_loss_multiplier(average_tokens_across_devices: bool, counts_items: bool, num_items_in_batch: object,
                            num_processes: int, tp_size: int = 1, n_gpu: int = 1) -> int:
    """The factor `transformers.Trainer.compute_loss` (5.x) multiplies the loss by, to undo DDP's mean when the loss
    was normalised by the global token count; `counts_items` is `model_accepts_loss_kwargs or compute_loss_func`.
    Mirrored, and checked against the installed Trainer, in `compat/hf_trainer.py`."""
    return compute_loss_process_factor(average_tokens_across_devices, counts_items, num_items_in_batch,
                                       num_processes, tp_size, n_gpu)


# ---------------------------------------------------------------------- checkpoint files and agreement

def rank_suffix(rank: int, world_size: int) -> str:
    """Inserted before a per-rank file's extension: '' for one process, else '.rank<r>-of-<n>'."""
    return "" if world_size <= 1 else f".rank{rank}-of-{world_size}"


def per_rank_name(filename: str, rank: int, world_size: int) -> str:
    """`optimizer.pt` -> `optimizer.rank1-of-2.pt` (unchanged for one process)."""
    stem, ext = os.path.splitext(filename)
    return f"{stem}{rank_suffix(rank, world_size)}{ext}"


def missing_shard_error(directory: str, filename: str, rank: int, world_size: int) -> FileNotFoundError:
    """The error for a checkpoint without this rank's shard: says which world size wrote it, when it can."""
    stem, ext = os.path.splitext(filename)
    found = sorted(f for f in os.listdir(directory) if f.startswith(stem + ".rank") and f.endswith(ext)) \
        if os.path.isdir(directory) else []
    written = f"; it holds {', '.join(found)}" if found else ""
    return FileNotFoundError(f"{directory} has no {per_rank_name(filename, rank, world_size)} (rank {rank} of "
                             f"{world_size}){written}. Each rank's optimizer state is a shard: resume from a "
                             f"checkpoint that holds the shard of every rank of the run that wrote it (any number of "
                             f"processes can load them together).")


def written_by_another_world_size(directory: str, filename: str, rank: int,
                                  world_size: int) -> tuple[list[str], int] | None:
    """When `directory` holds no `filename` of this rank but that of a run with another number of processes: the
    paths of that run's files, one per rank (the file itself for one process), and its number of processes
    ([Note: shards of another world size]). None when this rank's own file is there, or no file is."""
    if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, per_rank_name(filename, rank,
                                                                                            world_size))):
        return None
    stem, ext = os.path.splitext(filename)
    pattern = re.compile(re.escape(stem) + r"\.rank(\d+)-of-(\d+)" + re.escape(ext) + "$")
    ranks_of: dict[int, set[int]] = {}
    for name in sorted(os.listdir(directory)):
        if (match := pattern.match(name)) is not None:
            rank, of = int(match[1]), int(match[2])
            path = os.path.join(directory, name)
            check_shard_name(path, rank, of)  # before anything is sized by its numbers
            if name != per_rank_name(filename, rank, of):
                raise CheckpointError(path, f"is not a name RoundPipe writes (it would be "
                                            f"{per_rank_name(filename, rank, of)}): rename it or remove it")
            ranks_of.setdefault(of, set()).add(rank)
    if os.path.isfile(os.path.join(directory, filename)):
        ranks_of.setdefault(1, {0})
    if not ranks_of:
        return None
    if len(ranks_of) > 1:
        raise FileNotFoundError(f"{directory} holds {filename} files of runs with {sorted(ranks_of)} processes and "
                                f"none of this one ({world_size}); keep the files of one run only.")
    written, ranks = next(iter(ranks_of.items()))
    if len(ranks) < written:  # some rank's shard is missing: name the first few, counting no further
        missing = [r for r in itertools.islice((r for r in range(written) if r not in ranks), 3)]
        more = f" and {written - len(ranks) - len(missing)} more" if written - len(ranks) > len(missing) else ""
        raise FileNotFoundError(f"{directory} holds the {filename} shards of a run with {written} processes, but not "
                                f"those of rank(s) {missing}{more}: resuming with another number of processes needs "
                                f"every rank's shard ({per_rank_name(filename, missing[0], written)}, ...).")
    return [os.path.join(directory, per_rank_name(filename, r, written)) for r in range(written)], written


# [Note: tagged agreements]
# The ranks agree before and after each multi-process save (`staged_checkpoint.together`, the accelerator's
# `save_state`). An agreement that were a bare collective (a MIN all-reduce of a flag) could not tell a peer that is
# late from a peer that is somewhere else: under `if accelerator.is_main_process: accelerator.save_state(d)` rank 0 sat
# in the all-reduce while rank 1 sat in `wait_for_everyone()`'s barrier, two collectives gloo never matches, until both
# timed out (`wait_timeout_s`, 600 s) and rank 0 blamed a "failed" peer, its half-written checkpoint left behind. So
# each rank first writes what it is doing (its `when`, and whether it succeeded) into the default group's store under
# the agreement's number (and reads it back: the write is then in the store), then joins a barrier, then reads every
# rank's entry. The barrier completes against any barrier of the peer's, its own or the user's, at once; an entry is
# written before its rank enters the barrier, so after it a missing or different entry is final: that rank is elsewhere,
# and every rank that sees it raises `RanksApartError` at once, naming where each rank was. (The peer that was in a
# barrier of its own is let through it and goes on; this rank's error says so.) Every rank joins the same agreements in
# the same order, so a per-process count numbers them alike on every rank; each rank deletes its entry of the agreement
# before once the next one's barrier shows everyone read it. A rank that died or stalled makes the barrier fail within
# `wait_timeout_s` instead ([Note: collective timeouts]).
_AGREEMENT_KEY = "roundpipe/agreement/{number}/{rank}"
_agreements_joined = itertools.count()


class RanksApartError(DataParallelError):
    """An agreement's ranks were not at the same point ([Note: tagged agreements]): `apart` maps each such rank to
    where it was (None: at no agreement of RoundPipe's, e.g. a barrier of the user's)."""

    def __init__(self, message: str, apart: dict[int, str | None]) -> None:
        super().__init__(message)
        self.apart = apart


class RankAgreement:
    """All ranks agreeing that each succeeded, and that each is at the same point ([Note: tagged agreements]). Used
    around checkpoint writes so a rank that failed makes every rank fail instead of leaving them waiting at a
    barrier; a rank somewhere else makes every rank raise at once; a rank that died or stalled makes it raise,
    naming `when` ([Note: collective timeouts])."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s  # the group's, for the error's advice (`follow_wait_timeout` set it)

    def all_ok(self, ok: bool, when: str = "", advice: str = "") -> bool:
        """True when every rank said ok at the same `when`; `RanksApartError` (with `advice`, what to change) when
        a rank is elsewhere."""
        entries = self._exchange(ok, when)
        apart = {rank: (None if entry is None else entry[1]) for rank, entry in enumerate(entries)
                 if entry is None or entry[1] != when}
        if apart:
            raise ranks_apart_error(when, apart, advice)
        return all(entry[0] for entry in entries)

    def _exchange(self, ok: bool, when: str) -> list[tuple[bool, str] | None]:
        """Every rank's (ok, when) of this agreement, None for a rank that wrote none."""
        import torch.distributed as dist

        rank, world_size = dist.get_rank(), dist.get_world_size()
        number = next(_agreements_joined)
        with named_collective(f"the ranks' agreement {when}".rstrip(), self.timeout_s):
            store = default_group_store()
            mine = _AGREEMENT_KEY.format(number=number, rank=rank)
            store.set(mine, json.dumps([bool(ok), when]))
            # TCPStore's `set` does not wait for the server: the barrier (over gloo's own connections) could end
            # before the server took it. A `get` on the same connection is answered only after the `set` was.
            store.get(mine)
            dist.barrier()
            keys = [_AGREEMENT_KEY.format(number=number, rank=r) for r in range(world_size)]
            entries = [_read_entry(store, key) for key in keys]
            if number:  # every rank entered this one's barrier, so it read the previous entries
                store.delete_key(_AGREEMENT_KEY.format(number=number - 1, rank=rank))
        return entries


def _read_entry(store, key: str) -> tuple[bool, str] | None:
    if not store.check([key]):  # `get` of a missing key would wait for it until the store's timeout
        return None
    ok, when = json.loads(store.get(key))
    return bool(ok), str(when)


_NOT_IN_ONE = ("in no agreement of RoundPipe's (it was in a barrier or another collective of the default process "
               "group, e.g. accelerator.wait_for_everyone(), and this agreement let it through)")


def ranks_apart_error(when: str, apart: dict[int, str | None], advice: str = "") -> RanksApartError:
    """The error for ranks found at different points by an agreement ([Note: tagged agreements])."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    where = "; ".join(f"rank {r} is {_NOT_IN_ONE if theirs is None else 'at another: ' + theirs}"
                      for r, theirs in sorted(apart.items()))
    return RanksApartError(
        f"the ranks' agreement {when} on rank {rank} of {world_size} found the ranks apart: {where}. "
        f"{advice or 'Every process must make the same RoundPipe calls in the same order.'}", apart)


SAVE_ON_EVERY_RANK = (
    "Under RoundPipe's data parallelism each rank's optimizer state is its own shard (optimizer.rank<r>-of-<N>.bin), "
    "which only that rank holds and writes: call accelerator.save_state(...) on every process, with the same "
    "directory, not under `if accelerator.is_main_process:` (accelerate still writes the model and the files the "
    "ranks share from the main process only). Nothing was written.")


def check_every_rank_saves(agreement: RankAgreement | None, output_dir: str | None) -> None:
    """Before `save_state` writes anything: every rank is in it, with the same directory; else every rank that
    sees it raises at once, nothing written ([Note: tagged agreements]). No agreement (one process, or nothing held
    per rank): nothing to check."""
    if agreement is not None:
        agreement.all_ok(True, f"at the start of accelerator.save_state({output_dir!r})", advice=SAVE_ON_EVERY_RANK)


# ---------------------------------------------------------------------- collective timeouts

def follow_wait_timeout(timeout_s: float) -> None:
    """Make the default process group's collectives time out after `timeout_s` ([Note: collective timeouts]).
    Through torch's private setter (`compat/torch_internals.py`): a torch without it raises `LibraryChangedError`
    rather than leaving every rank waiting the group's own timeout (default 1800 s) on a dead peer."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    set_default_group_timeout(datetime.timedelta(seconds=timeout_s))


def peer_ranks(rank: int, world_size: int) -> str:
    """The ranks a collective of `rank` waits on, in words: 'rank 1', or 'one of ranks [0, 2, 3]'."""
    others = [r for r in range(world_size) if r != rank]
    return f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"


def collective_error(what: str, started: float, error: BaseException, timeout_s: float | None) -> RuntimeError:
    """The error for a collective on the default process group that failed: which one, on which rank, after how
    long, and what to look at (the runtime's `DataParallelGroup` words its own collectives' errors alike)."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    limit = f"{timeout_s:g} s, " if timeout_s is not None else ""
    return DataParallelError(
        f"{what} across the {world_size} processes failed on rank {rank} after {time.monotonic() - started:.1f} s: "
        f"{type(error).__name__}: {error}. The peer ({peer_ranks(rank, world_size)}) has probably failed, been "
        f"killed or stalled for longer than the timeout ({limit}wait_timeout_s / ROUNDPIPE_WAIT_TIMEOUT_S, which "
        f"the default process group follows under RoundPipe): look at the other ranks' errors.")


@contextlib.contextmanager
def named_collective(what: str, timeout_s: float | None) -> Iterator[None]:
    """Around a collective on the default process group: its failure (gloo's timeout, a peer's closed connection)
    raises `collective_error`, naming `what`."""
    started = time.monotonic()
    try:
        yield
    except DataParallelError:
        raise
    except Exception as error:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError subclasses
        raise collective_error(what, started, error, timeout_s) from error


def collective_device(state) -> torch.device:
    """Where accelerate's collectives need tensors: the state's device for NCCL-like backends, else the CPU (the
    RoundPipe caller keeps its tensors in host memory). No backend (one process) is the CPU too."""
    backend = state_backend(state)
    return torch.device("cpu") if backend in (None, "gloo", "mpi") else state.device
