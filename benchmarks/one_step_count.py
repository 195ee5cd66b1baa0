"""What one `RoundPipeTrainer` step touches: package files and functions called, threads, and the hand-offs between
threads (futures made, jobs submitted to a thread, queue puts, tickets reserved). A count of structure, not of speed:
two CPU workers, a tiny Llama from a config, exact step, `max_grad_norm=1.0`; the fourth step is profiled.

    python benchmarks/one_step_count.py          # against the installed package, or PYTHONPATH=<checkout>
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch
from transformers import LlamaForCausalLM, TrainerCallback, set_seed

import accelerate_roundpipe
from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments
from accelerate_roundpipe.tiny.data import build_tokenizer, lm_blocks, split_paragraphs, tiny_llama_config

PACKAGE = os.path.dirname(accelerate_roundpipe.__file__)
HAND_OFFS = ("future.__init__", "submit", "reserve", "queue.put")


class StepProfile:
    """Calls into the package (and queue puts made from it) on every thread while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls: collections.Counter = collections.Counter()
        self.functions: set = set()
        self.threads: set = set()
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event != "call":
            return
        code = frame.f_code
        with self._lock:
            self.threads.add(threading.current_thread().name)
            if code.co_filename.startswith(PACKAGE):
                self.functions.add((code.co_filename, code.co_firstlineno))
                self.calls[code.co_qualname] += 1
            elif code.co_name == "put" and "queue" in code.co_filename and frame.f_back is not None \
                    and frame.f_back.f_code.co_filename.startswith(PACKAGE):
                self.calls["queue.put (from the package)"] += 1


class ProfileOneStep(TrainerCallback):
    def __init__(self, profile: StepProfile, step: int) -> None:
        self.profile, self.step = profile, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.profile.on = self.profile.on or state.global_step == self.step - 1

    def on_step_end(self, args, state, control, **kwargs):
        self.profile.on = self.profile.on and state.global_step < self.step


def main() -> None:
    torch.set_num_threads(1)
    set_seed(0)
    tokenizer = build_tokenizer()
    blocks = lm_blocks(tokenizer, split_paragraphs()[0], 32)
    rows = [{k: torch.tensor(blocks[k][i]) for k in blocks} for i in range(64)]
    args = RoundPipeTrainingArguments(output_dir="/tmp/one_step_count", max_steps=6, per_device_train_batch_size=8,
                                      logging_steps=100, save_strategy="no", report_to=[], disable_tqdm=True,
                                      roundpipe_devices="cpu,cpu", roundpipe_num_microbatches=4)
    profile = StepProfile()
    trainer = RoundPipeTrainer(model=LlamaForCausalLM(tiny_llama_config(len(tokenizer))), args=args,
                               train_dataset=rows, callbacks=[ProfileOneStep(profile, step=4)])
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print("package files:", len({path for path, _ in profile.functions}))
    print("package functions:", len(profile.functions))
    print("threads:", len(profile.threads), sorted(profile.threads))
    for name, count in sorted(profile.calls.items()):
        if any(key in name.lower() for key in HAND_OFFS):
            print(f"  {name}: {count}")


if __name__ == "__main__":
    main()
