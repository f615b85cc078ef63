"""Property: any config or command-line override either validates into a Config that can train, or is a
one-line ConfigError (exit 2); never another exception, never a value that cannot train.

Volume runs through the in-process validation path; tests/dist/test_exit_codes.py trains a few
examples for real (in process and in subprocesses).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.config import Config, load_config
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
