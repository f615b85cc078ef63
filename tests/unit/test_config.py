"""Config: YAML + dotted overrides, validation messages, derived gradient accumulation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ddptrain.checkpoint import Checkpointer
from ddptrain.checkpoint.formats.rank0_torch import RankZeroTorchWriter
from ddptrain.checkpoint.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, ManifestError, parse_manifest
from ddptrain.config import CkptConfig, Config, config_from_mapping, load_config
from ddptrain.config_io import (
    MAX_CONFIG_CHARS,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_FILE_BYTES,
    MAX_CONFIG_JSON_BYTES,
    MAX_CONFIG_VALUES,
)
from ddptrain.dist import DistContext
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


# ---- bounds: what loads can be stored in a manifest and read back ------------------------------


def nested(depth: int, leaf: Any = 1) -> Any:
    """leaf inside `depth` lists (depth 0: the leaf itself)."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def test_depth_is_bounded_at_exactly_the_limit(tmp_path: Path) -> None:
    # The top mapping and data and kwargs are 3 levels: kwargs.k may add the rest, not one more.
    room = MAX_CONFIG_DEPTH - 3
    ok = {"data": {"kwargs": {"k": nested(room)}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(ok))
    assert load_config(path).data.kwargs["k"] == nested(room)
    assert config_from_mapping(ok).data.kwargs["k"] == nested(room)
    deeper = {"data": {"kwargs": {"k": nested(room + 1)}}}
    path.write_text(yaml.safe_dump(deeper))
    for load in (lambda: load_config(path), lambda: config_from_mapping(deeper)):
        with pytest.raises(ConfigError, match=f"nests deeper than {MAX_CONFIG_DEPTH} levels"):
            load()


def test_python_api_mappings_are_bounded_too() -> None:
    """A cyclic or shared structure handed to ddptrain.train(config=...) stops at the bounds, never expands."""
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    with pytest.raises(ConfigError, match="nests deeper than"):
        config_from_mapping({"data": {"kwargs": cyclic}})
    shared: list[Any] = ["x" * 10]
    for _ in range(20):  # 2**21 values reached through 20 levels of shared lists
        shared = [shared, shared]
    with pytest.raises(ConfigError, match="more than"):
        config_from_mapping({"data": {"kwargs": {"k": shared}}})


def widest_config(char: str) -> dict[str, Any]:
    """A config at the bounds, shaped for the largest files: every value at the deepest level, its text in
    `char`, each as long as an escape can make it (12 bytes in JSON for an astral one, 6 in YAML for U+FFFE)."""
    leaf = char * 200
    values = MAX_CONFIG_VALUES - 300  # room for the path down and the sections (YAML counts keys and values)
    texts = (MAX_CONFIG_CHARS - values - 2000) // len(leaf)  # each 0 counts as a character too
    deep = nested(MAX_CONFIG_DEPTH - 5, [leaf] * texts + [0] * (values - texts - MAX_CONFIG_DEPTH))
    return {"data": {"kwargs": {"k": deep}}}


def test_the_largest_config_within_the_bounds_fits_a_manifest() -> None:
    cfg = config_from_mapping(widest_config("\U0001f600"))
    config = cfg.model_dump(mode="json", by_alias=True)
    files = {f"rng-rank{r}.pt": FileEntry("0" * 64, 1) for r in range(1024)}
    data = Manifest(1, 1024, "t", "sharded", 0.0, files, config, {}).to_bytes()
    assert len(data) < MAX_CONFIG_JSON_BYTES < MAX_MANIFEST_BYTES // 4
    assert parse_manifest(data).config == config


def test_the_largest_config_within_the_bounds_loads_again_from_its_config_yaml(tmp_path: Path) -> None:
    cfg = config_from_mapping(widest_config("\ufffe"))  # the longest YAML escape per character (~2.7 MB)
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    assert path.stat().st_size < MAX_CONFIG_FILE_BYTES
    assert load_config(path) == cfg


def test_a_manifest_past_the_readers_limit_is_never_written() -> None:
    config = {"data": {"kwargs": {"k": "x" * MAX_MANIFEST_BYTES}}}  # past config_io's bounds: never loaded
    with pytest.raises(ManifestError, match="more than 67,108,864"):
        Manifest(1, 1, "t", "sharded", 0.0, {}, config, {}).to_bytes()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("run.name", "", "must name one folder under runs/"),
        ("run.name", ".", "must name one folder under runs/"),
        ("run.name", "a" * 256, "at most 255 bytes"),
        ("run.name", "a\x1bb", "found '\\x1b'"),
        ("run.name", "a\x85b", "found '\\x85'"),
        ("log.tracker_run_name", "a\nb", "log.tracker_run_name: must be one line"),
        ("model.hf.pretrained", "a\x00b", "model.hf.pretrained: must be one line"),
    ],
)
def test_names_and_paths_are_one_line(key: str, value: str, message: str) -> None:
    section, *rest = key.split(".")
    data: dict[str, Any] = {section: {}}
    node = data[section]
    for part in rest[:-1]:
        node = node.setdefault(part, {})
    node[rest[-1]] = value
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        config_from_mapping(data)
    assert "\n" not in str(e.value)


def test_a_run_name_is_one_folder_under_runs() -> None:
    for name in ("x", "Big_Run!", "a b", "ümlaut", "a..b", "-x"):
        assert config_from_mapping({"run": {"name": name}}).run_dir == Path("runs") / name


def test_a_save_whose_manifest_would_be_unreadable_fails_and_commits_nothing(tmp_path: Path) -> None:
    config = {"data": {"kwargs": {"k": "x" * MAX_MANIFEST_BYTES}}}  # only a caller past config_io can make one
    checkpointer = Checkpointer(CkptConfig(), tmp_path, DistContext(), config, writer=RankZeroTorchWriter())
    checkpointer.setup()
    checkpointer.save(1, {"model": {"w": torch.zeros(2)}, "trainer": {"step": 1}}, {})
    [result] = checkpointer.finished()
    assert not result.ok and "manifest.json would take" in str(result.error), result
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no step folder, no temp folder
