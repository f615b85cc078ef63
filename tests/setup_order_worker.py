"""Run under torchrun: record the collectives the run's set-up issues, by two code paths.

Each torch.distributed entry point the set-up may use is wrapped by a recorder that notes its
name and then calls the real function (the collectives really run). Rank r writes
OUT/rank-r.json: {"init": [...], "cli": [...], "api": [...]}: the process group's creation, then
build_run by the config path (what `ddptrain train` does) and with a live model and datasets.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ddptrain.config import Config, load_config
from ddptrain.dist import DistContext
from ddptrain.models import build_model
from ddptrain.run import build_run, distributed

RECORDED = (
    "init_process_group",
    "new_group",
    "all_gather_object",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    "_broadcast_coalesced",
    "_verify_params_across_processes",
)
calls: list[str] = []


def recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapper


for name in RECORDED:
    if hasattr(dist, name):
        setattr(dist, name, recording(name, getattr(dist, name)))
# DDP's constructor reaches these through torch.distributed's C++ bindings, imported by name.
import torch.nn.parallel.distributed as ddp_module  # noqa: E402

for name in ("_verify_params_across_processes",):
    if hasattr(ddp_module, name):
        setattr(ddp_module, name, recording(name, getattr(ddp_module, name)))


def build_sequence(cfg: Config, ctx: DistContext, live: bool) -> list[str]:
    """The collectives of one build_run(), by the config path or with a live model and datasets."""
    calls.clear()
    model = datasets = None
    if live:
        torch.manual_seed(0)
        model = build_model(cfg.model)
        x = torch.randint(0, 256, (64, cfg.model.block_size + 1))
        datasets = (TensorDataset(x[:, :-1], x[:, 1:]), None)
    run = build_run(cfg, ctx, model, datasets)
    run.close()
    return list(calls)


def main() -> None:
    corpus, out = Path(sys.argv[1]), Path(sys.argv[2])
    common = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "data.micro_batch_size=4",
        "train.global_batch_size=8",
        f"data.dir={corpus}",
    ]
    cli_cfg = load_config(None, [*common, f"run.dir={out / 'cli'}"])
    api_cfg = load_config(None, [*common, f"run.dir={out / 'api'}"])
    with distributed(cli_cfg) as ctx:
        result = {
            "init": list(calls),
            "cli": build_sequence(cli_cfg, ctx, live=False),
            "api": build_sequence(api_cfg, ctx, live=True),
        }
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
