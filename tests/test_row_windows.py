"""[Note: row windows]: a layer that reads only rows of a parameter gets, and sends back, only those rows; the
bucket, its optimizer copy and its gradient stay whole, and a windowed commit lands in its rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe.runtime.state.host_store import HostStore

ROWS, WIDTH = 12, 4


class RowReader(nn.Module):
    """Reads rows [start, stop) of a shared [ROWS, WIDTH] weight."""

    def __init__(self, weight: nn.Parameter, start: int, stop: int):
        super().__init__()
        self.holder = nn.Module()
        self.holder.weight = weight
        self.start, self.stop = start, stop

    def parameter_rows(self):
        return {"holder.weight": (self.start, self.stop)}


class WholeReader(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def make_store(tied: bool) -> tuple[HostStore, int]:
    weight = nn.Parameter(torch.arange(ROWS * WIDTH, dtype=torch.float64).view(ROWS, WIDTH))
    layers = [RowReader(weight, 0, 5), RowReader(weight, 5, 12)]
    if tied:
        layers.insert(0, WholeReader(weight))
    store = HostStore(layers, None, None, pin_memory=False, names={})
    return store, store.bucket_of[id(weight)][0]


@pytest.mark.parametrize("tied", [False, True])
def test_windows_are_the_rows_read_and_their_union(tied):
    store, bucket = make_store(tied)
    first = 1 if tied else 0
    assert store.window(range(first, first + 1), bucket) == (0, 5 * WIDTH)
    assert store.window(range(first + 1, first + 2), bucket) == (5 * WIDTH, 12 * WIDTH)
    assert store.window(range(first, first + 2), bucket) == (0, ROWS * WIDTH)
    if tied:  # a whole use makes the window the whole bucket
        assert store.window(range(0, 1), bucket) == (0, ROWS * WIDTH)
    binding = next(b for b in store.layer_bindings[first] if b.bucket_index == bucket)
    assert binding.shape == torch.Size((5, WIDTH))
    assert store.window_bytes(range(first + 1, first + 2)) == 7 * WIDTH * 8


def test_rows_outside_the_parameter_are_refused():
    weight = nn.Parameter(torch.zeros(ROWS, WIDTH))
    with pytest.raises(ValueError, match="rows 10..14 of .* 12 rows"):
        HostStore([RowReader(weight, 10, 14)], None, None, pin_memory=False, names={})


def test_windowed_commits_land_in_their_rows_and_keep_the_norm_exact():
    store, index = make_store(tied=False)
    bucket = store.buckets[index]
    bucket.clear()
    n = ROWS * WIDTH
    top = torch.full((7 * WIDTH,), 2.0, dtype=torch.float64)
    recycled = store.grad_pool.take(bucket.optim).fill_(float("nan"))  # whatever was there must not survive
    store.grad_pool.give(recycled)
    assert bucket.grad is None  # an empty bucket holds no buffer ([Note: no spare gradient buffer])
    bucket.commit(top, grad_sq=float(top.square().sum()), window=(5 * WIDTH, n))
    assert bucket.grad_valid
    assert bucket.grad.data_ptr() == recycled.data_ptr()  # a whole buffer from the pool
    assert torch.equal(bucket.grad[:5 * WIDTH], torch.zeros(5 * WIDTH, dtype=torch.float64))
    assert torch.equal(bucket.grad[5 * WIDTH:], top)
    bottom = torch.full((5 * WIDTH,), 3.0, dtype=torch.float64)
    bucket.commit(bottom, grad_sq=float(bottom.square().sum()), window=(0, 5 * WIDTH))
    # Disjoint windows into zeros: the device-measured norms add exactly, no host pass needed.
    assert bucket.grad_sq == pytest.approx(float(bucket.grad.square().sum()), rel=0, abs=0)
    again = torch.ones(5 * WIDTH, dtype=torch.float64)
    bucket.commit(again, grad_sq=float(again.square().sum()), window=(0, 5 * WIDTH))  # overlaps: unknown
    assert bucket.grad_sq is None
    assert bucket.squared_norm() == pytest.approx(float(bucket.grad.square().sum()))
    assert torch.equal(bucket.grad[:5 * WIDTH], torch.full((5 * WIDTH,), 4.0, dtype=torch.float64))
    bucket.zero()  # zero_grad(set_to_none=False): all zero again, so norms add again
    bucket.commit(again, grad_sq=float(again.square().sum()), window=(0, 5 * WIDTH))
    assert bucket.grad_sq == float(again.square().sum())
    # The parameter's .grad is a view of the whole buffer.
    slot = bucket.slots[0]
    assert slot.optim.grad.shape == (ROWS, WIDTH) and slot.optim.grad.data_ptr() == bucket.grad.data_ptr()


def test_windowed_pending_gradients_start_from_zero_outside_their_rows():
    store, index = make_store(tied=False)
    bucket = store.buckets[index]
    n = ROWS * WIDTH
    bucket.pending = torch.full((n,), float("nan"), dtype=torch.float64)  # left by an earlier pass
    bucket.add_pending(torch.ones(7 * WIDTH, dtype=torch.float64), first=True, window=(5 * WIDTH, n))
    bucket.add_pending(torch.ones(5 * WIDTH, dtype=torch.float64), first=False, window=(0, 5 * WIDTH))
    assert torch.equal(bucket.pending, torch.ones(n, dtype=torch.float64))
