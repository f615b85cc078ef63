"""Config: YAML + dotted overrides, validation messages, derived gradient accumulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddptrain.config import Config, load_config
from ddptrain.errors import ConfigError


def test_defaults_are_valid_and_round_trip(tmp_path: Path) -> None:
    cfg = load_config()
    assert cfg.run_dir == Path("runs/default")
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_yaml_then_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_steps": 50, "lr": 0.01}, "run": {"name": "x"}}))
    cfg = load_config(
        path, ["train.max_steps=100", "data.micro_batch_size=8", "ckpt.async=true", "train.betas=[0.8, 0.9]"]
    )
    assert cfg.train.max_steps == 100
    assert cfg.train.lr == 0.01
    assert cfg.data.micro_batch_size == 8
    assert cfg.ckpt.async_save is True
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.run_dir == Path("runs/x")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_stepz=3"], "unknown key 'train.max_stepz'"),
        (["bogus.key=3"], "unknown key 'bogus'"),
        (["train.max_steps=many"], "train.max_steps"),
        (["train.max_steps=0"], "train.max_steps"),
        (["train.precision=fp8"], "train.precision"),
        (["dist.backend=mpi"], "dist.backend"),
        (["model.n_embd=30", "model.n_head=4"], "divisible by model.n_head"),
        (["train.max_steps"], "must look like section.key=value"),
        (["max_steps=3"], "must be dotted"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_grad_accumulation_is_derived_and_checked() -> None:
    cfg = Config.model_validate({"train": {"global_batch_size": 32}, "data": {"micro_batch_size": 4}})
    assert cfg.grad_accum_steps(1) == 8
    assert cfg.grad_accum_steps(2) == 4
    assert cfg.grad_accum_steps(8) == 1
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.grad_accum_steps(3)


def test_exponent_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    """YAML 1.1 reads `3e-4` as a string; strict validation would refuse it, so the loader reads a number."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  weight_decay: 5E-2\n")
    cfg = load_config(path, ["train.min_lr_ratio=1e-2"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.min_lr_ratio) == (1e-3, 5e-2, 1e-2)
