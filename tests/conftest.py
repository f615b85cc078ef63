"""Shared fixtures: a tiny prepared corpus and a tiny model config, so every test runs in seconds."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from toys import TINY

# helpers (torch, ddptrain) is imported where a hook or fixture needs it, never here: pytest-xdist's controller
# loads this file too, and it runs no test; importing torch there took ~2.5 CPU-s from the workers' two cores.

# `make test` draws the same hypothesis examples on every run, so a failure it shows is there every time,
# never the luck of one draw; `make test-explore` (HYPOTHESIS_PROFILE=explore) draws new ones each run to
# find what the fixed ones miss: a case it finds becomes an @example of its test.
# No profile has a deadline: a deadline is a timing assertion, and on a busy 2-core machine it failed tests
# whose examples were correct (seen: a 358 ms example of test_schedules past the default 200 ms).
settings.register_profile("fixed", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

# The folder decides the marker, so `-m "not dist and not cluster"` selects exactly tests/unit even
# if a file forgets its `pytestmark` line (tests/unit/test_markers.py checks that none does).
FOLDER_MARKERS = {"dist": pytest.mark.dist, "cluster": pytest.mark.cluster}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test in tests/dist with `dist` and every test in tests/cluster with `cluster`."""
    from helpers import TESTS_DIR

    for item in items:
        folder = item.path.relative_to(TESTS_DIR).parts[0] if item.path.is_relative_to(TESTS_DIR) else ""
        if folder in FOLDER_MARKERS and item.get_closest_marker(folder) is None:
            item.add_marker(FOLDER_MARKERS[folder])
        if folder == "cluster" and item.path.stem.startswith("test_slurm"):
            item.add_marker(pytest.mark.xdist_group("cluster-slurm"))


# The SLURM tests run in order on one worker (xdist group "cluster-slurm"): every SLURM cluster leans on the
# machine's one munge daemon. The other multi-host tests spread over the workers like any test: each makes its
# own namespace hosts, with random names, on a bridge of its own, and shares its reference runs through the
# session's cache (helpers.cached_run), so two of them never meet.


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, refuse to run if the cluster tests did not get their group (see above)."""
    if not session.config.getoption("loadgroup", default=False):
        return
    ungrouped = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest-xdist did not group {ungrouped[0]} (and {len(ungrouped) - 1} more): cluster tests would run "
            "at once; install the pytest and pytest-xdist versions of the dev extra"
        )


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte corpus (a few standard-library modules), prepared once per session."""
    from helpers import prepare_tiny_corpus

    return prepare_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where helpers.cached_run keeps reference runs: one folder for the session, shared by pytest-xdist's
    workers (each has a base temp folder of its own under the session's)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference-runs"


@pytest.fixture
def tiny_args(corpus_dir: Path, tmp_path: Path) -> list[str]:
    """Overrides for a tiny GPT on the tiny corpus, writing into this test's tmp folder."""
    return [*TINY, f"data.dir={corpus_dir}", f"run.dir={tmp_path / 'run'}"]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connection to it is refused, and nobody else takes it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
