"""The stop agreement: a request on one rank stops every rank one step later, at the same step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TESTS_DIR, run_ddptrain

from ddptrain.dist import DistContext
from ddptrain.train.agreement import StopAgreement

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_a_request_on_one_rank_is_agreed_by_all_one_poll_later(tmp_path: Path) -> None:
    done = run_ddptrain([str(TESTS_DIR / "agreement_worker.py"), str(tmp_path)], nproc=2, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):  # rank 1 saw the request at poll 4; everyone learns it at poll 5
        assert json.loads((tmp_path / f"agreement-rank{rank}.json").read_text()) == {"shared": 5, "own": 5}


def test_one_process_agrees_with_itself_at_once() -> None:
    agreement = StopAgreement(DistContext(), timeout_s=1)
    agreement.setup()
    assert [agreement.poll(requested=p >= 2) for p in range(4)] == [False, False, True, True]
