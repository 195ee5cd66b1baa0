"""LoRA on RoundPipe: a PEFT model trained with `RoundPipeTrainer`; only the adapters get optimizer state, and
`save_model` writes the adapters alone. Then the adapters are loaded back onto a fresh base model and checked.

    python examples/lora.py [--max_steps 40] [--logging_steps 10] [--output_dir /tmp/roundpipe_lora]
"""

import argparse
import copy

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM, set_seed

from accelerate_roundpipe import RoundPipeTrainer, RoundPipeTrainingArguments
from accelerate_roundpipe.tiny.data import build_tokenizer, lm_datasets, tiny_llama_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--output_dir", default="/tmp/roundpipe_lora")
    args = parser.parse_args()

    set_seed(0)
    tokenizer = build_tokenizer()
    train_dataset, eval_dataset = lm_datasets(tokenizer, block_size=64)
    base = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=128, num_hidden_layers=4))
    pristine_base = copy.deepcopy(base)  # to reload the adapters onto afterwards
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.print_trainable_parameters()

    training_args = RoundPipeTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, learning_rate=1e-2,
        logging_steps=args.logging_steps, save_strategy="no", report_to=[],
        dataloader_pin_memory=torch.cuda.is_available(),
        roundpipe_devices=None if torch.cuda.is_available() else "cpu,cpu", roundpipe_num_microbatches=4)
    trainer = RoundPipeTrainer(model=model, args=training_args, train_dataset=train_dataset,
                               eval_dataset=eval_dataset, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()  # adapter_model.safetensors + adapter_config.json only
    print(trainer.evaluate())
    batch = eval_dataset.with_format("torch")[:4]
    model.eval()
    with torch.no_grad():
        trained_loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()  # on RoundPipe
    trainer.roundpipe_engine.close()

    reloaded = PeftModel.from_pretrained(pristine_base, args.output_dir).eval()
    with torch.no_grad():
        reloaded_loss = reloaded(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    print(f"loss on 4 held-out blocks: trained model {trained_loss:.5f}, adapters reloaded onto a fresh base "
          f"{reloaded_loss:.5f}")


if __name__ == "__main__":
    main()
