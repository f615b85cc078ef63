"""`ddptrain report` on an in-place run: quorum changes, heals and the committed-step goodput (review/membership.py)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from ddptrain.cli import main
from ddptrain.errors import DataError
from ddptrain.review.groups import in_place_groups
from ddptrain.review.membership import membership_lines, step_goodput
from ddptrain.review.records import read_records
from ddptrain.review.report import summarize
from ddptrain.review.story import tell

T0 = 1_800_000_000.0
STEP_S = 0.5


def train(step: int, t: float, world_size: int) -> dict[str, Any]:
    return {
        "kind": "train",
        "time": t,
        "step": step,
        "loss": 5.0 - 0.01 * step,
        "lr": 1e-3,
        "world_size": world_size,
        "global_batch_size": 48,
        "step_time_s": STEP_S,
        "samples_per_s": 48 / STEP_S,
        "tokens_per_s": 48 * 128 / STEP_S,
    }


def event(name: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"kind": "event", "time": t, "event": name, **fields}


def in_place_records() -> list[dict[str, Any]]:
    """3 groups; group 0 killed after step 20 (1 step discarded, a 1.4 s stall), its replacement resumes from the
    step-20 checkpoint, a first heal refused, a second verified, and it joins at step 30."""
    out = [event("start", T0 - 1, step=0, world_size=1, grad_accum=6, restart_count=0, host=f"node{g}") for g in "321"]
    out.append(event("quorum", T0, step=1, groups=[0, 1, 2], joined=[], left=[], world_size=3, discarded_steps=0))
    t = T0
    for step in range(1, 41):
        if step == 21:
            t += 1.4
            out.append(event("quorum", t, step=21, groups=[1, 2], joined=[], left=[0], world_size=2, discarded_steps=1))
        if step == 25:
            out.append(event("resume", t, step=20, world_size=1, grad_accum=6, restart_count=0, host="node1"))
        if step == 30:
            heal = {"replica_group": 0, "bytes": 10_000_000}
            out.append(event("heal", t, step=29, seconds=0.2, bytes_per_s=None, verified=False, error="digest", **heal))
            out.append(event("heal", t, step=29, seconds=0.1, bytes_per_s=100_000_000, verified=True, **heal))
            out.append(
                event("quorum", t, step=30, groups=[0, 1, 2], joined=[0], left=[], world_size=3, discarded_steps=0)
            )
        out.append(train(step, t, 3 if step < 21 or step >= 30 else 2))
        t += STEP_S
    return out


def write_run(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


@pytest.mark.timeout(60)
def test_report_of_an_in_place_run_draws_the_membership_and_its_goodput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = write_run(tmp_path, in_place_records())
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert (
        "in-place quorum: 3 change(s) (1 group(s) left, 1 joined), 1 step(s) discarded; world size 3 -> 2 -> 3" in out
    )
    assert "heals: 1 verified (median 0.100 s, 100.0 MB/s), 1 refused" in out
    # 39 steps after the first, each 0.5 s, in 39 x 0.5 + 1.4 s of wall time
    assert f"goodput (committed steps): {100 * 19.5 / 20.9:.1f}% (39 steps x 0.500 s median step in 20.9 s)" in out
    assert "3 replica group(s) in place" in out  # the replacement's resume is a group rejoining, not a new attempt
    assert "steps re-done" not in out
    png = run_dir / "report" / "membership.png"
    with Image.open(png) as img:
        img.verify()
    assert str(png) in out


def four_kills() -> list[dict[str, Any]]:
    """3 groups under `ddptrain launch` (each group's restarts counted by its launcher), 40 steps: group 0 killed and
    seen leaving at step 9, restarted, back at 12; group 1 killed and restarted before the others committed a step
    without it (2 steps discarded, no change of membership); group 2 evicted at step 20 (it stopped answering) and
    back at 24 in the same process; group 2 killed at step 31 for good. Groups 0 and 1 complete."""
    out = [
        event("start", T0 - 1, step=0, world_size=1, restart_count=0, host="node", replica_group=g) for g in (0, 1, 2)
    ]
    quorums = {
        1: ([0, 1, 2], [], [], 0),
        9: ([1, 2], [], [0], 1),
        12: ([0, 1, 2], [0], [], 0),
        16: ([0, 1, 2], [], [], 2),
        20: ([0, 1], [], [2], 0),
        24: ([0, 1, 2], [2], [], 0),
        31: ([0, 1], [], [2], 1),
    }
    restarts = {11: (0, 5), 15: (1, 10)}  # step -> (group, checkpoint it resumed from)
    t, size = T0, 3
    for step in range(1, 41):
        if step in restarts:
            g, resumed = restarts[step]
            out.append(event("resume", t, step=resumed, world_size=1, restart_count=1, host="node", replica_group=g))
        if step in quorums:
            groups, joined, left, discarded = quorums[step]
            size = len(groups)
            q = {"groups": groups, "joined": joined, "left": left, "discarded_steps": discarded}
            out.append(event("quorum", t, step=step, world_size=size, **q))
        out.append(train(step, t, size))
        t += STEP_S
    out += [event("completed", t, step=40, exit_code=0, replica_group=g) for g in (0, 1)]
    return out


def summary_of(run_dir: Path) -> str:
    """The report's summary.txt, without the plots (main(["report"]) draws them: the test above)."""
    records, truncated = read_records(run_dir / "metrics.jsonl")
    story = tell(records, finished=True)
    return summarize(run_dir, records, truncated, story, in_place_groups(records, story))


def test_report_of_an_in_place_run_lists_group_failures_restarts_and_evictions(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, four_kills())
    (run_dir / "config.yaml").write_text("train:\n  max_steps: 40\n")
    out = summary_of(run_dir)
    assert "status: finished (40 steps)" in out
    assert "steps: 40 (world size 3 -> 2 -> 3 -> 2 -> 3 -> 2, global batch 48; 3 replica group(s) in place)" in out
    assert (
        "replica groups: 3 (0, 1, 2); 3 failure(s), 2 restart(s), 1 eviction(s); last processes: group 0 completed, "
        "group 1 completed; no end record from group(s) 2 (killed, or still running)"
    ) in out
    assert "job (in-place, one attempt): completed at step 40 (exit 0)" in out
    assert "attempts:" not in out
    events = [line.split("step", 1)[1].strip() for line in out.splitlines() if line.startswith("  ") and "UTC" in line]
    group_events = [e for e in events if "group" in e.split(":")[0]]
    assert group_events == [
        "9  group failed: replica group 0 failed",
        "5  group restart: replica group 0 started again (restart 1 of its launcher) after a failure, from step 5",
        "12  group joined: replica group 0 joined; 3 ranks",
        "10  group failed: replica group 1 failed (its steps were discarded)",
        "10  group restart: replica group 1 started again (restart 1 of its launcher) after a failure, from step 10",
        "20  group evicted: replica group 2 stopped answering",
        "24  group joined: replica group 2 rejoined without a restart (it had been evicted); 3 ranks",
        "31  group failed: replica group 2 failed and did not come back",
    ]
    assert [e for e in events if e.split()[1] == "world"] == [
        "9  world size: world size 3 -> 2",
        "12  world size: world size 2 -> 3",
        "20  world size: world size 3 -> 2",
        "24  world size: world size 2 -> 3",
        "31  world size: world size 3 -> 2",
    ]


VALUES = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3) | st.lists(st.integers(-1, 3), max_size=3)
KEYS = ["replica_group", "restart_count", "groups", "joined", "left", "world_size", "step", "event"]


@settings(max_examples=80, deadline=None)
@given(
    make=st.sampled_from([four_kills, in_place_records]),
    key=st.sampled_from([*KEYS, "seconds", "verified", "bytes_per_s", "discarded_steps"]),
    value=VALUES | st.lists(VALUES, max_size=2),
    drop=st.booleans(),
    data=st.data(),
)
def test_mutated_group_records_report_or_name_their_line(
    make: Any, key: str, value: Any, drop: bool, data: st.DataObject
) -> None:
    """Any field of the groups' records (starts, quorums, heals, ends) with another value or type: the groups are
    told, or the line is named (exit 2 in the command), never a traceback."""
    records = make()
    index = data.draw(st.sampled_from([i for i, r in enumerate(records) if r["kind"] == "event"]), label="record")
    if drop:
        records[index].pop(key, None)
    else:
        records[index][key] = value
    with tempfile.TemporaryDirectory() as folder:
        run_dir = write_run(Path(folder), records)
        try:
            kept, _ = read_records(run_dir / "metrics.jsonl")
        except DataError as e:
            assert f"line {index + 1} is malformed" in str(e), e
            return
        summary_of(run_dir)
        membership_lines(kept)


@pytest.mark.timeout(60)
def test_report_of_a_run_without_quorum_events_draws_no_membership(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [event("start", T0 - 1, step=0, world_size=2, grad_accum=1, restart_count=0, host="node1")]
    records += [train(s, T0 + STEP_S * s, 2) for s in range(1, 11)]
    run_dir = write_run(tmp_path, records)
    assert main(["report", str(run_dir)]) == 0
    assert "in-place quorum" not in capsys.readouterr().out
    assert not (run_dir / "report" / "membership.png").exists()


@settings(max_examples=50, deadline=None)
@given(
    steps=st.integers(5, 200),
    step_s=st.floats(0.01, 10),
    stall_s=st.floats(0, 100),
    redone=st.integers(0, 10),
)
def test_step_goodput_counts_each_step_once_and_the_stall_as_lost(
    steps: int, step_s: float, stall_s: float, redone: int
) -> None:
    """Evenly spaced steps, one stall after the middle one, and a rollback that re-does `redone` steps after it:
    the re-done steps and the stall are the time lost."""
    middle = steps // 2
    records, t = [], 0.0
    for s in list(range(1, middle + 1)) + list(range(max(middle - redone, 0) + 1, steps + 1)):
        if len(records) == middle:  # the fault: a stall, then the next step (or the rollback's first)
            t += stall_s
        records.append({"kind": "train", "time": t, "step": s})
        t += step_s
    g = step_goodput(records)
    assert g is not None
    assert g.steps == steps - 1
    assert g.step_s == pytest.approx(step_s)
    wall = (len(records) - 1) * step_s + stall_s
    assert g.wall_s == pytest.approx(wall)
    assert g.ratio == pytest.approx((steps - 1) * step_s / wall)


def test_diloco_goodput_charges_every_step_its_share_of_the_outer_syncs() -> None:
    """Inner steps of 0.5 s, an outer sync of 1 s after every 4th: the fault-free step is (4 x 0.5 + 1) / 4 s, not
    the inner step's 0.5 s (which would put a fault-free run's goodput near 0.75)."""
    records, t, syncs = [], 0.0, 0
    for s in range(1, 21):
        t += 0.5 + (1.0 if s % 4 == 0 else 0.0)
        syncs += s % 4 == 0
        records.append({"kind": "train", "time": t, "step": s, "outer_syncs": syncs})
    g = step_goodput(records)
    assert g is not None and g.step_s == pytest.approx(0.75)
    assert g.ratio == pytest.approx(19 * 0.75 / (t - 0.5))  # the window opens at step 1's record
