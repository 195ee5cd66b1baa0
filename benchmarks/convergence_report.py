"""The convergence benchmark's outputs for people: loss curves as a PNG and the results table of docs/convergence.md.

Both read the JSONL records of `benchmarks/convergence.py` (one per regime, system and seed, each carrying its
`setup`). The table lives between `<!-- convergence:<preset>:begin -->` and `<!-- convergence:<preset>:end -->`, so
a run of one preset rewrites only its own table (appended as a new section when the page has no markers for it).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

PLAIN = "hf"


def _by_preset(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[record["setup"]["preset"]].append(record)
    return groups


def _smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps: single-batch losses are noisy, the trend is what is compared."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(records: list[dict], directory: Path) -> list[str]:
    """One PNG per preset, `convergence_<preset>.png`: a panel per regime with each system's training loss
    (smoothed, solid) and held-out loss (markers, dashed); the lowest seed's runs when several seeds are given."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machines
    import matplotlib.pyplot as plt

    written = []
    for preset, group in _by_preset(records).items():
        seed = min(r["setup"]["sizes"]["seed"] for r in group)
        group = [r for r in group if r["setup"]["sizes"]["seed"] == seed]
        regimes = list(dict.fromkeys(r["regime"] for r in group))
        fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4.2), squeeze=False)
        for ax, regime in zip(axes[0], regimes):
            for index, record in enumerate(r for r in group if r["regime"] == regime):
                color = f"C{index}"
                steps = [s for s, _ in record["losses"]]
                window = max(1, len(steps) // 25)
                plain = record["system"] == PLAIN  # drawn wide and pale: an exact system lies on top of it
                ax.plot(steps, _smoothed([v for _, v in record["losses"]], window), color=color,
                        linewidth=4 if plain else 1.2, alpha=0.35 if plain else 1.0, label=f"{record['system']} train")
                # the Trainer's evaluations during training, then the final one (every step in the weights)
                evals = [*record["evals"], (steps[-1], record["final_eval_loss"])]
                ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", markersize=6 if plain else 3,
                        linewidth=4 if plain else 1.2, alpha=0.35 if plain else 1.0,
                        label=f"{record['system']} held-out")
            ax.set_title(f"{preset}: {regime} (seed {seed})")
            ax.set_xlabel("step")
            ax.set_ylabel("loss (nats/token)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"convergence_{preset}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def _gap(loss: float, plain: float | None) -> str:
    if plain is None:
        return "n/a"
    gap = loss - plain
    if abs(gap) < 1e-3:  # exact systems differ by float rounding: show its size rather than +0.0000
        return f"{gap:+.1e} ({gap / plain:+.4%})"
    return f"{gap:+.4f} ({gap / plain:+.2%})"


def table(group: list[dict]) -> str:
    """Markdown: a caption of what ran, the curves' image, and one row per regime, seed and system."""
    setup = group[0]["setup"]
    s, c = setup["sizes"], setup["corpus"]
    lines = [f"Run of {setup['date']}, commit {setup['commit']}, {setup['device']}, torch {setup['torch']}: Qwen3 "
             f"{setup['parameters'] / 1e6:.2f}M parameters ({s['layers']} layers, hidden {s['hidden']}, vocabulary "
             f"{s['vocab']}), batches of {s['batch']} x {s['seq']} tokens, scratch {s['steps']} steps at lr "
             f"{s['lr']:g}, fine-tune {s['finetune_steps']} steps at lr {s['finetune_lr']:g} from the plain "
             f"Trainer's weights after {s['finetune_base_steps']} steps; corpus: Python {c['python']} stdlib, "
             f"{c['train_bytes']:,} train bytes ({c['train_files']} files), {c['held_out_bytes']:,} held-out bytes "
             f"({c['held_out_files']} files), {setup['eval_blocks']} held-out blocks.",
             "", f"![loss curves, {setup['preset']} preset](assets/convergence_{setup['preset']}.png)", "",
             "| regime | seed | system | optimizer mode | clipping | held-out loss | gap vs plain HF | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    plain = {(r["regime"], r["setup"]["sizes"]["seed"]): r["final_eval_loss"] for r in group if r["system"] == PLAIN}
    for r in group:
        key = (r["regime"], r["setup"]["sizes"]["seed"])
        clip = r["settings"]["max_grad_norm"]
        lines.append(f"| {r['regime']} | {key[1]} | {r['system']} | {r['settings']['optimizer_mode']} | "
                     f"{clip if clip else 'off'} | {r['final_eval_loss']:.4f} | "
                     f"{'-' if r['system'] == PLAIN else _gap(r['final_eval_loss'], plain.get(key))} | "
                     f"{r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def write_docs(records: list[dict], page: Path) -> str:
    """Rewrite each preset's table in `page` (between its markers; a new section at the end if it has none)."""
    text = page.read_text() if page.exists() else "# Training quality\n"
    for preset, group in _by_preset(records).items():
        begin, end = f"<!-- convergence:{preset}:begin -->", f"<!-- convergence:{preset}:end -->"
        block = f"{begin}\n{table(group)}\n{end}"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        if pattern.search(text):
            text = pattern.sub(lambda _, block=block: block, text)  # a function: no escapes read in it
        else:
            text = text.rstrip("\n") + f"\n\n## Results: `{preset}` preset (latest run)\n\n{block}\n"
    page.write_text(text)
    return str(page)
