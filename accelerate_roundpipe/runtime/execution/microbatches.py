"""Micro-batch policy: how many micro-batches a pass runs, and its inputs split along dim 0 into them."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...config import RoundPipeConfig
from ...plan.first_pass_sizing import FirstPassSizing
from .first_pass import FirstPassSizer
from .measured_plan import MeasuredPlan

logger = logging.getLogger(__name__)


def tensor_tuple(values: Any, what: str) -> tuple[torch.Tensor, ...]:
    values = values if isinstance(values, (tuple, list)) else (values,)
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{what} must be tensors (split along dim 0 into micro-batches); got {type(v).__name__}.")
    return tuple(values)


def split_rows(tensors: tuple[torch.Tensor, ...], num_microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    """Split every tensor along dim 0 into `num_microbatches` slices (the first ones one row larger if uneven)."""
    parts = [torch.tensor_split(t, num_microbatches, dim=0) for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(num_microbatches)]


def _label_counts(mb_labels: list, ignore_index: int | None) -> list[int] | None:
    """Per micro-batch, the labels other than `ignore_index`; None unless the labels are integer class labels."""
    single = [labels[0] if labels is not None and len(labels) == 1 else None for labels in mb_labels]
    if ignore_index is not None and all(t is not None and not t.is_floating_point() and not t.is_complex()
                                        and t.dtype != torch.bool for t in single):
        return [int((t != ignore_index).sum()) for t in single]
    return None


def loss_count_totals(mb_rows: list[int], mb_labels: list, ignore_index: int | None) -> list[float]:
    """What the weights of [Note: micro-batch loss weights] divide by: [1 if the labels are not counted (not integer
    class labels) else 0, the labels counted, the rows]. Under data parallelism these are summed over the ranks
    first, so the weights count the global batch ([Note: data parallel])."""
    counts = _label_counts(mb_labels, ignore_index)
    return [0.0 if counts is not None else 1.0, float(sum(counts or [])), float(sum(mb_rows))]


def loss_shares(mb_rows: list[int], mb_labels: list, loss_reduction: str, ignore_index: int | None,
                totals: list[float] | None = None) -> list[float]:
    """[Note: micro-batch loss weights]
    The weight of each micro-batch's loss in the loss of the whole batch. A "mean" loss of the whole batch averages
    over what its loss function counts, and so must the micro-batches' weights: for integer labels (class indices,
    token ids) that is the labels other than `ignore_index` (-100 by default, as torch's `cross_entropy` and Hugging
    Face skip), otherwise the rows. Weighting by rows would be wrong as soon as micro-batches hold different numbers
    of masked labels (a loss of 1.2156 for 1.2098, gradients off by up to 0.09 on a small case), and a micro-batch
    whose labels are all masked, whose own mean is 0/0 = NaN, would poison the whole batch's loss: it gets weight 0,
    and the worker skips its loss's backward. With every label of the batch masked, the whole batch's loss is NaN
    too, and rows are used. `loss_reduction="sum"` adds the micro-batch losses (weight 1 each). `totals`: the
    `loss_count_totals` of the global batch (summed over data-parallel ranks); default this batch's."""
    if loss_reduction == "sum":
        return [1.0] * len(mb_rows)
    counts = _label_counts(mb_labels, ignore_index)
    uncounted, labels, rows = totals if totals is not None else loss_count_totals(mb_rows, mb_labels, ignore_index)
    if counts is not None and uncounted == 0 and labels > 0:
        return [c / labels for c in counts]
    return [r / rows for r in mb_rows]


class MicrobatchPolicy:
    """The micro-batch count of every pass of one engine.

    [Note: short batches]
    An explicit `num_microbatches` larger than a training batch is an error (silently running fewer
    micro-batches than asked would hide a configuration mistake). Stock loops and the Trainer keep the last,
    shorter batch of every epoch (`drop_last=False`), so an 8-micro-batch run would stop at the first epoch end
    with a 5-row batch: for the models it prepares, the integration (`integrations/convert.py`) passes
    `allow_short_batches=True`, and such a batch runs with as many micro-batches as it has rows, with one warning per
    engine. Only the last batch of an epoch is short: two short training batches in a row mean every batch is
    (a batch size below `num_microbatches`, or a data set smaller than one batch), and the second is the error
    above. The Trainer checks its batch size against `num_microbatches` before training starts.
    """

    def __init__(self, config: RoundPipeConfig, num_devices: int, plan: MeasuredPlan,
                 allow_short_batches: bool, sizer: FirstPassSizer | None = None) -> None:
        self.config = config
        self.num_devices = num_devices
        self.plan = plan
        self.sizer = sizer
        self.sizing: FirstPassSizing | None = None  # the last unplanned count's ([Note: first-pass micro-batches])
        self.allow_short_batches = allow_short_batches
        self._warned_short_batch = False
        self._last_was_short = False  # the previous training batch had fewer rows than num_microbatches

    def split(self, inputs: tuple[torch.Tensor, ...], strict: bool = True) -> tuple[int, int, list[tuple]]:
        """Split into micro-batches. `strict=False` (forward-only passes, e.g. evaluation or generation of a
        small batch) lowers an explicit micro-batch count to the batch size instead of raising."""
        if not inputs:
            raise ValueError("RoundPipe needs at least one input tensor.")
        rows = inputs[0].shape[0] if inputs[0].dim() else 0
        for t in inputs:
            if t.dim() == 0 or t.shape[0] != rows:
                raise ValueError(f"every input must have the batch on dim 0 with the same size; got shapes "
                                 f"{[tuple(x.shape) for x in inputs]}.")
        if rows < 1:
            raise ValueError(f"the batch is empty (inputs of shapes {[tuple(x.shape) for x in inputs]}): every pass "
                             f"needs at least one row; skip empty batches before calling the engine.")
        requested = self.config.num_microbatches
        short = requested is not None and rows < requested
        if short and strict:
            # [Note: short batches]: the last batch of an epoch may be short, two in a row may not.
            if not self.allow_short_batches or self._last_was_short:
                again = " (the second short batch in a row: not just the last batch of an epoch)" \
                    if self.allow_short_batches else ""
                raise ValueError(f"the batch has {rows} rows but num_microbatches is {requested} (given as "
                                 f"{self.config.setting_as_given('num_microbatches')}){again}; every micro-batch "
                                 f"needs a row. Set num_microbatches to at most {rows} there, or use batches of at "
                                 f"least {requested} rows.")
            if not self._warned_short_batch:
                logger.warning("A batch of %d rows is shorter than num_microbatches=%d (given as %s); running it "
                               "as %d micro-batches, as the last batch of an epoch. A second short batch in a row is "
                               "an error. Shown once.", rows, requested,
                               self.config.setting_as_given("num_microbatches"), rows)
                self._warned_short_batch = True
        if strict:
            self._last_was_short = short
        num_mb = self.count_for(rows, _seq_len(inputs))
        return rows, num_mb, split_rows(inputs, num_mb)

    def size_before_start(self, inputs: Any) -> None:
        """Size the first pass's batch before its checks, for the start summary printed first (`self.sizing`)."""
        first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
        if isinstance(first, torch.Tensor) and first.dim():
            self.count_for(first.shape[0], _seq_len((first,)))

    def count_for(self, rows: int, seq_len: int | None = None) -> int:
        """Micro-batches a training pass over `rows` rows (of `seq_len` tokens, if known) runs now:
        `num_microbatches`, else the measured plan's choice, else the count that fits the batch
        ([Note: first-pass micro-batches]; twice the device count at least, and when the length is unknown or the
        model has no config to estimate from); never more than the rows."""
        requested = self.config.num_microbatches
        if requested is not None:  # the user's setting always wins
            return min(requested, rows)
        chosen = self.plan.chosen_microbatches
        if chosen:
            return min(chosen, rows)
        default = min(2 * self.num_devices, rows)
        if self.sizer is None or seq_len is None:
            self.sizing = None  # this pass was not sized: no earlier shape's sizing stands for it
            return default
        self.sizing = self.sizer.size(rows, seq_len, default)
        return self.sizing.count if self.sizing is not None else default


def _seq_len(inputs: tuple[torch.Tensor, ...]) -> int | None:
    """The tokens of a row: dim 1 of the first input ([batch, seq, ...], as a Hugging Face batch's input_ids or
    inputs_embeds); None for inputs without one."""
    return int(inputs[0].shape[1]) if inputs[0].dim() >= 2 else None


def weighted_loss(losses: list[torch.Tensor], shares: list[float]) -> torch.Tensor:
    """The whole batch's loss from its micro-batches' ([Note: micro-batch loss weights]). A micro-batch of weight 0
    (every label masked) has a NaN mean of its own; it adds nothing."""
    weighted = [loss * share for loss, share in zip(losses, shares) if share != 0]
    total = weighted[0] if weighted else losses[0].new_zeros(())
    for part in weighted[1:]:
        total = total + part
    return total


def concatenated_outputs(pieces: list[tuple]) -> list[torch.Tensor]:
    """A forward pass's outputs: each output of the last layer, its micro-batches' concatenated along dim 0."""
    outputs = []
    for k in range(len(pieces[0])):
        if pieces[0][k].dim() == 0:
            raise TypeError("the last layer returned a 0-dim tensor; model(...) concatenates outputs along dim 0, "
                            "so use forward_backward(...) for a layer that returns the loss.")
        outputs.append(torch.cat([p[k] for p in pieces], dim=0))
    return outputs
