"""A stock Hugging Face causal-LM script: `HfArgumentParser` + `Trainer`, in the shape of transformers'
`examples/pytorch/language-modeling/run_clm.py` (model from a config, text files, blocks of tokens), shortened.

Nothing here knows about RoundPipe. Run it as is, or on RoundPipe through the launcher, unedited:

    python examples/make_tiny_assets.py /tmp/tiny
    ARGS="--config_name /tmp/tiny --tokenizer_name /tmp/tiny --train_file /tmp/tiny/train.txt \
          --validation_file /tmp/tiny/validation.txt --output_dir /tmp/out --do_train --do_eval --max_steps 20"
    python examples/stock_trainer_clm.py $ARGS                                   # plain
    ROUNDPIPE_DEVICES=cpu,cpu python -m accelerate_roundpipe.run examples/stock_trainer_clm.py $ARGS   # RoundPipe
"""

import logging
import math
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    config_name: str = field(metadata={"help": "Model config name or path (the model is trained from scratch)."})
    tokenizer_name: str = field(metadata={"help": "Tokenizer name or path."})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A text file, one example per line."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file for evaluation."})
    block_size: int = field(default=64, metadata={"help": "Tokens per training example after grouping."})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[
        logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    set_seed(training_args.seed)

    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = datasets.load_dataset("text", data_files=data_files)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    config = AutoConfig.from_pretrained(model_args.config_name)
    model = AutoModelForCausalLM.from_config(config)

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    tokenized = raw_datasets.map(tokenize_function, batched=True, remove_columns=["text"])
    block_size = data_args.block_size

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated["input_ids"]) // block_size * block_size
        result = {k: [t[i:i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized.map(group_texts, batched=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm_datasets["train"] if training_args.do_train else None,
        eval_dataset=lm_datasets["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 100 else float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
