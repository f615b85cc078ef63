"""`ddptrain eval RUN_DIR`: the loss of a checkpoint, the same number the trainer logged as val_loss.

The model and data are rebuilt from the checkpoint's config (plus command-line overrides): the
built-in GPT, model.hf or model.target; the data's source (data/source.py: the prepared corpus in
data.dir, data.target's datasets). A run whose model or data were live objects passed to
`ddptrain.train()` exits 2 saying which key to add (models.require_model_source, the live data
source). The samples and the mean are train/evaluation.py's, so `--batches` equal to the run's
`train.eval_batches` gives its val_loss at any world size. Metrics of your own (the extra scalars of
a model's output dict, train.metrics) are printed after the loss, as `val_<name>` would record
them: `name value`. The perplexity (exp of the loss) is printed for the language models ddptrain builds (the
built-in GPT, model.hf), whose loss is a next-token cross-entropy; not for a model.target's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized
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
from ddptrain.config import Config, saved_config
from ddptrain.dist import close_distributed, init_distributed
from ddptrain.errors import ConfigError, DataError
from ddptrain.models import build_model
from ddptrain.models.loss import model_name


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
    """Mean loss (and perplexity, for a language model) of a checkpoint on a split of the data (alone or as every
    rank under torchrun)."""
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
    cfg = saved_config(ckpt.manifest.config, list(overrides))
    base = ckpt.manifest.identity.get(BASE_DIGEST)  # model.peft: the base the adapters were trained on
    model, _ = with_adapters(build_model(cfg.model), cfg.model, base)
    try:
        model.load_state_dict(ckpt.state("model"))
    except RuntimeError as e:  # a model.target given now that builds another shape than the one trained
        first = " ".join(str(e).split())[:300]
        raise ConfigError(f"{ckpt.path.name}'s weights do not fit the model the config builds: {first}") from None
    return cfg, model.eval()


def tokenizer_dir(cfg: Config, data_dir: str | None) -> Path | None:
    """The corpus whose tokenizer an export carries: --data-dir, else the run's data source's (None when it has
    none; ConfigError naming --data-dir when ddptrain cannot know it)."""
    from ddptrain.data.kinds import data_source

    if data_dir is not None:
        return existing_dir("--data-dir", Path(data_dir))
    return data_source(cfg.data).tokenizer_dir()


def evaluate_checkpoint(ckpt: VerifiedCheckpoint, split: str, batches: int, overrides: Sequence[str]) -> str | None:
    """The loss of ckpt on split over `batches` global batches (0: all of it), on this process's share of
    the job; the line to print on rank 0, None elsewhere."""
    from ddptrain.data.collate import build_collate
    from ddptrain.data.kinds import data_source
    from ddptrain.train.custom_metrics import CustomMetrics
    from ddptrain.train.evaluation import eval_samples, evaluate_loss, measured_forward
    from ddptrain.train.precision import Precision

    cfg, model = model_of(ckpt, overrides)
    name = model_name(model, cfg.model.target)
    custom = CustomMetrics(cfg.train.metrics, name)  # a train.metrics that does not import exits 2 here
    dataset, source = _eval_split(cfg, split, model)
    collate = build_collate(
        cfg.data, data_source(cfg.data).pad_id
    )  # training's batching; a bad data.collate exits 2 before the group forms
    n = eval_samples(batches, cfg.train.global_batch_size, len(dataset))
    if n < 1:
        raise DataError(f"split {split!r} of {source} has no samples")
    ctx = init_distributed(cfg.dist)
    try:
        model.to(ctx.device)
        forward = measured_forward(Precision(cfg.train.precision, ctx.device), ctx.device, name, custom)
        result = evaluate_loss(model, dataset, n, cfg.data.micro_batch_size, ctx, forward, collate)
        if not ctx.is_main or result is None:
            return None
        loss = result.loss
        # exp(loss) means something for a next-token cross-entropy: the built-in GPT's and model.hf's (a causal
        # LM), not for whatever loss a model.target returns (a classification, a regression).
        perplexity = f", perplexity {math.exp(min(loss, 700)):.2f}" if cfg.model.target is None else ""
        metrics = "".join(f", {k} {v:.6f}" for k, v in result.metrics.items())
        return (
            f"{ckpt.path.name} (step {ckpt.step}) on {source} {split}: {n} samples, "
            f"loss {loss:.6f}{perplexity}{metrics}"
        )
    finally:
        close_distributed(ctx)


def _check_vocab(cfg: Config, model: torch.nn.Module, vocab: int | None) -> None:
    """DataError, as training raises it, when the data's vocabulary exceeds the model's: the model would index
    past its embedding (an IndexError, exit 1)."""
    from ddptrain.models import fit_vocab_to_data

    if vocab is None:
        return
    if cfg.model.target is None and cfg.model.hf is None:
        # The checkpoint's config sets model.vocab_size, so this is train's check and its message.
        fit_vocab_to_data(cfg.model, vocab)
    else:
        model_vocab = getattr(model, "vocab_size", None)  # model.hf's wrapper has it; a model.target's may not
        if isinstance(model_vocab, int) and model_vocab < vocab:
            raise DataError(f"the model has a vocabulary of {model_vocab}, smaller than the data's ({vocab})")


def _eval_split(cfg: Config, split: str, model: torch.nn.Module) -> tuple[Any, str]:
    """(the dataset of split, what it is), checked as training checks it: the vocabulary fits the model and the
    bytes their description (a prepared corpus's meta.json, data/verify.py)."""
    from ddptrain.data.kinds import data_source
    from ddptrain.data.source import Sampling
    from ddptrain.train.rng import seed_everything

    source = data_source(cfg.data)
    seed_everything(cfg.run.seed)  # as the trainer builds them: a factory drawing random samples draws the same
    dataset = source.split(split, Sampling.of(cfg))
    if not isinstance(dataset, Sized):
        raise DataError(f"split {split!r} of {source.describe()} has no len() (a stream): eval reads map-style splits")
    _check_vocab(cfg, model, source.vocab_size())
    source.verify()
    return dataset, source.describe()
