"""Logging on a full disk says so once; warnings and errors on stderr; the data identity that every rank
compares at start."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from ddptrain.data.identity import agree_on_data, check_same_data, corpus_identity, datasets_identity
from ddptrain.dist import DistContext
from ddptrain.errors import DataError
from ddptrain.observe.metrics import MetricsWriter
from ddptrain.observe.runlog import PACKAGE_LOG, ConsoleHandler, RankFileHandler

FULL = Path("/dev/full")  # every write fails with ENOSPC


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")
def test_a_full_disk_while_logging_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handler = RankFileHandler(tmp_path / "rank-0.log")  # a device in the run folder is refused: swap it in after
    handler.stream.close()
    handler.stream = open(FULL, "a")  # noqa: SIM115 - the handler closes it
    handler.baseFilename = str(FULL)
    PACKAGE_LOG.addHandler(handler)
    try:
        for i in range(150):
            logging.getLogger("ddptrain.tests").info("record %d", i)
    finally:
        PACKAGE_LOG.removeHandler(handler)
        handler.setLevel(logging.NOTSET)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "warning: cannot write the log to /dev/full (No space left on device); logging there stops"
    ]


def test_the_console_puts_progress_on_stdout_and_warnings_and_errors_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    handler = ConsoleHandler()
    PACKAGE_LOG.addHandler(handler)
    try:
        log = logging.getLogger("ddptrain.tests")
        log.info("step 1")
        log.warning("checkpoint rejected: step-00000006: a reason; trying an older one")
        log.error("checkpoint at step 6 was not committed: a reason; earlier checkpoints are kept")
    finally:
        PACKAGE_LOG.removeHandler(handler)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 1"]  # a run that exits 1 says why on stderr, never only on stdout
    assert err.splitlines() == [
        "warning: checkpoint rejected: step-00000006: a reason; trying an older one",
        "error: checkpoint at step 6 was not committed: a reason; earlier checkpoints are kept",
    ]


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")
def test_a_full_disk_while_writing_metrics_is_one_warning(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, enabled=True)
    assert writer._file is not None
    writer._file.close()
    writer._file = open(FULL, "a", buffering=1)  # the same sink on a disk with no space left
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    PACKAGE_LOG.addHandler(handler)
    try:
        for step in range(50):
            writer.write("train", step=step, loss=1.0)
    finally:
        PACKAGE_LOG.removeHandler(handler)
    writer.close()
    warnings = [r.getMessage() for r in seen if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings


class Augmented(Dataset):
    """Samples with random augmentation drawn from the global torch RNG, as user datasets often do."""

    def __init__(self, n: int, offset: float = 0.0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3,), float(i) + self.offset) + torch.rand(3), "y": torch.tensor(i % 2)}


def test_held_metrics_reach_the_file_only_once_accepted_with_their_own_times(tmp_path: Path) -> None:
    """An in-place group holds its records until its first quorum admits it: refused, it leaves the file as it was."""
    refused = MetricsWriter(tmp_path, enabled=True)
    refused.hold()
    refused.write("event", event="start", step=0)
    refused.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    admitted = MetricsWriter(tmp_path, enabled=True)
    admitted.hold()
    admitted.write("event", event="start", step=0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    admitted.accept()
    admitted.write("train", step=1)
    admitted.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r["kind"]) for r in lines] == ["start", "train"] and lines[0]["time"] <= lines[1]["time"]


def test_datasets_identity_is_reproducible_and_leaves_the_random_streams_alone() -> None:
    torch.manual_seed(0)
    random.seed(0)
    before = torch.get_rng_state(), random.getstate()
    a = datasets_identity(Augmented(10), Augmented(4), "pkg:data")
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    torch.manual_seed(0)
    assert datasets_identity(Augmented(10), Augmented(4), "pkg:data") == a  # same seed: same fingerprint
    torch.manual_seed(0)
    assert datasets_identity(Augmented(10, offset=1.0), Augmented(4), "pkg:data")["fingerprint"] != a["fingerprint"]
    assert datasets_identity(Augmented(11), None)["train_len"] == 11


def test_corpus_identity_names_hash_sizes_and_tokenizer(corpus_dir: Path) -> None:
    identity = corpus_identity(corpus_dir)
    assert len(identity["sha256"]) == 64 and identity["train_tokens"] > 0 and identity["tokenizer"] == "bytes/uint8"
    agree_on_data(DistContext(), identity)  # one process always agrees with itself


def test_disagreement_names_ranks_hosts_and_keys() -> None:
    """The comparison every rank runs on the gathered identities (the collective: tests/dist/test_exit_codes.py)."""
    gathered = [
        {"sha256": "aaa", "train_tokens": 10},
        {"sha256": "aaa", "train_tokens": 10},
        {"sha256": "bbb", "train_tokens": 10},
    ]
    with pytest.raises(DataError, match=r"sha256: 'aaa' on rank 0 \(node-a\) vs 'bbb' on rank 2 \(node-c\)"):
        check_same_data(gathered, ("node-a", "node-b", "node-c"))
    check_same_data(gathered[:2], ("node-a", "node-b"))
