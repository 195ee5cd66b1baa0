"""Offline ingredients for small runs: the shipped text, a tokenizer trained on it locally, LM blocks, tiny configs.

Shared by `python -m accelerate_roundpipe.tiny.train`, the examples and the integration tests, so none of them
downloads anything. `write_assets(directory)` lays the same things out the way stock Hugging Face scripts expect them
(`--tokenizer_name DIR --config_name DIR --train_file DIR/train.txt --validation_file DIR/validation.txt`).
"""

from __future__ import annotations

import os

from .corpus import TEXT

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]


def paragraphs() -> list[str]:
    return [line for line in TEXT.splitlines() if line.strip()]


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on the shipped text (deterministic, a fraction of a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(paragraphs(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def split_paragraphs(eval_every: int = 10) -> tuple[list[str], list[str]]:
    """Every `eval_every`-th paragraph is held out for evaluation."""
    texts = paragraphs()
    train = [t for i, t in enumerate(texts) if i % eval_every != eval_every - 1]
    held_out = [t for i, t in enumerate(texts) if i % eval_every == eval_every - 1]
    return train, held_out


def lm_blocks(tokenizer, texts: list[str], block_size: int) -> dict[str, list[list[int]]]:
    """Concatenate the tokenized texts (each ended by EOS) and cut them into `block_size` blocks, as HF's
    `run_clm.py` does; labels are the inputs (the model shifts them)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
    usable = len(ids) // block_size * block_size
    blocks = [ids[i:i + block_size] for i in range(0, usable, block_size)]
    return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
            "labels": [list(b) for b in blocks]}


def lm_datasets(tokenizer, block_size: int = 64):
    """(train, eval) `datasets.Dataset`s of LM blocks from the shipped text."""
    from datasets import Dataset

    train, held_out = split_paragraphs()
    return (Dataset.from_dict(lm_blocks(tokenizer, train, block_size)),
            Dataset.from_dict(lm_blocks(tokenizer, held_out, block_size)))


def tiny_llama_config(vocab_size: int, hidden_size: int = 64, num_hidden_layers: int = 2, **overrides):
    """A float32 Llama small enough for CPU tests; no dropout, so runs are reproducible."""
    from transformers import LlamaConfig

    values = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                  attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    values.update(overrides)
    return LlamaConfig(**values)


def write_assets(directory: str, hidden_size: int = 64, num_hidden_layers: int = 2) -> str:
    """Tokenizer, model config and train/validation text files in `directory`, for stock scripts; returns it."""
    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory)
    tiny_llama_config(len(tokenizer), hidden_size, num_hidden_layers).save_pretrained(directory)
    train, held_out = split_paragraphs()
    for name, texts in (("train.txt", train), ("validation.txt", held_out)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write("\n".join(texts) + "\n")
    return directory
