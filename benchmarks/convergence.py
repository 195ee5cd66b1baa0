"""Training quality: the plain `transformers.Trainer` beside `RoundPipeTrainer` with the exact (sync) and the
lagged (async) optimizer step, and any variant, on real text, from scratch and in a fine-tune regime.

Text: the Python standard library's own sources with a byte-level BPE trained on them here (`text_corpus.py`), so it
runs on every machine without a download. Model: a Qwen3 built from a config; its initial weights are built once and
copied into every system, and every system draws the same batches in the same order. Plain Trainer: the model in GPU
memory (CPU without a GPU). RoundPipe: one `cuda:0` worker, or two `cpu` workers without a GPU.

Regimes: `scratch` trains the initial weights at a pretraining learning rate; `finetune` starts every system from
the weights the plain Trainer reached after `finetune_base_steps` scratch steps and trains at a low learning rate.

    python benchmarks/convergence.py --preset cpu-small --plot --docs
    python benchmarks/convergence.py --preset gpu --plot --docs
    python benchmarks/convergence.py --preset gpu --variant nm4:num_microbatches=4   # any roundpipe_* field
    python benchmarks/convergence.py --records benchmarks/results/convergence_gpu_*.jsonl --plot --docs  # no training

Records (JSONL under --out, one per regime and system): per-step training loss and gradient norm, held-out loss
every `eval_every` steps and at the end, tokens/s, and the settings (optimizer mode, clipping, logging).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import convergence_report, text_corpus  # noqa: E402
from benchmarks.collect import git_commit  # noqa: E402
from benchmarks.convergence_runs import PLAIN, builtin_systems, parse_variant, train  # noqa: E402

# The GPU preset is the measurement of issue 13: a 168M-parameter Qwen3, 300 steps of 8 x 1024 tokens. The CPU preset
# trains in seconds on two cores; its learning rates are scaled up for a 0.1M-parameter model.
PRESETS = {
    "gpu": dict(hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=64, intermediate=3072, vocab=8192,
                seq=1024, batch=8, steps=300, lr=6e-4, warmup_steps=30, eval_every=50, eval_blocks=64,
                corpus_bytes=16 << 20, finetune_base_steps=300, finetune_steps=200, finetune_lr=3e-5,
                finetune_warmup_steps=0, bf16=True),
    "cpu-small": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=192, vocab=512,
                      seq=64, batch=8, steps=80, lr=3e-3, warmup_steps=8, eval_every=20, eval_blocks=32,
                      corpus_bytes=256 << 10, finetune_base_steps=80, finetune_steps=50, finetune_lr=1.5e-4,
                      finetune_warmup_steps=0, bf16=False, num_microbatches=2),
}
COMMON = dict(max_grad_norm=1.0, weight_decay=0.0, scheduler="cosine", seed=0, holdout_every=10, num_microbatches=0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--regimes", default="scratch,finetune", help="comma-separated: scratch, finetune")
    parser.add_argument("--systems", default="hf,sync,async", help="comma-separated built-in systems")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                        help="an extra RoundPipeTrainer system: its roundpipe_<key> training arguments (repeatable)")
    for name, value in {**COMMON, **PRESETS["cpu-small"]}.items():
        if isinstance(value, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(value),
                                help=f"default: the preset's (cpu-small: {value})")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="directory of the JSONL")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                        help="sys.setswitchinterval for the whole process (every system) before training; default: "
                             "CPython's 0.005 (issue 26: does the GIL's hand-over bound the 168M preset?)")
    parser.add_argument("--records", nargs="+", help="plot/document these JSONL files instead of training")
    parser.add_argument("--plot", action="store_true", help="write docs/assets/convergence_<preset>.png")
    parser.add_argument("--docs", action="store_true", help="update the preset's table in docs/convergence.md")
    return parser.parse_args(argv)


def resolve(args: argparse.Namespace) -> dict:
    """The preset's values, with every flag given on the command line on top."""
    values = {**COMMON, **PRESETS[args.preset]}
    values.update({k: getattr(args, k) for k in values if getattr(args, k) is not None})
    return values


def qwen3_config(p: dict):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                       num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                       num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"], max_position_embeddings=p["seq"],
                       tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)


def initial_state(model_config, seed: int) -> tuple[dict, int]:
    """The initial weights every system copies (built once: the same init for all), and the parameter count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, sum(p.numel() for p in model.parameters())


def regime_settings(p: dict, regime: str) -> dict:
    prefix = "finetune_" if regime == "finetune" else ""
    # The fine-tune draws its batches in another order than the scratch run did (the same for every system), so it
    # does not replay the batches its starting weights were trained on first.
    return dict(steps=p[prefix + "steps"], lr=p[prefix + "lr"], warmup_steps=p[prefix + "warmup_steps"],
                scheduler=p["scheduler"], weight_decay=p["weight_decay"], max_grad_norm=p["max_grad_norm"],
                eval_every=p["eval_every"], data_seed_offset=1 if regime == "finetune" else 0)


def run(args: argparse.Namespace, p: dict) -> list[dict]:
    """Train every regime x system; returns the records (also written as JSONL under --out)."""
    systems = [builtin_systems()[name] for name in filter(None, args.systems.split(","))]
    try:  # parsed before any training: a typo stops the run at once, with the field names to choose from
        systems += [parse_variant(text) for text in args.variant]
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    regimes = [r for r in args.regimes.split(",") if r]
    if set(regimes) - {"scratch", "finetune"}:
        raise SystemExit(f"--regimes {args.regimes!r}: choose from scratch, finetune")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # two CPU workers are threads of their own; one intra-op thread each, for all
    sizes = dict(batch=p["batch"], seq=p["seq"], seed=p["seed"], bf16=p["bf16"],
                 num_microbatches=p["num_microbatches"] or None)
    train_texts, held_out_texts, corpus = text_corpus.read_split(p["corpus_bytes"], p["holdout_every"])
    tokenizer = text_corpus.train_tokenizer(train_texts, p["vocab"])
    train_set = text_corpus.PackedBlocks(tokenizer, train_texts, p["seq"])
    eval_set = text_corpus.PackedBlocks(tokenizer, held_out_texts, p["seq"], max_blocks=p["eval_blocks"])
    model_config = qwen3_config(p)
    init, params = initial_state(model_config, p["seed"])
    setup = {"preset": args.preset, "commit": git_commit(), "date": datetime.date.today().isoformat(),
             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__, "parameters": params, "sizes": p, "corpus": vars(corpus),
             "train_blocks": len(train_set), "eval_blocks": len(eval_set)}
    print(f"corpus: {corpus}; {len(train_set)} train / {len(eval_set)} held-out blocks of {p['seq']}; "
          f"Qwen3 {params / 1e6:.2f}M parameters", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"convergence_{args.preset}_{setup['date']}_{setup['commit']}_seed{p['seed']}.jsonl"
    records = []
    plain_end = None  # the plain Trainer's weights after the scratch run: the fine-tune start when steps agree
    for regime in regimes:
        settings = regime_settings(p, regime)
        start = init
        if regime == "finetune":
            start = plain_end if plain_end is not None and p["steps"] == p["finetune_base_steps"] else None
            if start is None:
                base = dict(regime_settings(p, "scratch"), steps=p["finetune_base_steps"])
                _, start = train(builtin_systems()[PLAIN], model_config, init, train_set, eval_set, base, sizes)
        for system in systems:
            record, end = train(system, model_config, start, train_set, eval_set, settings, sizes)
            if regime == "scratch" and system.name == PLAIN:
                plain_end = end
            record = {"regime": regime, **record, "setup": setup}
            records.append(record)
            print(f"{regime:8s} {system.name:10s} held-out {record['final_eval_loss']:.4f}  "
                  f"{record['tokens_per_s']:,.0f} tok/s  ({record['settings']['optimizer_mode']})", flush=True)
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")
    print(f"records: {path}")
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
        print(f"thread switch interval: {sys.getswitchinterval()} s (every system of this run)")
    if args.records:
        records = [json.loads(line) for name in args.records for line in open(name) if line.strip()]
    else:
        records = run(args, resolve(args))
    if args.plot:
        print(f"plot: {convergence_report.plot(records, REPO / 'docs' / 'assets')}")
    if args.docs:
        print(f"docs: {convergence_report.write_docs(records, REPO / 'docs' / 'convergence.md')}")
    return records


if __name__ == "__main__":
    main()
