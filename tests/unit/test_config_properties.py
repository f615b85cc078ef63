"""Property: any config or command-line override either validates into a Config that can train, or is a
one-line ConfigError (exit 2); never another exception, never a value that cannot train.

Volume runs through the in-process validation path; tests/dist/test_exit_codes.py trains a few
examples for real (in process and in subprocesses).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.config import Config, config_from_mapping, load_config
from ddptrain.config_io import MAX_CONFIG_DEPTH, MAX_CONFIG_FILE_BYTES
from ddptrain.errors import ConfigError
from ddptrain.run import resolve_config

KEYS = [
    f"{section}.{f.alias or name}"
    for section, field in Config.model_fields.items()
    for name, f in field.annotation.model_fields.items()
]  # type: ignore[union-attr]

scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=1),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["fp32", "bf16", "fp16", "auto", "gloo", "skip", "stop"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=15), st.sampled_from(["train", "train.lr.x", "a.b.c"]))


@st.composite
def overrides(draw: st.DrawFn) -> str:
    """A dotted override as a user could type it: a known or garbage key, a YAML value or raw text."""
    key = draw(keys)
    if draw(st.booleans()):
        raw = yaml.safe_dump(draw(values), default_flow_style=True).strip().removesuffix("...").strip()
    else:
        raw = draw(st.text(max_size=20))
    return f"{key}={raw}" if draw(st.integers(0, 9)) else key  # now and then no '=' at all


def assert_can_train(cfg: Config) -> None:
    """What a validated Config promises: finite numbers, sane bounds, AdamW betas in [0, 1)."""

    def walk(value: Any) -> None:
        if isinstance(value, float):
            assert math.isfinite(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(cfg.model_dump(exclude={"model": {"kwargs"}, "data": {"kwargs"}}))
    assert cfg.train.lr > 0 and all(0 <= b < 1 for b in cfg.train.betas)
    assert type(cfg.train.max_steps) is int and 0 <= cfg.run.seed < 2**32


def assert_one_line(error: ConfigError) -> None:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text


@given(st.lists(overrides(), max_size=6))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_overrides_give_a_config_that_can_train_or_one_line(items: list[str]) -> None:
    try:
        cfg = resolve_config(None, items)
    except ConfigError as e:
        assert_one_line(e)
    else:
        assert_can_train(cfg)


@given(
    st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(str.encode),
        st.dictionaries(
            st.sampled_from(list(Config.model_fields)),
            st.dictionaries(st.sampled_from([k.split(".")[1] for k in KEYS]), values, max_size=3),
            max_size=3,
        ).map(lambda d: yaml.safe_dump(d).encode()),
    )
)
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
def test_any_config_file_gives_a_config_or_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    try:
        cfg = load_config(path)
    except ConfigError as e:
        assert_one_line(e)
    else:
        assert_can_train(cfg)


# Text as a hostile user types it: control characters, line and paragraph separators, '/', '.'.
hostile_text = st.text(st.one_of(st.characters(max_codepoint=0x9F), st.sampled_from("\u2028\u2029/.é😀")), max_size=12)
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
LINE_KEYS = ["run.dir", "data.dir", "ckpt.resume", "model.init_from", "log.tracker_run_name", "log.wandb.project"]


@given(st.sampled_from(["run.name", *LINE_KEYS]), hostile_text)
@settings(max_examples=300, deadline=None)
def test_names_and_paths_are_one_line_or_one_line_errors(key: str, value: str) -> None:
    *sections, name = key.split(".")
    mapping: dict[str, object] = {name: value}
    for section in reversed(sections):
        mapping = {section: mapping}
    try:
        cfg = config_from_mapping(mapping)
    except ConfigError as e:
        assert_one_line(e)
        assert key in str(e)
        assert CONTROL.search(value) or (key == "run.name" and (value in ("", ".", "..") or "/" in value))
    else:
        assert not CONTROL.search(value)
        if key == "run.name":  # exactly one folder under runs/
            assert cfg.run_dir.parent == Path("runs") and cfg.run_dir.name == value


@st.composite
def nestings(draw: st.DrawFn) -> tuple[Any, int]:
    """(a value nested in lists and mappings, its depth in collections)."""
    depth = draw(st.integers(0, 2 * MAX_CONFIG_DEPTH))
    value: Any = draw(scalars.filter(lambda v: not isinstance(v, float) or math.isfinite(v)))
    for kind in draw(st.lists(st.sampled_from(["list", "map"]), min_size=depth, max_size=depth)):
        value = [value] if kind == "list" else {"k": value}
    return value, depth


@given(nestings(), st.booleans())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_nesting_loads_exactly_up_to_the_depth_limit(tmp_path: Path, nesting: tuple[Any, int], as_file: bool) -> None:
    value, depth = nesting
    data = {"data": {"kwargs": {"k": value}}}  # 3 levels above k
    fits = 3 + depth <= MAX_CONFIG_DEPTH
    try:
        if as_file:
            path = tmp_path / "cfg.yaml"
            path.write_text(yaml.safe_dump(data))
            cfg = load_config(path)
        else:
            cfg = config_from_mapping(data)
    except ConfigError as e:
        assert_one_line(e)
        assert not fits and f"nests deeper than {MAX_CONFIG_DEPTH} levels" in str(e)
    else:
        assert fits and cfg.data.kwargs["k"] == value
        assert len(cfg.to_yaml()) < MAX_CONFIG_FILE_BYTES  # what loads, a run can store and load again
