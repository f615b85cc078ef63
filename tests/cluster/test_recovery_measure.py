"""Recovery time, measured (`make test-measure`; minutes): exec'd vs preloaded workers, interleaved.

The SIGKILL scenario of test_multinode_faults (two namespace hosts, one worker each, a worker of
node2 killed at step 15) is run ROUNDS times for each --worker-start, alternating, and the seconds
from the kill to training again and each phase of rank 0's recovery timeline are printed as
medians. Not part of `make test`: the figures belong in docs/benchmarks.md, not in assertions on
a shared machine; the one assertion is the comparison within this run.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from netns import Cluster
from test_multinode_faults import SLOW, Job, namespaces_ok  # noqa: F401  (a fixture)

pytestmark = pytest.mark.cluster

ROUNDS = int(os.environ.get("DDPTRAIN_RECOVERY_ROUNDS", "3"))


def _one(tmp: Path, worker_start: str) -> dict[str, Any]:
    tmp.mkdir(parents=True)
    cluster = Cluster(2)
    try:
        job = Job(cluster, tmp, launch=["--worker-start", worker_start], train=[SLOW])
        job.start()
        job.wait_for_step(15)
        t_kill = time.time()
        for pid in job.workers(cluster.nodes[1]):
            os.kill(pid, signal.SIGKILL)
        again = job.training_again_after(t_kill)
        assert job.wait(150) == {"node1": 0, "node2": 0}, job.output()
        (timeline,) = job.events("recovery")
        return {"kill to training": again, **{name: s for name, s in timeline["phases"]}}
    finally:
        cluster.close()


@pytest.mark.measure
@pytest.mark.timeout(1800)
def test_preloaded_workers_recover_faster_than_execd(namespaces_ok: None, tmp_path: Path) -> None:  # noqa: F811
    results: dict[str, list[dict[str, Any]]] = {"exec": [], "preloaded": []}
    for i in range(ROUNDS):
        for variant in results:
            results[variant].append(_one(tmp_path / f"{variant}-{i}", variant))
    for variant, rows in results.items():
        keys = list(rows[0])
        medians = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
        spread = [round(r["kill to training"], 1) for r in rows]
        print(
            f"\nMEASURED --worker-start {variant} ({ROUNDS} rounds): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items())
            + f"; kill to training per round {spread}"
        )
    exec_s = statistics.median(r["kill to training"] for r in results["exec"])
    preloaded_s = statistics.median(r["kill to training"] for r in results["preloaded"])
    assert preloaded_s < exec_s, (preloaded_s, exec_s)
