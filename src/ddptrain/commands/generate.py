"""`ddptrain generate RUN_DIR --prompt TEXT`: sample from the model of a run's newest good checkpoint: the
built-in GPT or a transformers model (model.hf), LoRA adapters (model.peft) merged into either.

The prompt is encoded and the output decoded with the tokenizer of the data the run trained on
(raw bytes, or the `tokenizer.json` recorded in its meta.json, whose SHA-256 must match the one
recorded there). The model and the data's folder come from the config stored in the checkpoint's
verified manifest, never from run.dir/config.yaml, which nothing verifies.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from pydantic import ValidationError

from ddptrain.checkpoint import newest_verified
from ddptrain.checkpoint.adapters import BASE_DIGEST, with_adapters
from ddptrain.checkpoint.verify import VerifiedCheckpoint
from ddptrain.checks import existing_dir, number_in, text_arg
from ddptrain.cli_options import REQUIRED, option
from ddptrain.config import MAX_SEED, DataConfig, ModelConfig
from ddptrain.config_io import format_validation_error
from ddptrain.data.kinds import data_source
from ddptrain.data.source import BYTES
from ddptrain.data.tokenizer import Tokenizer
from ddptrain.errors import CheckpointError, ConfigError
from ddptrain.models import build_model
from ddptrain.models.gpt import GPT
from ddptrain.models.hf import HFCausalLM
from ddptrain.models.peft import merge_adapters
from ddptrain.run_folder import checkpoints_dir

_Section = TypeVar("_Section", ModelConfig, DataConfig)


def saved_section(ckpt: VerifiedCheckpoint, name: str, kind: type[_Section]) -> _Section:
    """A section of the config recorded in the checkpoint's verified manifest (never run.dir/config.yaml, which
    nothing verifies); CheckpointError when this ddptrain cannot read it."""
    try:
        return kind.model_validate(ckpt.manifest.config.get(name, {}))
    except ValidationError as e:
        reason = format_validation_error(e).removeprefix("invalid config: ")
        raise CheckpointError(
            f"{ckpt.path.name}: the config in its manifest has an invalid {name} section: {reason}"
        ) from None


def load_model(run_dir: Path, device: torch.device) -> tuple[GPT | HFCausalLM, VerifiedCheckpoint]:
    """The model of the newest verified checkpoint, adapters merged: (model in eval mode, the checkpoint).
    ConfigError for a user's model (model.target, a live module), which has no sampling interface ddptrain knows."""
    ckpt = newest_verified(checkpoints_dir(run_dir), lambda text: print(text, file=sys.stderr))
    model_cfg = saved_section(ckpt, "model", ModelConfig)
    if model_cfg.target is not None or model_cfg.live is not None:
        raise ConfigError(
            f"{ckpt.path.name} holds a user's model (model.target or a live module); generate samples from the "
            "built-in GPT and model.hf models: export its weights and sample with your own code"
        )
    built = build_model(model_cfg)
    adapted, _ = with_adapters(built, model_cfg, ckpt.manifest.identity.get(BASE_DIGEST))
    adapted.load_state_dict(ckpt.state("model"))
    model = merge_adapters(adapted)  # model.peft: LoRA folded into the base's weights; else the model itself
    assert isinstance(model, (GPT, HFCausalLM))
    return model.to(device).eval(), ckpt


@torch.inference_mode()
def continuation(
    model: GPT | HFCausalLM, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None
) -> torch.Tensor:
    """idx (B, T) and max_new_tokens tokens sampled after it: each from the logits of the last block_size tokens
    at temperature, among the top_k likeliest (None: all)."""
    if isinstance(model, GPT):
        return model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
    for _ in range(max_new_tokens):
        logits = model.logits(idx[:, -model.block_size :])[:, -1, :].float() / max(temperature, 1e-5)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits[logits < kth] = -float("inf")
        idx = torch.cat([idx, torch.multinomial(torch.softmax(logits, dim=-1), 1)], dim=1)
    return idx


def data_tokenizer(ckpt: VerifiedCheckpoint, data_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of data_dir's corpus, else of the data the checkpoint's run trained on (bytes when its source
    knows none: a corpus gone or byte-level, a data.target); ConfigError for live datasets without data_dir,
    DataError for a tokenizer.json whose SHA-256 is not the one its meta.json records (swapped after the
    corpus was prepared)."""
    data = saved_section(ckpt, "data", DataConfig) if data_dir is None else DataConfig(dir=str(data_dir))
    tokenizer = data_source(data).tokenizer()
    return BYTES if tokenizer is None else tokenizer


@dataclass(frozen=True)
class GenerateOptions:
    """What `ddptrain generate` reads from its command line."""

    run_dir: str = option(REQUIRED, None, positional=True)
    prompt: str = option("", "text to continue")
    max_new_tokens: int = option(200, "tokens to sample")
    temperature: float = option(0.8, None)
    top_k: int = option(40, "sample from the k likeliest tokens; 0 for all", show_default=False)
    seed: int = option(0, None)
    data_dir: str | None = option(None, "the prepared corpus whose tokenizer to use (default: the run's data.dir)")


def generate(options: GenerateOptions) -> int:
    """Print the prompt and a sampled continuation from the run's newest good checkpoint."""
    text_arg("--prompt", options.prompt, single_line=False)
    number_in("--temperature", options.temperature, 0, 100, low_open=True)
    number_in("--top-k", options.top_k, 0, 2**31)  # above the vocabulary means all tokens
    number_in("--max-new-tokens", options.max_new_tokens, 0, 10**6)
    number_in("--seed", options.seed, 0, MAX_SEED)
    run_dir = existing_dir("run folder", Path(options.run_dir))
    corpus = existing_dir("--data-dir", Path(options.data_dir)) if options.data_dir is not None else None
    text, path = sample(
        run_dir,
        options.prompt,
        options.max_new_tokens,
        options.temperature,
        options.top_k or None,
        options.seed,
        corpus,
    )
    print(f"(sampled from {path})", file=sys.stderr)
    print(text)
    return 0


def sample(
    run_dir: Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    data_dir: Path | None = None,
) -> tuple[str, Path]:
    """(prompt + max_new_tokens sampled tokens decoded with the data's tokenizer, checkpoint used).

    data_dir: the prepared corpus whose tokenizer to use (default: the run's data.dir)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, ckpt = load_model(run_dir, device)
    tokenizer = data_tokenizer(ckpt, data_dir)
    vocab = model.cfg.vocab_size if isinstance(model, GPT) else model.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"the data's tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}")
    ids = tokenizer.encode(prompt) or tokenizer.encode("\n")  # the model needs one token to condition on
    torch.manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = continuation(model, idx, max_new_tokens, temperature, top_k)
    return tokenizer.decode(out[0].tolist()), ckpt.path
