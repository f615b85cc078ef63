"""`ddptrain launch --fault-tolerance torchft` on one node: a Lighthouse on 127.0.0.1 only, two replica groups
each with group-local ranks and the three variables of ft_env.py, a worker's death restarting its own group
only, exit 0 once every group has finished.

The workers here are a probe, not training (the trainer's side has its own tests): `ddptrain launch` runs
`python -m ddptrain COMMAND` in each worker, so the probe is a sitecustomize module on the workers' path
that records the worker's environment and waits for the test to let it finish. Python imports it at
interpreter start, which a worker of `--worker-start exec` is; the launchers themselves carry no
LOCAL_RANK, so it does nothing there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import env_for_subprocess, start_ddptrain
from test_lighthouse import listening_addresses

pytestmark = pytest.mark.dist
pytest.importorskip("torchft.coordination", reason="torchft is the ft extra (make installs it)")

PROBE = """\
import json, os, pathlib, time
if "LOCAL_RANK" in os.environ and "DDPTRAIN_REPLICA_GROUP" in os.environ and "FT_PROBE_DIR" in os.environ:
    out = pathlib.Path(os.environ["FT_PROBE_DIR"])
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHFT_LIGHTHOUSE",
             "DDPTRAIN_REPLICA_GROUP", "DDPTRAIN_BIND_ADDR")
    record = {name: os.environ.get(name) for name in names} | {"pid": os.getpid()}
    (out / f"start-{os.getpid()}.json").write_text(json.dumps(record))
    deadline = time.monotonic() + 120  # never outlive a failed test for long
    while not (out / "finish").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0 if (out / "finish").exists() else 1)
"""


def starts(folder: Path, count: int, proc: subprocess.Popen[str], within_s: float = 120) -> list[dict[str, Any]]:
    """The probe's records once there are `count` of them (the launch must still be running)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        records = [json.loads(p.read_text()) for p in folder.glob("start-*.json") if p.stat().st_size]
        if len(records) >= count:
            return records
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{count} worker starts expected within {within_s} s, saw {len(records)}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(240)
def test_two_local_groups_restart_alone_and_finish(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    probe = tmp_path / "probe"
    probe.mkdir()
    base = env_for_subprocess()
    env = {**base, "PYTHONPATH": os.pathsep.join([str(site), base["PYTHONPATH"]]), "FT_PROBE_DIR": str(probe)}
    argv = [
        "--fault-tolerance",
        "torchft",
        "--replica-groups",
        "2",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "1",
        "--worker-start",
        "exec",
        "--shutdown-timeout",
        "5",
        "--",
        "doctor",
    ]
    proc = start_ddptrain(
        ["launch", *argv], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        first = starts(probe, 4, proc)  # 4 workers split into 2 groups of 2
        lighthouses = {r["TORCHFT_LIGHTHOUSE"] for r in first}
        assert len(lighthouses) == 1, lighthouses
        (lighthouse,) = lighthouses
        assert lighthouse.startswith("http://127.0.0.1:")
        assert listening_addresses(int(lighthouse.rsplit(":", 1)[1])) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
        by_group: dict[str, dict[str, dict[str, Any]]] = {}
        for r in first:
            assert (r["WORLD_SIZE"], r["RANK"], r["DDPTRAIN_BIND_ADDR"]) == ("2", r["LOCAL_RANK"], "127.0.0.1"), r
            assert r["TORCHELASTIC_RESTART_COUNT"] == "0"
            by_group.setdefault(r["DDPTRAIN_REPLICA_GROUP"], {})[r["RANK"]] = r
        assert {g: sorted(ranks) for g, ranks in by_group.items()} == {"0": ["0", "1"], "1": ["0", "1"]}

        os.kill(by_group["0"]["1"]["pid"], signal.SIGKILL)
        restarted = [r for r in starts(probe, 6, proc) if r not in first]
        assert sorted((r["DDPTRAIN_REPLICA_GROUP"], r["RANK"]) for r in restarted) == [("0", "0"), ("0", "1")]
        assert {r["TORCHELASTIC_RESTART_COUNT"] for r in restarted} == {"1"}
        assert {r["TORCHFT_LIGHTHOUSE"] for r in restarted} == {lighthouse}  # the same Lighthouse, still up
        assert all(alive(r["pid"]) for r in by_group["1"].values())  # the other group kept its workers
        assert len(list(probe.glob("start-*.json"))) == 6

        (probe / "finish").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    assert listening_addresses(int(lighthouse.rsplit(":", 1)[1])) == set()  # gone with the job
