"""Trains through the Python API with the model and data given three ways (argv: MODE RUN_DIR [CORPUS]).

live      a live nn.Module and live datasets (examples/regression's, built here)
factory   the factories themselves (importable: regression:build_model, regression:build_datasets)
gpt       a live built-in GPT on the prepared corpus CORPUS
live-data the built-in GPT of the config, given as a Config object, trained on live datasets (CORPUS's
          splits, built here); prints whether that Config is as it was after the run
Prints the RunResult's val_loss on the last line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import regression  # examples/regression, on PYTHONPATH
from helpers import load_token_datasets  # tests/, on PYTHONPATH

import ddptrain
from ddptrain.config import ModelConfig, config_from_mapping
from ddptrain.models.gpt import GPT

SMALL = {"dim": 4, "hidden": 16, "depth": 1}
DATA = {"n_train": 256, "n_val": 40, "dim": 4}


def main(mode: str, run_dir: str, corpus: str = "") -> None:
    config = {
        "run": {"dir": run_dir},
        "data": {"micro_batch_size": 8},
        "train": {"global_batch_size": 16, "max_steps": 4, "warmup_steps": 1, "eval_every": 4, "eval_batches": 2},
        "log": {"every_steps": 2},
        "ckpt": {"every_steps": 4},
    }
    if mode == "live":
        result = ddptrain.train(
            config, model=regression.build_model(**SMALL), datasets=regression.build_datasets(**DATA)
        )
    elif mode == "factory":
        config["model"], config["data"]["kwargs"] = {"kwargs": SMALL}, DATA
        result = ddptrain.train(config, model=regression.build_model, datasets=regression.build_datasets)
    elif mode == "live-data":
        config["model"] = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
        cfg = config_from_mapping(config)
        before = cfg.model_dump()
        result = ddptrain.train(cfg, datasets=load_token_datasets(Path(corpus), 32))
        print(f"config unchanged {cfg.model_dump() == before}")
    else:
        gpt = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
        config["data"]["dir"] = corpus
        config["model"] = {"block_size": 32}
        result = ddptrain.train(config, model=GPT(gpt))
    print(f"val_loss {result.val_loss!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
