"""`ddptrain eval RUN_DIR`: the loss of a checkpoint, the same number the trainer logged as val_loss.

The model and data are rebuilt from the checkpoint's config (plus command-line overrides): the
built-in GPT, model.hf or model.target; the prepared corpus in data.dir or data.target's datasets.
A run whose model or data were live objects passed to `ddptrain.train()` exits 2 saying which key to
add (models.require_model_source, data.require_data_source). The samples and the mean are
train/evaluation.py's, so `--batches` equal to the run's `train.eval_batches` gives its val_loss at
any world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddptrain import streams
from ddptrain.checkpoint import VerifiedCheckpoint
from ddptrain.checkpoint.adapters import BASE_DIGEST, with_adapters
from ddptrain.checkpoint.store import select_checkpoint
from ddptrain.checks import existing_dir, number_in
from ddptrain.cli_options import REQUIRED, option
from ddptrain.config import Config, config_from_mapping
from ddptrain.dist import close_distributed, init_distributed
from ddptrain.errors import ConfigError, DataError
from ddptrain.models import build_model
from ddptrain.models.loss import call_model, model_name, to_device


@dataclass(frozen=True)
class EvalOptions:
    """What `ddptrain eval` reads from its command line."""

    run_dir: str = option(REQUIRED, None, positional=True)
    overrides: tuple[str, ...] = option(
        (), "dotted overrides of the saved config, e.g. data.dir=data/other", positional=True, repeat=True
    )
    step: int | None = option(None, "checkpoint step (default: the newest good one)")
    split: str = option("val", "split of the prepared corpus")
    batches: int = option(
        0,
        "global batches of train.global_batch_size samples, at any world size (default {default}: the whole split); "
        "the run's train.eval_batches gives the trainer's val_loss",
    )


def evaluate(options: EvalOptions) -> int:
    """Mean loss and perplexity of a checkpoint on a split of the data (alone or as every rank under torchrun)."""
    run_dir = existing_dir("run folder", Path(options.run_dir))
    if options.step is not None:
        number_in("--step", options.step, 0, 10**15)
    number_in("--batches", options.batches, 0, 10**12)
    ckpt = select_checkpoint(run_dir, options.step, streams.say)
    line = evaluate_checkpoint(ckpt, options.split, options.batches, options.overrides)
    if line is not None:
        print(line)
    return 0


def model_of(ckpt: VerifiedCheckpoint, overrides: Sequence[str] = ()) -> tuple[Config, torch.nn.Module]:
    """The config a checkpoint was saved with (plus overrides) and its model, weights loaded, in eval mode."""
    cfg = config_from_mapping(ckpt.manifest.config, list(overrides))
    base = ckpt.manifest.identity.get(BASE_DIGEST)  # model.peft: the base the adapters were trained on
    model, _ = with_adapters(build_model(cfg.model), cfg.model, base)
    try:
        model.load_state_dict(ckpt.state("model"))
    except RuntimeError as e:  # a model.target given now that builds another shape than the one trained
        first = " ".join(str(e).split())[:300]
        raise ConfigError(f"{ckpt.path.name}'s weights do not fit the model the config builds: {first}") from None
    return cfg, model.eval()


def tokenizer_dir(cfg: Config, data_dir: str | None) -> Path | None:
    """The corpus whose tokenizer an export carries: --data-dir, else the run's data.dir (None for data.target)."""
    if data_dir is not None:
        return existing_dir("--data-dir", Path(data_dir))
    if cfg.data.live is not None and cfg.data.target is None:
        raise ConfigError(
            f"data.live={cfg.data.live!r}: the run trained on live datasets passed to ddptrain.train(), whose "
            "tokenizer ddptrain does not know; pass --data-dir DIR (the prepared corpus the model's tokens come from)"
        )
    return Path(cfg.data.dir) if cfg.data.target is None else None


def evaluate_checkpoint(ckpt: VerifiedCheckpoint, split: str, batches: int, overrides: Sequence[str]) -> str | None:
    """The loss of ckpt on split over `batches` global batches (0: all of it), on this process's share of
    the job; the line to print on rank 0, None elsewhere."""
    from ddptrain.data.collate import build_collate
    from ddptrain.train.evaluation import eval_samples, evaluate_loss
    from ddptrain.train.precision import Precision

    cfg, model = model_of(ckpt, overrides)
    dataset, source = _eval_split(cfg, split, model)
    collate = build_collate(cfg.data)  # training's batching; a bad data.collate exits 2 before the group forms
    n = eval_samples(batches, cfg.train.global_batch_size, len(dataset))
    if n < 1:
        raise DataError(f"split {split!r} of {source} has no samples")
    ctx = init_distributed(cfg.dist)
    try:
        model.to(ctx.device)
        precision = Precision(cfg.train.precision, ctx.device)
        name = model_name(model, cfg.model.target)

        def forward(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            with precision.autocast():
                return call_model(m, to_device(batch, ctx.device), name)

        loss = evaluate_loss(model, dataset, n, cfg.data.micro_batch_size, ctx, forward, collate)
        if not ctx.is_main or loss is None:
            return None
        return (
            f"{ckpt.path.name} (step {ckpt.step}) on {source} {split}: {n} samples, "
            f"loss {loss:.6f}, perplexity {math.exp(min(loss, 700)):.2f}"
        )
    finally:
        close_distributed(ctx)


def _check_corpus(cfg: Config, model: torch.nn.Module, data_dir: Path) -> None:
    """DataError, as training raises it, when the corpus's vocabulary exceeds the model's or its bytes do not
    match its meta.json (data/verify.py): the model would index past its embedding (an IndexError, exit 1)."""
    from ddptrain.data.corpus import read_meta
    from ddptrain.data.verify import verify_corpus
    from ddptrain.models import fit_vocab_to_data

    meta = read_meta(data_dir)
    vocab = meta["vocab_size"]
    if cfg.model.target is None and cfg.model.hf is None:
        # The checkpoint's config sets model.vocab_size, so this is train's check and its message.
        fit_vocab_to_data(cfg.model, vocab)
    else:
        model_vocab = getattr(model, "vocab_size", None)  # model.hf's wrapper has it; a model.target's may not
        if isinstance(model_vocab, int) and model_vocab < vocab:
            raise DataError(f"the model has a vocabulary of {model_vocab}, smaller than the data's ({vocab})")
    verify_corpus(data_dir, meta)


def _eval_split(cfg: Config, split: str, model: torch.nn.Module) -> tuple[Any, str]:
    """(the dataset of split, what it is): the prepared corpus's split (checked as training checks it), or the
    train/val set of data.target."""
    from ddptrain.data import build_datasets, require_data_source
    from ddptrain.data.dataset import load_split
    from ddptrain.train.rng import seed_everything

    require_data_source(cfg.data)
    if cfg.data.target is None:
        dataset = load_split(Path(cfg.data.dir), split, cfg.model.block_size)
        _check_corpus(cfg, model, Path(cfg.data.dir))
        return dataset, cfg.data.dir
    if split not in ("train", "val"):
        raise ConfigError(f"--split {split!r}: data.target gives the splits train and val")
    seed_everything(cfg.run.seed)  # as the trainer builds them: a factory drawing random samples draws the same
    train_set, val_set = build_datasets(cfg)
    if split == "val" and val_set is None:
        raise DataError(f"data.target={cfg.data.target!r} returned no validation set")
    return (train_set if split == "train" else val_set), cfg.data.target
