"""The tiny Llama the Trainer and Accelerate comparisons train, built the same way for the plain run and ours."""

from __future__ import annotations


def seeded_tiny_llama(vocab_size: int):
    """A fresh `LlamaForCausalLM` of `tiny_llama_config(vocab_size)`, its weights drawn after `set_seed(0)`: every call
    gives the same weights, so a reference run and a RoundPipe run start equal."""
    from transformers import LlamaForCausalLM, set_seed

    from accelerate_roundpipe.tiny.data import tiny_llama_config

    set_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size))
