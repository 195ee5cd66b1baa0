"""Real text on every machine without a download: the Python standard library's own `.py` sources, a byte-level BPE
trained on them locally, and fixed-length packed blocks for causal-LM training.

Deterministic for a given Python installation: the files are the stdlib's `.py` files outside `site-packages` and
test directories, taken in the order of the SHA-1 of their relative path (a fixed pseudo-random order, so a byte
cap samples the whole library rather than its alphabetically first directories). Every `holdout_every`-th file of
that order is held out (split by file, so no held-out line was seen in training, not even as part of a block). The
tokenizer is trained on the training files only. `CorpusSummary` records what was read, so two runs on different
Python versions can tell that their corpora differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig

import torch

EOS = "<|endoftext|>"  # separates files in the packed stream; the model learns where a file ends
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclasses.dataclass
class CorpusSummary:
    python: str
    train_files: int
    train_bytes: int
    held_out_files: int
    held_out_bytes: int
    sha1: str  # of every file's path and text, in order: equal digests mean equal corpora


def stdlib_source_paths(root: str | None = None) -> list[str]:
    """Relative paths of the stdlib's `.py` files in the fixed pseudo-random order described above."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        found.extend(os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: hashlib.sha1(p.encode()).hexdigest())


def read_split(max_bytes: int, holdout_every: int = 20,
               root: str | None = None) -> tuple[list[str], list[str], CorpusSummary]:
    """(train texts, held-out texts, summary): every `holdout_every`-th file of the order is held out; files are read
    until the train split holds `max_bytes` and the held-out split 1/(holdout_every - 1) of that (or the files run
    out)."""
    root = root or sysconfig.get_paths()["stdlib"]
    train: list[str] = []
    held_out: list[str] = []
    sizes = {"train": 0, "held_out": 0}
    digest = hashlib.sha1()
    # Each split has its own cap (files differ wildly in size: a split must not end up as three small files).
    caps = {"train": max_bytes, "held_out": max(1, max_bytes // (holdout_every - 1))}
    for index, path in enumerate(stdlib_source_paths(root)):
        split = "held_out" if index % holdout_every == holdout_every - 1 else "train"
        if sizes[split] >= caps[split]:
            if all(sizes[s] >= caps[s] for s in caps):
                break
            continue
        with open(os.path.join(root, path), "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8", errors="replace")  # a few stdlib files are latin-1; the BPE sees the bytes anyway
        digest.update(path.encode() + b"\0" + raw)
        (held_out if split == "held_out" else train).append(text)
        sizes[split] += len(raw)
    if not train or not held_out:
        raise ValueError(f"max_bytes={max_bytes} read too little of {root} for both a train and a held-out split")
    summary = CorpusSummary(python=sys.version.split()[0], train_files=len(train), train_bytes=sizes["train"],
                            held_out_files=len(held_out), held_out_bytes=sizes["held_out"], sha1=digest.hexdigest())
    return train, held_out, summary


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (`tokenizers`), trained here in a few seconds; `EOS` is token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class PackedBlocks(torch.utils.data.Dataset):
    """The texts tokenized, joined by `EOS` and cut into `block_size` blocks (the remainder dropped); each item is
    `{"input_ids", "labels"}` with labels equal to the inputs (the model shifts them). No padding, no mask."""

    def __init__(self, tokenizer, texts: list[str], block_size: int, max_blocks: int | None = None) -> None:
        eos = tokenizer.token_to_id(EOS)
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(texts):
            ids.extend(encoding.ids)
            ids.append(eos)
        count = len(ids) // block_size
        if max_blocks is not None:
            count = min(count, max_blocks)
        if count == 0:
            raise ValueError(f"{len(ids)} tokens do not fill one block of {block_size}")
        self.blocks = torch.tensor(ids[:count * block_size], dtype=torch.long).view(count, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone()}

    @property
    def tokens(self) -> int:
        return self.blocks.numel()
