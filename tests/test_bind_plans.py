"""[Note: bind plans]: the views a task binds into its layer copies, made from a plan worked out once per span, are
exactly the `flat[start:stop].view(shape)` of each parameter use (elements, shape, strides, offset), tied uses share
one tensor, and a trainable use's `.grad` is the same view of the gradient flat."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe.runtime.execution.residency import BindPlan, ParamResidency, TaskParams
from accelerate_roundpipe.runtime.state.host_store import HostStore


class Shapes(nn.Module):
    """Parameters of awkward shapes: a matrix, size-1 dimensions, a 0-dim scalar, an empty one, and rows of a
    weight shared with the next layer ([Note: row windows])."""

    def __init__(self, shared: nn.Parameter, rows: tuple[int, int] | None) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(3, 5))
        self.ones = nn.Parameter(torch.randn(1, 4, 1))
        self.scalar = nn.Parameter(torch.randn(()))
        self.empty = nn.Parameter(torch.randn(0, 3))
        self.inner = nn.Module()
        self.inner.shared = shared
        self.again = shared  # the same weight used twice in one layer: one tensor
        self.rows = rows

    def parameter_rows(self):
        return {} if self.rows is None else {"inner.shared": self.rows, "again": self.rows}


def reference(flat: torch.Tensor, start: int, stop: int, shape) -> torch.Tensor:
    return flat[start:stop].view(shape)


@pytest.mark.parametrize("span", [range(0, 1), range(1, 2), range(0, 2), range(2, 3), range(0, 3)])
@pytest.mark.parametrize("with_grad", [False, True])
def test_bound_views_are_the_sliced_views_of_each_use(span, with_grad):
    shared = nn.Parameter(torch.randn(6, 4))
    layers = [Shapes(shared, (0, 2)), Shapes(shared, (2, 6)), Shapes(shared, None)]
    store = HostStore(layers, None, None, pin_memory=False, names={})
    buckets = store.buckets_of_layers(span)
    windows = {b: store.window(span, b) for b in buckets}
    # flats that do not start at their storage's first element, so the offsets are the flats' own
    flats = {b: torch.randn(stop - start + 3)[3:] for b, (start, stop) in windows.items()}
    params = TaskParams(flats, windows, [])
    if with_grad:
        params.grads = {b: torch.randn(flat.numel() + 2)[2:] for b, flat in flats.items()}
    plan = BindPlan(store, span)
    tensors = [ParamResidency._view(params, view) for view in plan.views]
    seen: dict[tuple, torch.Tensor] = {}
    for layer, uses in plan.layers:
        bindings = store.layer_bindings[layer]
        assert len(uses) == len(bindings)
        for binding, use in zip(bindings, uses):
            tensor = tensors[use]
            key = (binding.bucket_index, binding.slot_index, binding.window)
            assert seen.setdefault(key, tensor) is tensor  # tied uses share one tensor, distinct uses do not
            slot = store.buckets[binding.bucket_index].slots[binding.slot_index]
            start, stop = binding.window or (slot.offset, slot.offset + slot.numel)
            offset = windows[binding.bucket_index][0]
            want = reference(flats[binding.bucket_index], start - offset, stop - offset, binding.shape or slot.shape)
            assert (tensor.shape, tensor.stride(), tensor.storage_offset()) == \
                (want.shape, want.stride(), want.storage_offset())
            assert tensor.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
            assert torch.equal(tensor, want)
            if with_grad:
                grad = reference(params.grads[binding.bucket_index], start - offset, stop - offset, want.shape)
                assert tensor.requires_grad and tensor.is_leaf
                assert (tensor.grad.shape, tensor.grad.stride(), tensor.grad.storage_offset()) == \
                    (grad.shape, grad.stride(), grad.storage_offset())
                assert tensor.grad.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
            else:
                assert not tensor.requires_grad and tensor.grad is None
    assert len(seen) == len(tensors)


def test_gradients_accumulate_into_the_gradient_flat():
    """Autograd adds each micro-batch's gradient into the preset `.grad` views, i.e. into the gradient flat."""
    layer = nn.Linear(3, 2)
    store = HostStore([layer], None, None, pin_memory=False, names={})
    (bucket,) = store.buckets_of_layers(range(1))
    window = store.window(range(1), bucket)
    params = TaskParams({bucket: store.buckets[bucket].compute.clone()}, {bucket: window}, [])
    params.grads = {bucket: torch.zeros_like(params.flats[bucket])}
    plan = BindPlan(store, range(1))
    weight, bias = (ParamResidency._view(params, view) for view in plan.views)
    x = torch.arange(12.0).view(4, 3)  # integers: every sum exact, whatever its order
    for _ in range(2):
        torch.nn.functional.linear(x, weight, bias).sum().backward()
    assert torch.equal(weight.grad, 2 * x.sum(0).expand(2, 3))
    assert torch.equal(params.grads[bucket][:6].view(2, 3), weight.grad)
