"""Way 2, in code: `RoundPipeTrainer` with `RoundPipeTrainingArguments`.

Everything is the usual Trainer set-up; the RoundPipe knobs are `roundpipe_*` training arguments (or `ROUNDPIPE_*`
variables). Runs offline on every GPU when present, else two CPU workers; saves a checkpoint half-way and the model
at the end.

    python examples/trainer.py [--max_steps 60] [--logging_steps 10] [--output_dir /tmp/roundpipe_trainer] [--resume]
"""

import argparse

import torch
from transformers import LlamaForCausalLM, set_seed

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments
from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets, tiny_llama_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--output_dir", default="/tmp/roundpipe_trainer")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output_dir")
    args = parser.parse_args()

    set_seed(0)
    tokenizer = build_tokenizer()
    train_dataset, eval_dataset = lm_datasets(tokenizer, block_size=64)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=128, num_hidden_layers=4))
    training_args = RoundPipeTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=2e-3, warmup_steps=10, lr_scheduler_type="cosine",
        max_grad_norm=1.0, logging_steps=args.logging_steps, save_steps=args.max_steps // 2, eval_strategy="steps",
        eval_steps=args.max_steps // 2, report_to=[], dataloader_pin_memory=torch.cuda.is_available(),
        roundpipe_devices=None if torch.cuda.is_available() else "cpu,cpu",  # None: every visible GPU
        roundpipe_num_microbatches=4,
        roundpipe_async_optimizer=True,  # staleness-1 CPU step beside the next iteration (the default)
    )
    trainer = RoundPipeTrainer(model=model, args=training_args, train_dataset=train_dataset,
                               eval_dataset=eval_dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(trainer.evaluate())
    trainer.save_model()  # save_pretrained of the newest weights (the lagged step is flushed first)
    trainer.roundpipe_engine.close()


if __name__ == "__main__":
    main()
