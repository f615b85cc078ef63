"""The registries (config/kinds.py) are the one declaration of each name a config picks from: a checkpoint
format, a checksum, a tracker, an LR schedule. The config accepts exactly their names, a wrong one
stops `ddptrain train` with exit 2 and one line listing every choice (and nothing written), the help
lists each with what it is, and old flat tracker keys name their new place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import one_line_exit_2
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.config import config_from_mapping, describe_fields, load_config, saved_config
from ddptrain.config.kinds import FORMATS, HASHES, SCHEDULES, TRACKERS
from ddptrain.config.registry import Registry
from ddptrain.config.system import RENAMED
from ddptrain.errors import ConfigError

REGISTRIES: list[tuple[str, Registry, str]] = [  # key, registry, how an override gives a value
    ("ckpt.format", FORMATS, "{}"),
    ("ckpt.hash", HASHES, "{}"),
    ("log.trackers", TRACKERS, "[{}]"),
    ("schedule.name", SCHEDULES, "{}"),
]
# Any short name, the registered ones among them.
names = st.one_of(
    st.sampled_from([n for _, r, _ in REGISTRIES for n in r.choices]),
    st.text(st.characters(codec="ascii", categories=("L", "N", "Pd")), min_size=1, max_size=12),
)


@pytest.mark.parametrize(("key", "registry", "shape"), REGISTRIES, ids=[k for k, _, _ in REGISTRIES])
def test_a_wrong_name_exits_2_with_every_choice_listed(
    key: str, registry: Registry, shape: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line_exit_2(["train", f"run.dir={tmp_path / 'run'}", f"{key}={shape.format('nope')}"], capsys)
    assert key in line and f"'nope' is not {registry.what}: pick one of {', '.join(registry.choices)}" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("key", "registry", "shape"), REGISTRIES, ids=[k for k, _, _ in REGISTRIES])
@given(name=names)
def test_the_config_takes_exactly_the_registered_names(key: str, registry: Registry, shape: str, name: str) -> None:
    section, field = key.split(".")
    try:
        config_from_mapping({section: {field: [name] if shape == "[{}]" else name}})
    except ConfigError as e:
        assert name not in registry.choices and "\n" not in str(e) and ", ".join(registry.choices) in str(e)
    else:
        assert name in registry.choices


def test_the_help_lists_each_choice_with_what_it_is() -> None:
    help_text = describe_fields()
    for _, registry, _ in REGISTRIES:
        assert registry.explained() in help_text
        assert all(f"{name} ({registry[name].about})" in help_text for name in registry)


def test_each_default_is_a_choice_and_each_implementation_loads() -> None:
    cfg = load_config(None)
    defaults = {"ckpt.format": cfg.ckpt.format, "ckpt.hash": cfg.ckpt.hash, "schedule.name": cfg.schedule.name}
    for key, registry, _ in REGISTRIES:
        assert key not in defaults or defaults[key] in registry.choices
        for name in registry:
            assert registry.load(name) is not None and registry.name_of(registry[name].target) == name


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_tracker_key_names_its_new_place(old: str) -> None:
    with pytest.raises(ConfigError, match=rf"^invalid config: log: log\.{old} is now log\.{RENAMED[old]}$"):
        load_config(None, [f"log.{old}=x"])
    section, key = RENAMED[old].split(".")
    value = "offline" if key == "mode" else "x"
    assert getattr(getattr(load_config(None, [f"log.{RENAMED[old]}={value}"]).log, section), key) == value


def test_a_config_an_earlier_version_recorded_reads_its_tracker_keys_in_their_new_place() -> None:
    """Earlier versions wrote every log key into config.yaml and manifests: null ones mean the defaults still (in
    a user's config too), and a recorded value is read where its key is now."""
    old = {"mlflow_tracking_uri": "http://mlflow:5000", "mlflow_experiment": None, "wandb_mode": "offline"}
    assert load_config(None, ["log.mlflow_experiment=null"]).log.mlflow.experiment is None
    with pytest.raises(ConfigError, match="log.mlflow_tracking_uri is now log.mlflow.tracking_uri, log.wandb_mode"):
        config_from_mapping({"log": old})
    log = saved_config({"log": {**old, "wandb": {"project": "p"}}}).log
    assert (log.mlflow.tracking_uri, log.mlflow.experiment, log.wandb.mode, log.wandb.project) == (
        "http://mlflow:5000",
        None,
        "offline",
        "p",
    )
