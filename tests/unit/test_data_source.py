"""data/source.py: one object per kind of data, which the run and the commands ask instead of branching."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY
from torch.utils.data import TensorDataset

import ddptrain
import ddptrain.data.corpus as corpus_module
from ddptrain.config import DataConfig, ModelConfig, load_config
from ddptrain.data.identity import datasets_identity
from ddptrain.data.kinds import KINDS, data_source
from ddptrain.data.source import (
    DEFAULT_DATA_DIR,
    DataSource,
    DefaultCorpus,
    LiveDatasets,
    PreparedCorpus,
    Sampling,
    UserFactory,
)
from ddptrain.errors import ConfigError, DataError
from ddptrain.models.gpt import GPT
from ddptrain.run_sources import record_sources

SHAPE = Sampling(block_size=32, global_batch=8, seed=0)

LIVE = (TensorDataset(torch.arange(12).reshape(6, 2)), None)


@pytest.mark.parametrize(
    ("data", "live", "kind"),
    [
        ({}, None, DefaultCorpus),
        ({"dir": "data/mine"}, None, PreparedCorpus),
        ({"target": "toy:build_datasets"}, None, UserFactory),
        ({"target": "toy:build_datasets", "live": "x:Y"}, None, UserFactory),  # a target rebuilds a live run
        ({"live": "x:Y"}, None, LiveDatasets),  # recorded, not given: nothing can rebuild it
        ({}, LIVE, LiveDatasets),
    ],
)
def test_the_first_kind_that_claims_the_config_is_its_source(
    data: dict[str, Any], live: Any, kind: type[DataSource]
) -> None:
    assert type(data_source(DataConfig(**data), live)) is kind
    assert KINDS[-1] is PreparedCorpus  # the fallback comes last: every config has a source


def test_a_prepared_corpus_answers_from_one_read_of_its_meta_json(
    corpus_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    real = corpus_module.read_meta_file
    monkeypatch.setattr(corpus_module, "read_meta_file", lambda d: reads.append(d) or real(d))
    source = data_source(DataConfig(dir=str(corpus_dir)))
    train, val = source.datasets(SHAPE)
    assert len(train) > len(val) > 0 and source.vocab_size() == 256 and source.pad_id() == 0
    assert source.identity(train, val)["bad_data"] is None
    assert source.resume_identity()["sha256"] == source.identity(train, val)["sha256"]
    assert source.tokenizer() is not None and source.tokenizer_dir() == corpus_dir
    assert reads == [corpus_dir]


def test_a_user_factory_and_live_datasets_know_no_tokenizer() -> None:
    factory = data_source(DataConfig(target="toy:build_datasets", kwargs={"n": 8, "dims": (2,)}))
    assert factory.vocab_size() is None and factory.tokenizer() is None and factory.tokenizer_dir() is None
    # As config.yaml holds them (JSON): a resume compares it with the manifest's list.
    assert factory.resume_identity() == {
        "source": "target",
        "target": "toy:build_datasets",
        "kwargs": {"n": 8, "dims": [2]},
    }
    live = data_source(DataConfig(live="torch.utils.data.dataset:TensorDataset"), LIVE)
    assert live.datasets(SHAPE) is LIVE and live.resume_identity() == {"source": "live"}
    assert live.identity(*LIVE) == datasets_identity(*LIVE)
    with pytest.raises(ConfigError, match="pass --data-dir DIR"):
        live.tokenizer_dir()


def test_a_recorded_live_source_says_which_keys_to_set() -> None:
    recorded = data_source(DataConfig(live="my:Data"))
    for ask in (recorded.check_can_build, lambda: recorded.split("val", SHAPE)):
        with pytest.raises(ConfigError, match=r"data.live='my:Data'.*add data.target=pkg.module:factory"):
            ask()
    with pytest.raises(ConfigError, match="whose tokenizer ddptrain does not know; pass --data-dir DIR"):
        recorded.tokenizer()


def test_a_missing_corpus_is_one_line_and_the_default_one_is_prepared_by_its_source(tmp_path: Path) -> None:
    missing = data_source(DataConfig(dir=str(tmp_path / "none")))
    with pytest.raises(DataError, match="no prepared corpus in"):
        missing.vocab_size()
    assert missing.tokenizer() is None  # generate reads a corpus that is gone as bytes
    assert missing.resume_identity() == {"source": "corpus", "sha256": None}
    assert DataConfig().dir == DEFAULT_DATA_DIR


def test_the_config_given_to_train_is_left_as_it_was_and_meta_json_read_once(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [*TINY, f"data.dir={corpus_dir}", f"run.dir={tmp_path / 'run'}", "train.max_steps=2"])
    before, fields = cfg.model_dump(), {name: set(getattr(cfg, name).model_fields_set) for name in ("model", "data")}
    live = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": str(tmp_path / "live")})})
    live_before = live.model_dump()

    reads: list[Path] = []
    real = corpus_module.read_meta_file
    monkeypatch.setattr(corpus_module, "read_meta_file", lambda d: reads.append(d) or real(d))
    assert ddptrain.train(cfg).step == 2  # the run fits the built-in GPT's vocabulary to the corpus's 256 ...
    assert reads == [corpus_dir]
    assert (
        ddptrain.train(live, datasets=PreparedCorpus(cfg.data).datasets(SHAPE)).step == 2
    )  # ... and records data.live
    assert cfg.model_dump() == before and live.model_dump() == live_before  # ... in configs of their own
    assert {name: set(getattr(cfg, name).model_fields_set) for name in ("model", "data")} == fields
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "vocab_size: 256" in saved and "torch" not in saved
    assert (
        "live: ddptrain.data.dataset:TokenDataset, ddptrain.data.dataset:TokenDataset"
        in (tmp_path / "live" / "config.yaml").read_text()
    )


class WiderGPT(GPT):
    """A user's model built on the built-in GPT: model.* cannot rebuild its extra parameters."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.extra = torch.nn.Linear(2, 2)


def test_recorded_sources_go_into_a_copy_and_only_the_gpt_itself_is_the_built_in_gpt() -> None:
    cfg = load_config(None, [])
    shape = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
    gpt, _, _ = record_sources(cfg, GPT(shape), LIVE)
    wider, _, _ = record_sources(cfg, WiderGPT(shape), None)
    assert (gpt.model.live, gpt.model.n_embd, gpt.data.live) == (None, 32, "torch.utils.data.dataset:TensorDataset")
    assert wider.model.live == f"{WiderGPT.__module__}:WiderGPT"
    assert cfg.model_dump() == load_config(None, []).model_dump()
