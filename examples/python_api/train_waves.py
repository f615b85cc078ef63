"""Training from Python with live objects: no config file, no import paths.

    python examples/python_api/train_waves.py                              # one process
    ddptrain launch --nproc-per-node 2 -- examples/python_api/train_waves.py   # two ranks (or torchrun ...)

Every rank runs this whole script; ddptrain.train joins the torchrun job, shards the data,
wraps the model in DDP and returns the same result on every rank.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import ddptrain


class Regressor(nn.Module):
    """forward(x, y) returns the mean loss: the model protocol ddptrain trains."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def waves(n: int, seed: int) -> TensorDataset:
    """y = sin(3 x0) + x1^2 on [-1, 1]^2: a tuple dataset, each item (x, y)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 2 - 1
    return TensorDataset(x, (torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2))


def main(run_dir: str) -> int:
    config = {
        "run": {"name": "waves", "dir": run_dir},
        "data": {"micro_batch_size": 16},
        "train": {"global_batch_size": 32, "max_steps": 60, "lr": 0.01, "warmup_steps": 5, "eval_every": 60},
        "log": {"every_steps": 20},
        "ckpt": {"every_steps": 30},
    }
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    result = ddptrain.train(config, model=Regressor(), datasets=(waves(4096, 0), waves(512, 1)))
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"finished: step {result.step}, loss {result.loss:.4f}, val_loss {result.val_loss:.4f}, "
            f"run dir {result.run_dir}"
        )
    return result.exit_code  # 0, or preempted's / interrupted's: what `ddptrain launch` acts on


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/waves"))
