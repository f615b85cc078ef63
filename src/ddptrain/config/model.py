"""The model section: the built-in GPT, a user model (model.target) or a transformers model (model.hf)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ddptrain.config.base import LineText, Section


class HFModelConfig(Section):
    config: str | dict[str, Any] | None = Field(
        None,
        description="A local folder holding config.json, or an inline mapping of config fields including model_type (e.g. llama).",
    )
    pretrained: LineText | None = Field(
        None, description="A local folder written by save_pretrained: build the model from it and load its weights."
    )

    @model_validator(mode="after")
    def _one_source(self) -> HFModelConfig:
        if (self.config is None) == (self.pretrained is None):
            raise ValueError("model.hf needs exactly one of config (folder or mapping) and pretrained (folder)")
        if isinstance(self.config, dict) and not isinstance(self.config.get("model_type"), str):
            raise ValueError("model.hf.config as a mapping needs model_type (e.g. llama, gpt2, gpt_neox)")
        return self


class AdapterConfig(Section):
    type: Literal["lora"] = Field(
        "lora", description="The adapter kind: lora (low-rank updates of the targeted layers)."
    )
    r: int = Field(8, ge=1, le=4096, description="LoRA rank: the inner width of each low-rank update.")
    alpha: int = Field(16, ge=1, le=1 << 20, description="LoRA scaling numerator: updates are scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' inputs.")
    target_modules: list[LineText] | None = Field(
        None,
        description="Names (or name suffixes) of the layers to adapt, e.g. [q_proj, v_proj]; None: peft's default "
        "for the transformers model type (the built-in GPT and user models need a list, e.g. [c_attn]).",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and (not names or not all(n.strip() for n in names)):
            raise ValueError("model.peft.target_modules needs at least one non-empty layer name (or null)")
        return names


class ModelConfig(Section):
    hf: HFModelConfig | None = Field(
        None,
        description="A Hugging Face transformers causal LM (needs the hf extra); None uses target or the built-in GPT.",
    )
    peft: AdapterConfig | None = Field(
        None,
        description="Train adapters (LoRA through peft) on a frozen model: {type: lora, r, alpha, dropout, "
        "target_modules}; checkpoints hold the adapters only. None trains every parameter.",
    )
    init_from: LineText | None = Field(
        None,
        description="Start from these weights (a run or checkpoint folder, an exported .safetensors, an HF folder): fresh optimizer, step 0. A run folder's own checkpoints win; with model.peft these are the frozen base, loaded at every start.",
    )
    target: str | None = Field(
        None, description="'pkg.module:factory' building your own nn.Module; None uses the built-in GPT."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the model factory given by target."
    )
    live: str | None = Field(
        None,
        description="Written by ddptrain.train() when given a live nn.Module (its class): commands that rebuild the model (eval, export --format hf) then need model.target. Leave unset.",
    )
    n_layer: int = Field(4, ge=1, description="Built-in GPT: transformer blocks.")
    n_head: int = Field(4, ge=1, description="Built-in GPT: attention heads per block.")
    n_embd: int = Field(128, ge=8, description="Built-in GPT: embedding width; must divide by n_head.")
    block_size: int = Field(
        128,
        ge=2,
        description="Context length in tokens (bytes for the default corpus); also the sample length for model.hf and data.dir.",
    )
    vocab_size: int = Field(
        256, ge=2, description="Built-in GPT: vocabulary size; when not set, the prepared data's (256 for bytes)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Built-in GPT: dropout probability.")
    bias: bool = Field(False, description="Built-in GPT: biases in Linear and LayerNorm layers.")
    shard_units: list[str] = Field(
        default_factory=list,
        description="dist.strategy fsdp/hsdp: class names of the submodules sharded as one unit each (e.g. your transformer block); the built-in GPT and HF models need none.",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.target is not None and self.hf is not None:
            raise ValueError("set model.target or model.hf, not both")
        if self.target is None and self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        return self
