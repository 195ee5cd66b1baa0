"""[Note: early read release]: a task's read tickets end as each bucket's copy lands, not when the task ends."""

from __future__ import annotations

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices.factory import make_device
from accelerate_roundpipe.runtime.execution.residency import ParamResidency, TaskParams

from toy_models import tied_model


class CopyEvent:
    """Stands in for a CUDA copy event: landed or still in flight."""

    def __init__(self, landed: bool) -> None:
        self.landed = landed

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def test_read_tickets_end_as_their_copies_land_in_order():
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"]))
    store = engine._store
    residency = ParamResidency(make_device(engine.devices[0].device, 0), store, engine._failure)
    indices = [b.index for b in store.buckets[:3]]
    tickets = [(b, store.buckets[b].reads.reserve_read()) for b in indices]
    events = {indices[0]: CopyEvent(True), indices[1]: CopyEvent(False), indices[2]: CopyEvent(True)}
    params = TaskParams({}, {}, list(tickets))
    params.mark_issued(list(tickets), [events[b] for b in indices])

    def open_reads() -> list[bool]:
        return [bool(store.buckets[b].reads._open_reads.get(epoch)) for b, epoch in tickets]

    residency.release_landed(params)
    # The first copy landed: its read ends now. The second is in flight, and the copies land in order, so the third
    # is not released ahead of it.
    assert open_reads() == [False, True, True]
    events[indices[1]].landed = True
    residency.release_landed(params)
    assert open_reads() == [False, False, False] and params.tickets == []
    residency.release(params)  # the end of the task releases nothing twice
    assert all(not store.buckets[b].reads._open_reads for b in indices)
    engine.close()
