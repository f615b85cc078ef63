"""Hugging Face `transformers` causal LMs as a model source (`model.hf`), built offline.

The model comes from transformers' Auto classes: from a config (a local folder with config.json,
or an inline mapping with model_type) with fresh weights, or from a local `save_pretrained`
folder with its weights. Nothing touches the network: the hub is switched to offline mode and
every load is local_files_only.

`HFCausalLM` adapts it to the trainer's batches: (inputs, targets) windows of the token corpus,
targets already shifted by one, so the loss is plain cross-entropy over every position (the
model's own `labels` path would shift again and drop one position per window); or a padded batch
(data.collate=pad) whose labels it shifts itself, padding ignored.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddptrain.config import HFModelConfig
from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.data.tokenizer import require_hf
from ddptrain.errors import ConfigError
from ddptrain.ft_env import REPLICA_GROUP_ENV
from ddptrain.models.gpt import shifted_pair


class HFCausalLM(nn.Module):
    """forward(idx, targets) -> mean cross-entropy of a transformers causal LM held as `.hf`."""

    def __init__(self, hf: Any, block_size: int) -> None:
        super().__init__()
        self.hf: Any = hf  # a transformers PreTrainedModel (untyped here: transformers is optional)
        self.block_size = block_size

    @property
    def text_config(self) -> Any:
        """The (text part of the) transformers config."""
        config: Any = self.hf.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: the largest token id + 1 the model can predict."""
        return int(self.hf.get_output_embeddings().weight.shape[0])

    def logits(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits for every position of idx (B, T)."""
        logits: torch.Tensor = self.hf(input_ids=idx, attention_mask=attention_mask, use_cache=False).logits
        return logits

    def forward(
        self,
        idx: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not IGNORE_INDEX: of (idx, targets) windows, or of a
        padded batch (data.collate=pad) whose labels are aligned with input_ids and shifted here, as the
        built-in GPT does; the attention mask goes to the transformers model."""
        idx, targets = shifted_pair(idx, targets, input_ids, labels, self.block_size)
        mask = attention_mask[:, : idx.shape[1]] if attention_mask is not None else None
        logits = self.logits(idx, mask)
        flat = logits.float().view(-1, logits.size(-1))
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N (N without input/position embeddings) plus attention 12*L*H*T."""
        output = self.hf.get_output_embeddings().weight
        lookups = {id(m.weight) for m in self.hf.modules() if isinstance(m, nn.Embedding)} - {id(output)}
        n = sum(p.numel() for p in self.hf.parameters() if id(p) not in lookups)
        c = self.text_config
        return float(6 * n + 12 * c.num_hidden_layers * c.hidden_size * self.block_size)


def _offline() -> None:
    # Set before transformers reads them: any attempt to reach the hub fails at once instead of hanging.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _one_progress_bar() -> None:
    """transformers' "Loading weights" bar on the job's first process only (rank 0, of the first in-place group),
    not once per rank on one console."""
    first = os.environ.get("RANK", "0") == "0" and os.environ.get(REPLICA_GROUP_ENV, "0") == "0"
    if not first:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _local_folder(path: str, key: str, needs: str) -> Path:
    folder = Path(path)
    if not (folder / needs).is_file():
        raise ConfigError(f"{key}={path!r}: no {needs} there (a local folder is needed; nothing is downloaded)")
    return folder


def check_hf_config(cfg: HFModelConfig) -> None:
    """ConfigError, before a run writes anything, for a model_type transformers does not know (naming the closest
    few) and for a key of an inline model.hf.config its config class does not define. Checked when a run starts,
    not when eval or export rebuild a trained model: a key transformers ignored then changes nothing now."""
    _check_model_types(cfg)
    if isinstance(cfg.config, dict):
        from transformers import AutoConfig

        fields = dict(cfg.config)
        try:
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"model.hf: transformers cannot build this model: {_first_line(e)}") from None
        _check_config_keys(config, fields)


def _check_model_types(cfg: HFModelConfig) -> None:
    """The model_type of model.hf (inline, or in its folder's config.json) checked against transformers' list."""
    require_hf("model.hf")
    _offline()
    if cfg.pretrained is not None:
        _check_model_type(_folder_model_type(Path(cfg.pretrained)), "model.hf.pretrained")
    elif isinstance(cfg.config, dict):
        _check_model_type(cfg.config.get("model_type"), "model.hf.config.model_type")
    elif cfg.config is not None:
        _check_model_type(_folder_model_type(Path(cfg.config)), "model.hf.config")


def build_hf_model(cfg: HFModelConfig, block_size: int) -> HFCausalLM:
    """The transformers model named by model.hf, wrapped for the trainer."""
    _check_model_types(cfg)
    _one_progress_bar()
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if cfg.pretrained is not None:
            folder = _local_folder(cfg.pretrained, "model.hf.pretrained", "config.json")
            model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        elif isinstance(cfg.config, dict):
            fields = dict(cfg.config)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            model = AutoModelForCausalLM.from_config(config)
        else:
            assert cfg.config is not None
            folder = _local_folder(cfg.config, "model.hf.config", "config.json")
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, local_files_only=True))
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise ConfigError(f"model.hf: transformers cannot build this model: {_first_line(e)}") from None
    wrapped = HFCausalLM(model, block_size)
    limit = getattr(wrapped.text_config, "max_position_embeddings", None)
    if limit is not None and block_size > limit:
        raise ConfigError(f"model.block_size={block_size} exceeds the model's max_position_embeddings={limit}")
    return wrapped


def _first_line(error: Exception, limit: int = 300) -> str:
    """An error's first line, at most limit characters (transformers' can list every model type it knows)."""
    text = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _folder_model_type(folder: Path) -> object:
    """The model_type in a folder's config.json (None when it cannot be read: transformers then says why)."""
    try:
        found = json.loads((folder / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return found.get("model_type") if isinstance(found, dict) else None


def _check_model_type(model_type: object, key: str) -> None:
    """ConfigError naming the closest few model types transformers knows when model_type is not one of them (its
    own message lists all of them: a line of 12,000 characters)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING:
        return
    known = list(CONFIG_MAPPING.keys())
    close = difflib.get_close_matches(model_type, known, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "e.g. llama, mistral, qwen2, gpt2, gpt_neox"
    raise ConfigError(
        f"{key}: model_type {model_type!r} is not one of the {len(known)} transformers "
        f"{transformers.__version__} knows; {hint}"
    )


def _check_config_keys(config: Any, fields: dict[str, Any]) -> None:
    """ConfigError for a key of an inline model.hf.config that the config class does not define, which transformers
    would store as given and every model ignore (`num_hiden_layers`), naming the closest settings it has.

    A key counts as defined when a default config of the class has it, it is a name the class maps to another
    (attribute_map, e.g. gpt2's hidden_size), or transformers consumed it (rope_theta into rope_parameters)."""
    try:
        defined = set(type(config)().to_dict()) | set(getattr(config, "attribute_map", {}))
    except (ValueError, TypeError, KeyError, AttributeError):  # no defaults for everything: nothing to compare
        return
    stored = config.to_dict()
    for key in sorted(fields):
        if key in stored and key not in defined:
            close = difflib.get_close_matches(key, sorted(defined - {"transformers_version"}), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"model.hf.config.{key}: {type(config).__name__} has no such setting (transformers would keep it "
                f"and the model ignore it); {hint}(a key your model reads that its config class does not define: "
                "give model.hf.config as a folder with config.json, which is not checked)"
            )
