"""The engine alone, without Hugging Face: `RoundPipe` around an `nn.Sequential`, GPU if present, two CPU workers
otherwise.

A residual MLP (an `nn.Sequential` of blocks) learns a fixed random teacher on generated data; the run prints the
loss, the final accuracy on held-out data, and checks that training converged.

    python examples/engine_alone.py [--steps 60] [--devices cpu,cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig


class ResidualBlock(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(nn.functional.gelu(self.up(self.norm(x)))))


def build_model(width: int, depth: int, num_classes: int, in_features: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, width),
                         *[ResidualBlock(width, dropout=0.05) for _ in range(depth)],
                         nn.Sequential(nn.LayerNorm(width), nn.Linear(width, num_classes)))


def make_data(num_rows: int, in_features: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(in_features, num_classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(num_rows, in_features, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--devices", default=None, help="e.g. cuda:0 or cpu,cpu (default: every GPU, else cpu,cpu)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    devices = args.devices.split(",") if args.devices else (None if torch.cuda.is_available() else ["cpu", "cpu"])
    in_features, num_classes = 32, 8
    model = build_model(width=128, depth=6, num_classes=num_classes, in_features=in_features)
    engine = RoundPipe(model, RoundPipeConfig(devices=devices, num_microbatches=4))
    print(f"devices: {[str(d.device) for d in engine.devices]}; plan: {engine.partition}")
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=3e-3, weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))

    x_train, y_train = make_data(args.steps * args.batch_size, in_features, num_classes, seed=1)
    start, first_loss, loss = time.perf_counter(), None, None
    for step in range(args.steps):
        rows = slice(step * args.batch_size, (step + 1) * args.batch_size)
        engine.train()
        loss = engine.forward_backward(x_train[rows], labels=y_train[rows], loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        first_loss = loss.item() if first_loss is None else first_loss
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
    engine.synchronize()
    elapsed = time.perf_counter() - start

    x_test, y_test = make_data(1024, in_features, num_classes, seed=2)
    engine.eval()
    with torch.no_grad():
        accuracy = (engine(x_test).argmax(dim=1) == y_test).float().mean().item()
    engine.close()
    print(f"trained {args.steps} steps in {elapsed:.1f} s; loss {first_loss:.3f} -> {loss.item():.3f}; "
          f"held-out accuracy {accuracy:.1%}")
    if not loss.item() < first_loss:
        raise SystemExit("training did not reduce the loss")
    return accuracy


if __name__ == "__main__":
    main()
