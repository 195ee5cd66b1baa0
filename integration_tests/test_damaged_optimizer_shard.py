"""A damaged optimizer shard (`optimizer.rank<r>-of-<n>.pt`, written by each rank of a data-parallel run) raises
`CheckpointError` naming the file, the checkpoint and the remedy ([Note: checkpoint files]), not torch.load's bare
error. One process: a one-process checkpoint dressed as a two-process one, resumed through
[Note: shards of another world size]."""

from __future__ import annotations

import os

import pytest
from test_roundpipe_trainer import close, data, roundpipe_trainer  # noqa: F401 - `data`: a fixture

from accelerate_roundpipe import CheckpointError


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_optimizer_shard_names_itself_the_checkpoint_and_the_remedy(data, tmp_path, how):  # noqa: F811
    out = str(tmp_path / "run")
    first = roundpipe_trainer(data, out, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    close(first)
    checkpoint = os.path.join(out, "checkpoint-2")
    os.replace(os.path.join(checkpoint, "optimizer.pt"), os.path.join(checkpoint, "optimizer.rank0-of-2.pt"))
    damaged = os.path.join(checkpoint, "optimizer.rank1-of-2.pt")
    with open(os.path.join(checkpoint, "optimizer.rank0-of-2.pt"), "rb") as f:
        whole = f.read()
    with open(damaged, "wb") as f:
        f.write(whole[: len(whole) // 2] if how == "truncated" else b"not a torch file \xff\xfe")
    resumed = roundpipe_trainer(data, str(tmp_path / "resumed"), max_steps=4)
    with pytest.raises(CheckpointError) as raised:
        resumed.train(resume_from_checkpoint=checkpoint)
    message = str(raised.value)
    assert "optimizer.rank1-of-2.pt" in message and checkpoint in message and "previous checkpoint" in message
    close(resumed)
