"""Run-folder entries replaced by a link, a FIFO, a folder or a regular file, against the writers and readers directly.

Every call runs in a thread joined with a timeout: a FIFO opened without O_NONBLOCK would block
forever, and must fail the test instead of hanging it. The victims (a file and a folder outside the
run) must keep every byte whatever the writer did.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.errors import UserError
from ddptrain.observe import forensics
from ddptrain.observe.certificate import CertificateWriter, read_certificate
from ddptrain.observe.metrics import MetricsWriter
from ddptrain.observe.trackers.state import TrackerState
from ddptrain.review.verdict import FORENSICS, verdict
from ddptrain.safe_files import (
    check_regular_or_absent,
    ensure_dir,
    open_append_no_follow,
    read_regular_file,
    write_bytes_replace,
)
from ddptrain.train.replicas import write_forensics

KINDS = ["absent", "file", "folder", "fifo", "link to file", "link to folder", "dangling link"]
# Every name a run, a failed step or a report writes (the stacks and report files one folder down).
ENTRIES = [
    "metrics.jsonl",
    "certificate.jsonl",
    "config.yaml",
    "trackers.json",
    ".lease",
    "logs/rank-0.log",
    "stacks/rank-0-host.txt",
    "stacks/rank-0-host.json",
    "report/summary.txt",
    "report/loss.png",
]
PRECIOUS = b"precious bytes\n"


@contextmanager
def run_folder() -> Iterator[tuple[Path, Path]]:
    """(run folder, victims folder): victim.txt and victim-dir/precious.txt outside the run."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        victims = root / "victims"
        (victims / "victim-dir").mkdir(parents=True)
        (victims / "victim.txt").write_bytes(PRECIOUS)
        (victims / "victim-dir" / "precious.txt").write_bytes(PRECIOUS)
        (root / "run").mkdir()
        yield root / "run", victims
        assert (victims / "victim.txt").read_bytes() == PRECIOUS
        assert [p.name for p in (victims / "victim-dir").iterdir()] == ["precious.txt"]
        assert (victims / "victim-dir" / "precious.txt").read_bytes() == PRECIOUS


def make(path: Path, kind: str, victims: Path) -> None:
    """Put an entry of that kind at path (its folder created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        path.write_bytes(b"the run's own line\n")
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind != "absent":
        target = {"link to file": "victim.txt", "link to folder": "victim-dir", "dangling link": "gone"}[kind]
        path.symlink_to(victims / target)


def bounded(call: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """call() in a thread; its result, or the exception it raised; fails (never hangs) when it blocks."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as e:  # handed to the test, which asserts on it
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "blocked (a FIFO opened without O_NONBLOCK?)"
    return box[0]


def append(path: Path) -> None:
    with open_append_no_follow(path) as f:
        f.write("appended\n")


@settings(max_examples=120, deadline=None)
@given(entry=st.sampled_from(ENTRIES), kind=st.sampled_from(KINDS), how=st.sampled_from(["append", "replace", "read"]))
def test_an_entry_of_any_kind_is_written_only_when_it_is_the_runs_own(entry: str, kind: str, how: str) -> None:
    with run_folder() as (run, victims):
        path = run / entry
        make(path, kind, victims)
        op = {
            "append": lambda: append(path),
            "replace": lambda: write_bytes_replace(path, b"new\n"),
            "read": lambda: read_regular_file(path),
        }[how]
        result = bounded(op)
        if how == "append":  # the appended files: refused unless absent or a regular file
            assert isinstance(result, OSError) == (kind not in ("absent", "file")), result
            if kind in ("absent", "file"):
                assert path.read_bytes().endswith(b"appended\n")
        elif how == "replace":  # the rewritten files: whatever has the name is replaced (a folder refused)
            assert isinstance(result, OSError) == (kind == "folder"), result
            if kind != "folder":
                assert not path.is_symlink() and path.read_bytes() == b"new\n"
            assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
        else:  # the readers: a regular file's bytes, anything else refused
            assert isinstance(result, OSError) == (kind != "file"), result
        check = bounded(lambda: check_regular_or_absent(path))
        assert check is None or isinstance(check, OSError)


@settings(max_examples=80, deadline=None)
@given(depth=st.integers(1, 3), at=st.integers(0, 2), kind=st.sampled_from(KINDS))
def test_ensure_dir_refuses_anything_but_a_folder_at_any_level_below_the_run(depth: int, at: int, kind: str) -> None:
    with run_folder() as (run, victims):
        parts = ["report", "a", "b"][:depth]
        at = min(at, depth - 1)
        make(run.joinpath(*parts[: at + 1]), kind, victims)
        result = bounded(lambda: ensure_dir(run.joinpath(*parts), run))
        assert isinstance(result, OSError) == (kind not in ("absent", "folder")), result
        if result is None:
            assert run.joinpath(*parts).is_dir()


@pytest.mark.parametrize("kind", KINDS)
def test_the_metrics_and_certificate_writers_refuse_anything_but_their_own_file(kind: str) -> None:
    with run_folder() as (run, victims):
        for name, writer in (("metrics.jsonl", MetricsWriter), ("certificate.jsonl", CertificateWriter)):
            make(run / name, kind, victims)
            result = bounded(lambda w=writer: w(run, True))  # type: ignore[misc]
            if kind in ("absent", "file"):
                assert not isinstance(result, BaseException), result
                result.close()
            else:
                assert isinstance(result, UserError) and str(run / name) in str(result), result


@pytest.mark.parametrize("kind", KINDS)
def test_tracker_state_is_replaced_or_refused_never_followed(kind: str) -> None:
    with run_folder() as (run, victims):
        make(run / "trackers.json", kind, victims)
        if kind == "file":
            (run / "trackers.json").write_text("{}")
        state = bounded(lambda: TrackerState(run, fresh=True))
        result = bounded(lambda: state.set_run_id("tensorboard", "abc"))
        assert isinstance(result, OSError) == (kind == "folder"), result
        if kind != "folder":
            assert not (run / "trackers.json").is_symlink() and "abc" in (run / "trackers.json").read_text()
        if kind not in ("absent", "file"):  # reading it back at a resume: refused in one line, never waited on
            if kind != "folder":
                make_again = run / "trackers.json"
                make_again.unlink()
                make(make_again, kind, victims)
            refused = bounded(lambda: TrackerState(run))
            assert isinstance(refused, UserError) and "trackers.json" in str(refused), refused


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        ("stacks", "link to folder"),
        ("stacks", "file"),
        ("stacks/rank-0-host.txt", "link to file"),
        ("stacks/rank-0-host.txt", "fifo"),
        ("stacks/rank-0-host.json", "link to file"),
        (f"stacks/{FORENSICS}", "link to file"),
    ],
)
def test_hang_and_divergence_forensics_never_write_through_a_planted_entry(entry: str, kind: str) -> None:
    with run_folder() as (run, victims):
        make(run / entry, kind, victims)
        own = bounded(lambda: forensics.write_own(run / "stacks", 0, "host", None, None, {"step": 1}, native=False))
        write_forensics(run / "stacks", {"event": "replica_divergence", "step": 1})  # a failure here is a warning
        if entry.endswith(".json"):  # rewritten whole: the link is replaced by the report
            assert own == run / "stacks" / "rank-0-host.json" and not (run / entry).is_symlink()
            assert (run / entry).read_text().startswith("{")
        else:
            assert isinstance(own, OSError), own


@pytest.mark.parametrize("kind", ["fifo", "link to file"])
def test_triage_and_verify_resume_readers_never_wait_on_a_fifo(kind: str) -> None:
    with run_folder() as (run, victims):
        (victims / "victim.txt").write_bytes(PRECIOUS)
        for name in ("rank-0-host.json", FORENSICS):
            make(run / "stacks" / name, kind, victims)
        refused = bounded(lambda: verdict(run / "stacks"))
        assert isinstance(refused, UserError) and "no hang reports" in str(refused), refused
        make(run / "certificate.jsonl", kind, victims)
        read = bounded(lambda: read_certificate(run / "certificate.jsonl"))
        assert isinstance(read, OSError) if kind == "fifo" else read == {}, read
