"""Host memory for the layer inputs a training pass saves for its backward's recomputation.

[Note: saved inputs in host memory]
A pass keeps the input of the first layer of every backward stage, for every row, until that stage's backward has
run ([Note: saved inputs]): rows x tokens x hidden x the compute dtype's size per saved layer (the embedding's
input, the token ids, is the caller's batch and not counted). What the device may
keep (`PassPlan.keep_limit_bytes`; nothing under a tight card) goes to page-locked host memory, and all of it on
CPU workers. It grows with the batch and is not part of the store that `host_memory_budget` sizes: Llama-3.1-8B at
64 rows of 4,096 tokens keeps 16 inputs of 2 GiB, 32 GiB beside a store planned for 96 GiB on a 125 GiB machine,
where the kernel would end the process without a word. So before a pass of a new shape the engine compares the
least that must go to the host (every saved input less what the device may keep) with the memory available then
and warns, naming the numbers and what to change, when it does not fit. A warning, not an error: page-locked blocks
an earlier pass freed stay in the store's pool (or torch's host cache), outside the available count, and are reused.

[Note: saved inputs in the start summary]
The store is what `host_memory_budget` bounds; a run's resident peak is that plus the saved inputs, torch's cache
of page-locked blocks and the process's own memory (the Llama-3.1-8B disk run peaked at 110.6 GiB against 93.1 GiB
counted for the store, and nothing said where the rest was). So the first pass also prints one `saved inputs:`
line, with the summary: how many inputs, their size, the least of them in host memory, the process's resident
memory and what is available. Later shapes print it again only when they keep `RESAY_GROWTH` times the most said
before: a Trainer padding each batch to its longest row has a new shape nearly every step, and a line for each new
longest batch would break into the progress bar for a few rows more. On GPUs a saved input is copied to the host
with `tensor.to("cpu", non_blocking=True)`, into a block of torch's caching host allocator, which rounds each block
up to a power of two (below `pinned_max_round_threshold_mb`, unlimited by default): Qwen3-4B's 80 MiB inputs of 4
rows take 128 MiB each, Qwen3-32B's 160 MiB take 256; in the store's pooled blocks, where they are on, at most an
eighth more ([Note: saved inputs in pooled blocks]). The line counts what the blocks hold. It named
`pinned_max_round_threshold_mb` as the setting that stops the rounding until that setting, alone, was found unsafe
([Note: unrounded page-locked blocks] in runtime/devices/pinned.py): it no longer suggests it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ...plan.shape_costs import shape_from_config
from ...plan.stage_cost_model import format_bytes
from ...telemetry.summary import announce
from ..disk import available_memory_bytes, resident_memory_bytes

logger = logging.getLogger(__name__)

RESAY_GROWTH = 1.25  # a later shape's line is said when it keeps this many times the most said before


def pinned_block_bytes(nbytes: int) -> int:
    """The block torch's caching host allocator takes for `nbytes` at its default settings: the next power of
    two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def as_pinned_blocks(nbytes: int, blocks: Sequence[int],
                     block_of: Callable[[int], int] = pinned_block_bytes) -> int:
    """`nbytes` of saved inputs made of blocks sized as `blocks` (one saved layer's micro-batches), as the host
    holds them: each block as `block_of` rounds it (torch's caching host allocator by default: a power of two; the
    store's pool: `saved_input_buffers.block_size`)."""
    total = sum(blocks)
    return round(nbytes * sum(block_of(b) for b in blocks) / total) if total else nbytes


class SavedInputRoom:
    """Checks each new pass shape's saved inputs against the host's available memory; `model_config` None (not a
    Hugging Face decoder) checks nothing."""

    def __init__(self, model_config, element_size: int, on_host: bool,
                 available: Callable[[], int] = available_memory_bytes, summary: bool = False,
                 resident: Callable[[], int | None] = resident_memory_bytes,
                 block_of: Callable[[int], int] | None = None) -> None:
        """`block_of`: the page-locked block a saved input of so many bytes takes on GPUs (the store's pool's
        `block_size`); None: torch's caching host allocator's."""
        try:
            self.hidden_size = shape_from_config(model_config).hidden_size if model_config is not None else None
        except ValueError:
            self.hidden_size = None
        self.element_size, self.on_host, self.available = element_size, on_host, available
        self.summary, self.resident = summary, resident
        self.block_of = block_of or pinned_block_bytes
        self.held_by = "torch's page-locked cache allocates them" if block_of is None else \
            "the engine's page-locked blocks hold them"
        self._checked: set[tuple] = set()
        self.warnings: list[str] = []
        self.lines: list[str] = []  # the `saved inputs:` lines said so far ([Note: saved inputs in the start summary])
        self._most_said = -1  # the host bytes of the largest shape said so far

    @property
    def most_host_bytes(self) -> int:
        """The most host bytes (as allocated) of the shapes said so far; 0 before the first."""
        return max(0, self._most_said)

    def host_bytes(self, mb_rows: Sequence[int], seq_len: int, saved_layers: int, keep_limit_bytes: int) -> int:
        """The least the saved inputs of a pass put in host memory."""
        total = sum(mb_rows) * seq_len * self.hidden_size * self.element_size * saved_layers
        return total if self.on_host else max(0, total - keep_limit_bytes)

    def block_bytes(self, mb_rows: Sequence[int], seq_len: int) -> list[int]:
        """One saved layer's inputs: a block per micro-batch."""
        return [rows * seq_len * self.hidden_size * self.element_size for rows in mb_rows]

    def allocated_bytes(self, mb_rows: Sequence[int], seq_len: int, saved_layers: int, keep_limit_bytes: int) -> int:
        """`host_bytes` as the host holds it: on GPUs each block is a page-locked block as `block_of` rounds it;
        CPU workers keep them as ordinary tensors at their size."""
        need = self.host_bytes(mb_rows, seq_len, saved_layers, keep_limit_bytes)
        return need if self.on_host else as_pinned_blocks(need, self.block_bytes(mb_rows, seq_len), self.block_of)

    def summary_line(self, mb_rows: Sequence[int], seq_len: int, saved_layers: int, keep_limit_bytes: int,
                     recompute: str, free: int) -> str:
        """The `saved inputs:` line of a pass of this shape ([Note: saved inputs in the start summary])."""
        blocks = self.block_bytes(mb_rows, seq_len)
        need = self.host_bytes(mb_rows, seq_len, saved_layers, keep_limit_bytes)
        allocated = self.allocated_bytes(mb_rows, seq_len, saved_layers, keep_limit_bytes)
        sizes = sorted(set(blocks))
        each = " or ".join(format_bytes(b) for b in sizes)
        line = (f"saved inputs: {saved_layers} layer inputs a pass for the backward's recomputation (recompute="
                f"{recompute!r}), each {sum(mb_rows)} rows x {seq_len} tokens x {self.hidden_size} hidden in "
                f"{len(mb_rows)} micro-batch block(s) of {each}; ")
        if not need:
            line += "all kept on the device"
        else:
            line += f"at least {format_bytes(need)} of them in host memory"
            if allocated > need:
                rounded = " or ".join(format_bytes(self.block_of(b)) for b in sizes)
                line += f" ({format_bytes(allocated)} as {self.held_by}: {rounded} a block)"
            line += ", outside host_memory_budget"
        resident = self.resident()
        line += (f"; this process is resident at {format_bytes(resident)}" if resident is not None else "") + \
            f", {format_bytes(free)} available"
        return line

    def check(self, mb_rows: Sequence[int], inputs: tuple, saved_layers: frozenset[int], keep_limit_bytes: int,
              recompute: str) -> None:
        """Say the `saved inputs:` line for the first shape and for each that keeps `RESAY_GROWTH` times the most
        said before (with the summary), and warn once per shape when the pass's saved inputs would not fit the
        host's available memory."""
        saved_layers = saved_layers - {0}  # the first layer's input is the model's (token ids): the caller's own
        if self.hidden_size is None or not saved_layers or not inputs or inputs[0].dim() < 2:
            return
        seq_len = int(inputs[0].shape[1])
        key = (tuple(mb_rows), seq_len, len(saved_layers), keep_limit_bytes)
        if key in self._checked:
            return
        self._checked.add(key)
        need = self.allocated_bytes(mb_rows, seq_len, len(saved_layers), keep_limit_bytes)
        free = self.available()
        if need > self._most_said and need >= self._most_said * RESAY_GROWTH:
            self._most_said = need
            line = self.summary_line(mb_rows, seq_len, len(saved_layers), keep_limit_bytes, recompute, free)
            self.lines.append(line)
            announce("  " + line, self.summary)  # indented as the summary's lines and the re-plan's
        if need <= free:
            return
        each = sum(mb_rows) * seq_len * self.hidden_size * self.element_size
        message = (
            f"RoundPipe: this training pass keeps the inputs of {len(saved_layers)} layers for the backward's "
            f"recomputation (recompute={recompute!r}: the first layer of each backward stage), {sum(mb_rows)} rows "
            f"x {seq_len} tokens x {self.hidden_size} hidden, {format_bytes(each)} each; at least "
            f"{format_bytes(need)} of them go to host memory (as allocated), and {format_bytes(free)} is available. "
            f"If the process is killed for memory: train fewer rows a step (per_device_train_batch_size, with "
            f"gradient_accumulation_steps for the same global batch), lower host_memory_budget so that more "
            f"optimizer state goes to disk, or set backward_stages to fewer, larger stages (fewer saved inputs).")
        self.warnings.append(message)
        logger.warning(message)
