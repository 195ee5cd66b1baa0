"""A stock TRL SFT script (nothing RoundPipe in it): the launcher test runs it unedited, plain and on RoundPipe.

    python trl_sft_script.py --output_dir DIR [SFTConfig flags]
    python -m accelerate_roundpipe.run trl_sft_script.py --output_dir DIR [SFTConfig flags]

Offline: a tiny float64 Llama from a config and the tokenizer trained on the text accelerate_roundpipe ships.
"""

import torch
from datasets import Dataset
from transformers import HfArgumentParser, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

from accelerate_roundpipe.tiny.data import build_tokenizer, split_paragraphs, tiny_llama_config

(args,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses()
torch.manual_seed(0)
tokenizer = build_tokenizer()
model = LlamaForCausalLM(tiny_llama_config(len(tokenizer))).to(torch.float64)
train_dataset = Dataset.from_dict({"text": split_paragraphs()[0][:16]})
trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer)
trainer.train()
trainer.save_state()
