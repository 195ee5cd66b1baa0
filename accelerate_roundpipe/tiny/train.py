"""The main job: fine-tune a tiny Llama on the text this package ships, with `RoundPipeTrainer`, and watch the loss
fall. Everything is local: the model is built from a config, the tokenizer is trained on the text in a second.
GPUs are used when present (every visible one, as RoundPipe workers); otherwise two CPU workers.

    python -m accelerate_roundpipe.tiny.train [--max_steps 100] [--devices cpu,cpu] [--output_dir DIR]

It evaluates on held-out text four times along the way and prints the held-out loss at the end. The trained model
(weights, config, tokenizer) is saved to `--output_dir` (default: a new temporary directory) and the job prints
where; nothing else is left behind.

[Note: main job length]
The default of 100 steps ends near the best held-out loss of this set-up: measured on two CPU workers (each count
a run of its own, the cosine schedule ending there), the held-out loss after 40/60/80/90/100/110/120/160 steps
was 4.481/4.045/3.737/3.663/3.654/3.676/3.729/4.149; past about 100 steps the model overfits the shipped text.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import tempfile
import time

import torch


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=100, help="training steps ([Note: main job length])")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--devices", default=None, help="RoundPipe workers, e.g. cuda:0,cuda:1 or cpu,cpu "
                                                        "(default: every GPU, else cpu,cpu)")
    parser.add_argument("--num_microbatches", type=int, default=4)
    parser.add_argument("--output_dir", default=None, help="where the trained model is saved (default: a new "
                                                           "temporary directory, printed at the end)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    args = parse_args(argv)
    with _no_empty_compile_cache():
        return _train(args)


@contextlib.contextmanager
def _no_empty_compile_cache():
    """Importing `transformers.Trainer` imports `torch._dynamo`, which creates torch's compile cache directory
    (`torchinductor_<user>`) in the temporary directory; this job compiles nothing, so it would be left there
    empty. Removed afterwards only when this run created it and it is still empty."""
    temp = tempfile.gettempdir()
    before = set(os.listdir(temp))
    try:
        yield
    finally:
        for name in set(os.listdir(temp)) - before:
            path = os.path.join(temp, name)
            if name.startswith("torchinductor_") and os.path.isdir(path) and not os.listdir(path):
                with contextlib.suppress(OSError):  # someone else's, filled meanwhile: keep it
                    os.rmdir(path)


def _train(args) -> dict[str, float | str]:
    from transformers import LlamaForCausalLM, PrinterCallback, set_seed

    from ..integrations import RoundPipeTrainer, RoundPipeTrainingArguments
    from .data import build_tokenizer, lm_datasets, tiny_llama_config

    devices = args.devices or ("cpu,cpu" if not torch.cuda.is_available() else None)
    if devices is not None and all(d.strip() == "cpu" for d in devices.split(",")):
        # Each CPU worker is a thread of its own; intra-op threads on top of them only fight for the same cores.
        torch.set_num_threads(1)
    # Under torchrun / accelerate launch (one process per machine) every rank trains; rank 0 speaks and saves.
    main_process = int(os.environ.get("RANK", "0")) == 0
    say = print if main_process else (lambda *args, **kwargs: None)
    set_seed(0)
    tokenizer = build_tokenizer()
    train_dataset, eval_dataset = lm_datasets(tokenizer, args.block_size)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), args.hidden_size, args.num_hidden_layers))
    say(f"model: Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.num_hidden_layers} layers; data: {len(train_dataset)} blocks of {args.block_size} tokens")

    made_output_dir = args.output_dir is None
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="roundpipe_train_tiny_")
    training_args = RoundPipeTrainingArguments(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.learning_rate, warmup_steps=30,
        lr_scheduler_type="cosine", weight_decay=0.01, max_grad_norm=1.0, logging_steps=10, save_strategy="no",
        eval_strategy="steps", eval_steps=max(1, args.max_steps // 4),  # the held-out curve, four points
        report_to=[], disable_tqdm=True, seed=0, dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # under torchrun on a CPU-only machine: one rank per process
        roundpipe_devices=devices,
        roundpipe_num_microbatches=args.num_microbatches)
    printer = _loss_printer()
    trainer = RoundPipeTrainer(model=model, args=training_args, train_dataset=train_dataset,
                               eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=[printer])
    trainer.remove_callback(PrinterCallback)  # the printer above says it in one line
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    engine = trainer.roundpipe_engine
    say(f"RoundPipe: devices {[str(d.device) for d in engine.devices]}, plan {engine.partition}")
    printer.print_evaluations = False  # the final evaluation gets a line of its own below
    eval_loss = trainer.evaluate()["eval_loss"]
    first, last = printer.losses[0], printer.losses[-1]
    say(f"trained {args.max_steps} steps in {elapsed:.1f} s (held-out evaluations included): loss {first:.3f} -> "
        f"{last:.3f}")
    say(f"held-out loss at the end: {eval_loss:.3f} (perplexity {math.exp(eval_loss):.1f}, vocabulary "
        f"{len(tokenizer)})")
    trainer.save_model(output_dir)  # the newest weights (the lagged step is flushed first), config and tokenizer
    say(f"model saved to {output_dir} (LlamaForCausalLM.from_pretrained({output_dir!r}) loads it)")
    model.eval()
    prompt = tokenizer("The river", return_tensors="pt")
    with torch.no_grad():
        sample = model.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    say(f"sample: {tokenizer.decode(sample[0], skip_special_tokens=True)!r}")
    engine.close()
    if made_output_dir and not main_process:
        shutil.rmtree(output_dir, ignore_errors=True)  # only rank 0 saved; leave nothing else behind
    if not last < first:
        raise SystemExit("training did not reduce the loss")
    return {"first_loss": first, "last_loss": last, "eval_loss": eval_loss, "output_dir": output_dir}


def _loss_printer():
    """A Trainer callback that prints each logged loss (training and held-out) and keeps the training ones."""
    from transformers import TrainerCallback

    class LossPrinter(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.print_evaluations = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                if int(os.environ.get("RANK", "0")) != 0:  # one line per step under torchrun: rank 0's
                    return
                grad_norm = logs.get("grad_norm")
                norm = f"  grad norm {grad_norm:.3f}" if grad_norm is not None else ""
                print(f"step {state.global_step:4d}  loss {logs['loss']:.4f}{norm}  lr {logs['learning_rate']:.2e}")
            elif logs and "eval_loss" in logs and self.print_evaluations and int(os.environ.get("RANK", "0")) == 0:
                print(f"step {state.global_step:4d}  held-out loss {logs['eval_loss']:.4f}")

    return LossPrinter()


if __name__ == "__main__":
    main()
