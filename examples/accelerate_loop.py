"""Way 1, in code: an Accelerate training loop on RoundPipe through `RoundPipeAccelerator`.

The loop is an ordinary Accelerate loop; only the accelerator's construction names RoundPipe. Runs offline (tiny Llama
from a config, tokenizer trained on the text the package ships), on every GPU when present, else two CPU workers.

    python examples/accelerate_loop.py [--steps 40] [--devices cpu,cpu] [--gradient_accumulation_steps 2]
"""

import argparse
import math

import torch
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM, default_data_collator, get_scheduler, set_seed

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin
from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets, tiny_llama_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", default=None, help="e.g. cuda:0,cuda:1 or cpu,cpu (default: GPUs, else cpu,cpu)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args()

    devices = args.devices or (None if torch.cuda.is_available() else "cpu,cpu")
    plugin = RoundPipePlugin(devices=devices, num_microbatches=4)  # unset fields come from ROUNDPIPE_* variables
    accelerator = RoundPipeAccelerator(roundpipe_plugin=plugin,
                                       gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(0)
    tokenizer = build_tokenizer()
    train_dataset, eval_dataset = lm_datasets(tokenizer, block_size=64)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=128, num_hidden_layers=4))
    train_dataloader = DataLoader(train_dataset.with_format("torch"), batch_size=8, shuffle=True,
                                  collate_fn=default_data_collator)
    eval_dataloader = DataLoader(eval_dataset.with_format("torch"), batch_size=8, collate_fn=default_data_collator)
    no_decay = ("bias", "norm")
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ], lr=2e-3)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=5, num_training_steps=args.steps)

    # The model stays the same Hugging Face object (on RoundPipe, weights in host memory); the optimizer is
    # re-pointed to RoundPipe's float32 optimizer copies and stepped lagged on the CPU.
    model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, scheduler)
    engine = accelerator.roundpipe_engine(model)
    accelerator.print(f"RoundPipe on {[str(d.device) for d in engine.devices]}, plan {engine.partition}")

    step = 0
    model.train()
    while step < args.steps:
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss  # the whole fused forward + backward pipeline runs here
                accelerator.backward(loss)  # commits its gradients, scaled by 1 / accumulation steps
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 10 == 0 or step == args.steps:
                    accelerator.print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {grad_norm:.3f}")
                if step == args.steps:
                    break

    model.eval()
    losses = []
    with torch.no_grad():
        for batch in eval_dataloader:
            losses.append(accelerator.gather_for_metrics(model(**batch).loss.repeat(batch["input_ids"].shape[0])))
    eval_loss = torch.cat(losses).mean().item()
    accelerator.print(f"held-out loss {eval_loss:.3f} (perplexity {math.exp(eval_loss):.1f})")
    if args.output_dir:
        accelerator.unwrap_model(model).save_pretrained(args.output_dir)  # newest weights (flushed first)
        tokenizer.save_pretrained(args.output_dir)
    engine.close()


if __name__ == "__main__":
    main()
