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
an earlier pass freed stay in torch's host cache, outside the available count, and are reused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ...plan.shape_costs import shape_from_config
from ...plan.stage_cost_model import format_bytes
from ..disk import available_memory_bytes

logger = logging.getLogger(__name__)


class SavedInputRoom:
    """Checks each new pass shape's saved inputs against the host's available memory; `model_config` None (not a
    Hugging Face decoder) checks nothing."""

    def __init__(self, model_config, element_size: int, on_host: bool,
                 available: Callable[[], int] = available_memory_bytes) -> None:
        try:
            self.hidden_size = shape_from_config(model_config).hidden_size if model_config is not None else None
        except ValueError:
            self.hidden_size = None
        self.element_size, self.on_host, self.available = element_size, on_host, available
        self._checked: set[tuple] = set()
        self.warnings: list[str] = []

    def host_bytes(self, mb_rows: Sequence[int], seq_len: int, saved_layers: int, keep_limit_bytes: int) -> int:
        """The least the saved inputs of a pass put in host memory."""
        total = sum(mb_rows) * seq_len * self.hidden_size * self.element_size * saved_layers
        return total if self.on_host else max(0, total - keep_limit_bytes)

    def check(self, mb_rows: Sequence[int], inputs: tuple, saved_layers: frozenset[int], keep_limit_bytes: int,
              recompute: str) -> None:
        """Warn once per shape when the pass's saved inputs would not fit the host's available memory."""
        saved_layers = saved_layers - {0}  # the first layer's input is the model's (token ids): the caller's own
        if self.hidden_size is None or not saved_layers or not inputs or inputs[0].dim() < 2:
            return
        seq_len = int(inputs[0].shape[1])
        key = (tuple(mb_rows), seq_len, len(saved_layers), keep_limit_bytes)
        if key in self._checked:
            return
        self._checked.add(key)
        need = self.host_bytes(mb_rows, seq_len, len(saved_layers), keep_limit_bytes)
        free = self.available()
        if need <= free:
            return
        each = sum(mb_rows) * seq_len * self.hidden_size * self.element_size
        message = (
            f"RoundPipe: this training pass keeps the inputs of {len(saved_layers)} layers for the backward's "
            f"recomputation (recompute={recompute!r}: the first layer of each backward stage), {sum(mb_rows)} rows "
            f"x {seq_len} tokens x {self.hidden_size} hidden, {format_bytes(each)} each; at least "
            f"{format_bytes(need)} of them go to host memory, and {format_bytes(free)} is available. If the process "
            f"is killed for memory: train fewer rows a step (per_device_train_batch_size, with "
            f"gradient_accumulation_steps for the same global batch), lower host_memory_budget so that more "
            f"optimizer state goes to disk, or set backward_stages to fewer, larger stages (fewer saved inputs).")
        self.warnings.append(message)
        logger.warning(message)
