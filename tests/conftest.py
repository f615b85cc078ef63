"""Shared fixtures: a tiny prepared corpus and a tiny model config, so every test runs in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TINY, prepare_tiny_corpus


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte corpus (a few standard-library modules), prepared once per session."""
    return prepare_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def tiny_args(corpus_dir: Path, tmp_path: Path) -> list[str]:
    """Overrides for a tiny GPT on the tiny corpus, writing into this test's tmp folder."""
    return [*TINY, f"data.dir={corpus_dir}", f"run.dir={tmp_path / 'run'}"]
