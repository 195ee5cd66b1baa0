"""A stock Accelerate training loop for a causal LM, written the way transformers'
`examples/pytorch/language-modeling/run_clm_no_trainer.py` is (Accelerator, prepare, accumulate, backward,
clip_grad_norm_, step, scheduler, save_state / resume, evaluation, unwrap_model().save_pretrained), shortened.

Nothing here knows about RoundPipe. Run it as is, or on RoundPipe through a launcher, unedited:

    python examples/make_tiny_assets.py /tmp/tiny
    ARGS="--config_name /tmp/tiny --tokenizer_name /tmp/tiny --train_file /tmp/tiny/train.txt \
          --validation_file /tmp/tiny/validation.txt --output_dir /tmp/out --max_train_steps 20"
    python examples/stock_accelerate_clm.py $ARGS                                  # plain
    ROUNDPIPE_DEVICES=cpu,cpu accelerate launch -m accelerate_roundpipe.run examples/stock_accelerate_clm.py $ARGS

Besides the usual outputs it writes `step_losses.json` (the loss of every micro-batch, in order) to --output_dir.
"""

import argparse
import json
import math
import os
from itertools import chain

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args():
    parser = argparse.ArgumentParser(description="Train a causal LM with an Accelerate loop.")
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--validation_file", type=str, required=True)
    parser.add_argument("--config_name", type=str, required=True)
    parser.add_argument("--tokenizer_name", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    # A seedable sampler keeps the shuffled order of a resumed run identical to the original run's.
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    raw_datasets = datasets.load_dataset("text", data_files={"train": args.train_file,
                                                             "validation": args.validation_file})
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    config = AutoConfig.from_pretrained(args.config_name)
    model = AutoModelForCausalLM.from_config(config)

    with accelerator.main_process_first():
        tokenized = raw_datasets.map(lambda examples: tokenizer(examples["text"]), batched=True,
                                     remove_columns=["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated["input_ids"]) // args.block_size * args.block_size
        result = {k: [t[i:i + args.block_size] for i in range(0, total_length, args.block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized.map(group_texts, batched=True)

    train_dataloader = DataLoader(lm_datasets["train"], shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(lm_datasets["validation"], collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight", "norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    # As run_clm_no_trainer.py: a prepared scheduler steps once per process at every optimizer step.
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps else None

    completed_steps = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint.rstrip("/")))[0]
        resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // args.gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)

    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    progress_bar.update(completed_steps)
    step_losses = []
    perplexity = None
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                step_losses.append(loss.detach().float().item())
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if checkpointing_steps and completed_steps % checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        eval_loss = torch.mean(torch.cat(losses))
        perplexity = math.exp(eval_loss) if eval_loss < 100 else float("inf")
        accelerator.print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        if completed_steps >= args.max_train_steps:
            break

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"perplexity": perplexity}, f)
        with open(os.path.join(args.output_dir, "step_losses.json"), "w") as f:
            json.dump(step_losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
