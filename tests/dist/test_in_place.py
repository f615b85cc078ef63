"""In-place fault tolerance on loopback: bad input refused in one line, and a donor that dies mid-heal.

Real processes: `ddptrain lighthouse` and one `ddptrain train` per replica group (a group of one rank),
with the in-place variables of ft_env.py. The multi-host scenarios are in tests/cluster/test_in_place_recovery.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import HELD_BACK, descendants, env_for_subprocess, one_error_line, run_ddptrain, start_ddptrain
from tracking_harness import free_port

pytestmark = pytest.mark.dist
pytest.importorskip("torchft")

TOY = [
    "model.target=faulty:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=4",
    "train.global_batch_size=16",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "log.every_steps=1",
    "ckpt.every_steps=10",
    "dist.ft_timeout_s=5",
    "train.max_steps=40",
]


def ft_env(group: int | str, lighthouse: str, **extra: str) -> dict[str, str]:
    return env_for_subprocess(
        {"DDPTRAIN_REPLICA_GROUP": str(group), "TORCHFT_LIGHTHOUSE": f"http://{lighthouse}", **extra}
    )


def wait_listening(address: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Return once something accepts connections at address (the Lighthouse is ready); fail if proc exits first."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"nothing listens at {address}"
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def wait_for_text(path: Path, text: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} not in {path.name}"
        time.sleep(0.1)


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "lighthouse.log", "wb")
    proc = start_ddptrain(["lighthouse", "--bind", address], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(address, proc)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        log.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "args", "says"),
    [
        ({}, [], "cannot reach the Lighthouse at http://127.0.0.1:9"),
        ({}, ["dist.strategy=fsdp"], "trains with dist.strategy=ddp, not fsdp"),
    ],
)
def test_bad_input_in_place_exits_2_in_one_line_and_writes_nothing(
    tmp_path: Path, env: dict[str, str], args: list[str], says: str
) -> None:
    run_dir = tmp_path / "run"
    variables = {**ft_env(0, "127.0.0.1:9"), **env}  # port 9 (discard): nothing listens there
    done = run_ddptrain(["train", *TOY, "dist.ft_timeout_s=2", *args, f"run.dir={run_dir}"], env=variables)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in one_error_line(done)
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
def test_without_torchft_installed_the_mode_says_which_extra(tmp_path: Path) -> None:
    broken = tmp_path / "site" / "torchft"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('torchft is not installed here')\n")
    env = ft_env(0, "127.0.0.1:9")
    env["PYTHONPATH"] = f"{broken.parent}:{env['PYTHONPATH']}"
    done = run_ddptrain(["train", *TOY, f"run.dir={tmp_path / 'run'}"], env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install 'ddptrain[ft]'" in one_error_line(done)


def run_groups(tmp_path: Path, commands: list[tuple[list[str], dict[str, str]]]) -> list[int]:
    """Start one process per replica group (output in tmp_path/group<g>.log) and return their exit codes."""
    logs = [open(tmp_path / f"group{g}.log", "wb") for g in range(len(commands))]
    procs = [
        subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        for (argv, env), log in zip(commands, logs, strict=True)
    ]
    try:
        return [p.wait(timeout=110) for p in procs]
    finally:
        for p in procs:
            p.kill()
        for f in logs:
            f.close()


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.timeout(150)
def test_a_donor_dying_mid_heal_leaves_the_joiner_training_from_the_durable_checkpoint(
    lighthouse: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "ddptrain", "train", *TOY, "model.kwargs.step_sleep=0.1", f"run.dir={run_dir}"]
    logs = {g: open(tmp_path / f"group{g}.log", "wb") for g in (0, 1)}
    donor = subprocess.Popen(
        argv, env=ft_env(1, lighthouse, DDPTRAIN_FT_INJECT="die_in_send"), stdout=logs[1], stderr=subprocess.STDOUT
    )
    # The joiner imports torch meanwhile and starts training the moment the donor's checkpoint is durable and its
    # imports are done: the donor must still be training when it joins, however slowly this machine starts an
    # interpreter.
    gate = tmp_path / "join-now"
    joiner = subprocess.Popen(
        [sys.executable, "-c", HELD_BACK, str(gate), *argv[3:]],
        env=ft_env(0, lighthouse),
        stdout=logs[0],
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 90
    ready = gate.with_name(gate.name + ".ready")
    while not (any(r.get("event") == "checkpoint" for r in records(run_dir)) and ready.exists()):
        assert time.monotonic() < deadline and donor.poll() is None, (tmp_path / "group1.log").read_text()[-3000:]
        time.sleep(0.1)
    gate.touch()
    try:
        assert donor.wait(timeout=90) == -signal.SIGKILL  # the drill: it died while sending its state
        assert joiner.wait(timeout=90) == 0, (tmp_path / "group0.log").read_text()[-3000:]
    finally:
        for proc in (donor, joiner):
            proc.kill()
        for f in logs.values():
            f.close()
    events = [r for r in records(run_dir) if r["kind"] == "event"]
    failed = [e for e in events if e.get("event") == "quorum_failed" and e["replica_group"] == 0]
    assert failed, events  # the joiner saw the transfer fail, and discarded that step
    alone = [e for e in events if e.get("event") == "quorum" and e["groups"] == [0]]
    assert alone and alone[-1]["time"] > failed[0]["time"]  # then trained on alone ...
    steps = [r["step"] for r in records(run_dir) if r["kind"] == "train"]
    assert steps[-1] == 40  # ... from the newest durable checkpoint to the end
    assert not [e for e in events if e.get("event") == "heal" and e["verified"]]


@pytest.mark.timeout(150)
def test_a_lighthouse_restarted_at_its_address_pauses_the_groups_and_they_go_on(tmp_path: Path) -> None:
    run_dir, address = tmp_path / "run", f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "ddptrain", "train", *TOY, "model.kwargs.step_sleep=0.05", f"run.dir={run_dir}"]
    lighthouse = [sys.executable, "-m", "ddptrain", "lighthouse", "--bind", address]
    logs = [open(tmp_path / f"{name}.log", "wb") for name in ("lighthouse", "group0", "group1", "lighthouse2")]
    first = subprocess.Popen(lighthouse, env=env_for_subprocess(), stdout=logs[0], stderr=subprocess.STDOUT)
    wait_listening(address, first)
    groups = [
        subprocess.Popen(argv, env=ft_env(g, address), stdout=logs[g + 1], stderr=subprocess.STDOUT) for g in (0, 1)
    ]
    second: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 90
        while not any(r.get("step", 0) >= 8 for r in records(run_dir) if r["kind"] == "train"):
            assert time.monotonic() < deadline, (tmp_path / "group0.log").read_text()[-3000:]
            time.sleep(0.1)
        first.kill()
        first.wait(timeout=10)
        lost_at = time.time()
        wait_for_text(tmp_path / "group0.log", "asking the Lighthouse again")  # group 0 noticed the loss
        second = subprocess.Popen(lighthouse, env=env_for_subprocess(), stdout=logs[3], stderr=subprocess.STDOUT)
        assert [g.wait(timeout=100) for g in groups] == [0, 0], (tmp_path / "group0.log").read_text()[-3000:]
    finally:
        for proc in (first, second, *groups):
            if proc is not None:
                proc.kill()
        for f in logs:
            f.close()
    steps = [r for r in records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 41))  # no step lost, none repeated: the groups kept their state
    resumed = next(r for r in steps if r["time"] > lost_at)
    # Both groups train together again. (Under load one group may reach the new Lighthouse first and train a step
    # alone, min replicas being 1, while the other joins and heals: the steps above still come once each.)
    assert any(r["world_size"] == 2 for r in steps if r["time"] > lost_at)
    print(f"MEASURED Lighthouse lost until a group asked again: the groups paused {resumed['time'] - lost_at:.1f} s")


@pytest.mark.timeout(150)
def test_groups_dying_in_a_save_and_in_an_evaluation_leave_the_last_one_training(
    lighthouse: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    train = [*TOY, "train.max_steps=20", "train.eval_every=5", "ckpt.every_steps=5", "model.kwargs.step_sleep=0.05"]
    argv = [sys.executable, "-m", "ddptrain", "train", *train, f"run.dir={run_dir}"]
    dies = {0: "save", 1: "eval"}  # group 0 writes the folder: it dies capturing its first checkpoint
    envs = [ft_env(g, lighthouse, **({"FAULTY_DIE_IN": dies[g]} if g in dies else {})) for g in range(3)]
    codes = run_groups(tmp_path, [(argv, env) for env in envs])
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0], (tmp_path / "group2.log").read_text()[-3000:]
    steps = [r["step"] for r in records(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 21))  # each step committed and logged once, through the change of writer
    events = [r for r in records(run_dir) if r["kind"] == "event"]
    last = [e for e in events if e.get("event") == "quorum"][-1]
    assert last["groups"] == [2] and last["world_size"] == 1
    assert any(e.get("event") == "checkpoint" and e["step"] == 20 for e in events)  # the survivor saved the end


def assert_left_nothing(run_dir: Path, group: int, lr: str) -> None:
    """The group of another recipe wrote nothing into the job's folder: no record, no log line, not its config."""
    assert not [r for r in records(run_dir) if r.get("replica_group") == group]
    assert [r["event"] for r in records(run_dir) if r.get("event") in ("start", "resume")] == ["start"]
    assert f"lr: {lr}" not in (run_dir / "config.yaml").read_text()
    assert f"replica group {group} trains another recipe" not in (run_dir / "logs" / "rank-0.log").read_text()
    assert not list((run_dir / "checkpoints").glob(".tmp-step-*"))


@pytest.mark.timeout(120)
def test_groups_started_together_with_two_recipes_one_exits_2_before_healing_or_training(
    lighthouse: str, tmp_path: Path
) -> None:
    """Whichever forms the first quorum (alone, or both: then group 0, the lowest-ranked) is the job; the other exits 2
    in one line, at the heal it refuses or at the first quorum's admission, having written nothing."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "ddptrain", "train", *TOY, "model.kwargs.step_sleep=0.05", f"run.dir={run_dir}"]
    codes = run_groups(tmp_path, [(argv, ft_env(0, lighthouse)), ([*argv, "train.lr=0.01"], ft_env(1, lighthouse))])
    assert sorted(codes) == [0, 2], [(tmp_path / f"group{g}.log").read_text()[-2000:] for g in (0, 1)]
    out, job = codes.index(2), codes.index(0)
    said = (tmp_path / f"group{out}.log").read_text()
    assert f"error: replica group {out} trains another recipe than groups [{job}], the job's" in said
    assert [r["step"] for r in records(run_dir) if r["kind"] == "train"] == list(range(1, 41))
    assert not [e for e in records(run_dir) if e.get("event") == "heal"]  # nobody healed across the recipes
    assert_left_nothing(run_dir, out, "0.01" if out == 1 else "0.003")


@pytest.mark.timeout(150)
def test_a_group_of_another_recipe_joining_a_training_job_is_refused_its_heal_and_leaves_nothing(
    lighthouse: str, tmp_path: Path
) -> None:
    """Group 1 (another lr) joins once group 0 has trained: it would heal from group 0, reads group 0's recipe
    first, receives nothing and exits 2; group 0 trains every step once, alone."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "ddptrain", "train", *TOY, "model.kwargs.step_sleep=0.1", f"run.dir={run_dir}"]
    logs = {g: open(tmp_path / f"group{g}.log", "wb") for g in (0, 1)}
    job = subprocess.Popen(argv, env=ft_env(0, lighthouse), stdout=logs[0], stderr=subprocess.STDOUT)
    gate = tmp_path / "join-now"
    other = subprocess.Popen(
        [sys.executable, "-c", HELD_BACK, str(gate), *argv[3:], "train.lr=0.01"],
        env=ft_env(1, lighthouse),
        stdout=logs[1],
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 90
    ready = gate.with_name(gate.name + ".ready")  # its imports done: it joins well before group 0's last step
    while not (any(r.get("step", 0) >= 3 for r in records(run_dir) if r["kind"] == "train") and ready.exists()):
        assert time.monotonic() < deadline and job.poll() is None, (tmp_path / "group0.log").read_text()[-3000:]
        time.sleep(0.05)
    gate.touch()
    try:
        assert other.wait(timeout=90) == 2, (tmp_path / "group1.log").read_text()[-3000:]
        assert job.wait(timeout=90) == 0, (tmp_path / "group0.log").read_text()[-3000:]
    finally:
        for proc in (job, other):
            proc.kill()
        for f in logs.values():
            f.close()
    said = [line for line in (tmp_path / "group1.log").read_text().splitlines() if "error" in line]
    assert said == [
        "ddptrain train: error: replica group 1 trains another recipe than groups [0], the job's (model, train, optim, "
        "schedule, data.micro_batch_size, run.seed or the data differ): it left before healing or training anything; "
        "start it with the job's config"
    ]
    assert [r["step"] for r in records(run_dir) if r["kind"] == "train"] == list(range(1, 41))
    assert all(e["groups"] == [0] for e in records(run_dir) if e.get("event") == "quorum")
    assert_left_nothing(run_dir, 1, "0.01")


@pytest.mark.timeout(200)
def test_a_frozen_writer_group_is_evicted_and_rejoins_when_it_wakes(lighthouse: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # dist.ft_timeout_s far above the waits below: only the eviction lets the other group go on while group 0 sleeps.
    train = [*TOY, "train.max_steps=60", "dist.ft_timeout_s=90", "model.kwargs.step_sleep=0.05", f"run.dir={run_dir}"]
    argv = [sys.executable, "-m", "ddptrain", "train", *train]
    logs = [open(tmp_path / f"group{g}.log", "wb") for g in (0, 1)]
    groups = [
        subprocess.Popen(argv, env=ft_env(g, lighthouse), stdout=logs[g], stderr=subprocess.STDOUT) for g in (0, 1)
    ]

    def trained(after: float, size: int) -> list[dict[str, Any]]:
        return [r for r in records(run_dir) if r["kind"] == "train" and r["time"] > after and r["world_size"] == size]

    try:
        deadline = time.monotonic() + 90
        while not any(r["step"] >= 8 for r in trained(0, 2)):
            assert time.monotonic() < deadline, (tmp_path / "group0.log").read_text()[-3000:]
            time.sleep(0.1)
        groups[0].send_signal(signal.SIGSTOP)  # group 0 writes the folder: it freezes mid-step, sockets open
        frozen_at = time.time()
        deadline = time.monotonic() + 60
        while len(trained(frozen_at, 1)) < 3:  # group 1 trains on alone while group 0 is still frozen
            assert time.monotonic() < deadline, (tmp_path / "group1.log").read_text()[-3000:]
            time.sleep(0.05)
        groups[0].send_signal(signal.SIGCONT)
        woke_at = time.time()
        assert [g.wait(timeout=100) for g in groups] == [0, 0], (tmp_path / "group0.log").read_text()[-3000:]
    finally:
        for proc in groups:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        for f in logs:
            f.close()
    steps = [r for r in records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 61))  # each step committed and logged once
    quorums = [r for r in records(run_dir) if r.get("event") == "quorum"]
    evicted = next(q for q in quorums if q["evicted"])
    assert evicted["evicted"] == [0] and evicted["groups"] == [1] and evicted["left"] == [0]
    back = [q for q in quorums if q["time"] > woke_at and 0 in q["joined"]]  # it woke, healed and rejoined
    assert back and back[-1]["groups"] == [0, 1]
    assert any(h["replica_group"] == 0 and h["verified"] for h in records(run_dir) if h.get("event") == "heal")
    first = trained(frozen_at, 1)[0]
    print(f"MEASURED frozen group (SIGSTOP) -> next commit by the other: {first['time'] - frozen_at:.2f} s")


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.timeout(200)
def test_a_sigkilled_launcher_stops_its_groups_at_the_last_commit_with_a_checkpoint(tmp_path: Path) -> None:
    from ddptrain.checkpoint.verify import verify_checkpoint

    run_dir = tmp_path / "run"
    # The Lighthouse lives in the launcher: its quorums would wait dist.ft_timeout_s (60 s), past the agents'
    # shutdown timeout (30 s), which would SIGKILL the workers without a checkpoint.
    train = [*TOY, "train.max_steps=400", "dist.ft_timeout_s=60", "model.kwargs.step_sleep=0.05", f"run.dir={run_dir}"]
    ft = ["--fault-tolerance", "torchft", "--replica-groups", "2", "--nproc-per-node", "2"]
    argv = [sys.executable, "-m", "ddptrain", "launch", *ft, "--", "train", *train]
    log = open(tmp_path / "launch.log", "wb")
    launcher = subprocess.Popen(argv, env=env_for_subprocess(), stdout=log, stderr=subprocess.STDOUT)
    family: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not any(r.get("step", 0) >= 12 and r.get("world_size") == 2 for r in records(run_dir)):
            assert time.monotonic() < deadline and launcher.poll() is None, (tmp_path / "launch.log").read_text()[
                -3000:
            ]
            time.sleep(0.1)
        family = descendants(launcher.pid)
        launcher.kill()  # as the OOM killer would: the groups' launches get SIGTERM from the kernel
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 90  # generous: a bound, not a timing (the agents would kill at 30 s)
        while any(running(p) for p in family):
            assert time.monotonic() < deadline, (tmp_path / "launch.log").read_text()[-3000:]
            time.sleep(0.1)
    finally:
        for pid in family:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
    last = max(r["step"] for r in records(run_dir) if r["kind"] == "train")
    ends = [r for r in records(run_dir) if r.get("event") == "preempted"]  # each group records its own end
    assert sorted((e["replica_group"], e["step"], e["exit_code"]) for e in ends) == [(0, last, 75), (1, last, 75)], (
        tmp_path / "launch.log"
    ).read_text()[-3000:]
    assert verify_checkpoint(run_dir / "checkpoints" / f"step-{last:08d}").step == last  # the stop step, committed


@pytest.mark.timeout(200)
def test_diloco_groups_lose_one_mid_sync_and_one_mid_interval_and_its_replacement_heals_at_an_outer_sync(
    lighthouse: str, tmp_path: Path
) -> None:
    """train.diloco in the in-place mode: the replica groups are the DiLoCo groups, meeting at outer syncs only.
    Group 2 joins groups 0 and 1 once they train together (so it never writes the folder), heals at an outer sync
    and dies inside the next, the first it contributes to (the fault drill: after the round's head is summed, before
    the pseudo-gradients): the others' sum fails, they discard the round and commit it again without it. Group 1 is
    then killed mid-interval; group 0 syncs alone at the next outer sync (its steps go on, none repeated); the
    replacement resumes from the durable checkpoint, heals at a later outer sync (the global weights and outer
    optimizer, its local weights reset to them) and trains to the end."""
    run_dir = tmp_path / "run"
    diloco = ["train.diloco.every_steps=3", "ckpt.every_steps=6", "model.kwargs.step_sleep=0.1"]
    argv = [sys.executable, "-m", "ddptrain", "train", *TOY, *diloco, f"run.dir={run_dir}"]
    logs = [open(tmp_path / f"group{n}.log", "wb") for n in range(4)]  # group3.log: group 1's replacement
    # Groups 2 and 1's replacement have their imports done before their gate opens: they start at once.
    join, replace = tmp_path / "join-now", tmp_path / "replace-now"
    held = [([sys.executable, "-c", HELD_BACK, str(gate), *argv[3:]], gate) for gate in (join, replace)]
    envs = [ft_env(0, lighthouse), ft_env(1, lighthouse)]
    envs += [ft_env(2, lighthouse, DDPTRAIN_FT_INJECT="die_in_outer_sync"), ft_env(1, lighthouse)]
    commands = [argv, argv, held[0][0], held[1][0]]
    groups = [subprocess.Popen(c, env=e, stdout=f, stderr=subprocess.STDOUT) for c, e, f in zip(commands, envs, logs)]

    def trained_since(t: float, **fields: int) -> list[dict[str, Any]]:
        return [r for r in records(run_dir) if r["kind"] == "train" and r["time"] > t and fields.items() <= r.items()]

    def wait_until(found: Callable[[], Any], log: int) -> Any:
        while not (seen := found()):
            said = (tmp_path / f"group{log}.log").read_text()[-3000:]
            assert time.monotonic() < deadline and groups[log].poll() is None, said
            time.sleep(0.02)
        return seen

    try:
        deadline = time.monotonic() + 90
        wait_until(lambda: trained_since(0, world_size=2) and join.with_name("join-now.ready").exists(), 0)
        join.touch()  # groups 0 and 1 train together: group 2 joins (it will never be the lowest, writing group)
        assert groups[2].wait(timeout=90) == -signal.SIGKILL, (tmp_path / "group2.log").read_text()[-3000:]
        died_at = time.time()
        first = wait_until(lambda: [r for r in trained_since(died_at) if r["step"] % 3 == 1], 1)[0]["step"]
        groups[1].kill()  # after the writer's first step of an interval: group 1 is inside the same interval
        groups[1].wait(timeout=10)
        killed_at = time.time()
        alone = [0]
        wait_until(lambda: [r for r in records(run_dir) if r.get("groups") == alone and r["step"] > first], 0)
        replace.touch()  # once group 0 synced alone (group 1's heartbeat timed out): the replacement comes back
        assert groups[0].wait(timeout=120) == 0, (tmp_path / "group0.log").read_text()[-3000:]
        assert groups[3].wait(timeout=60) == 0, (tmp_path / "group3.log").read_text()[-3000:]
    finally:
        for proc in groups:
            proc.kill()
        for f in logs:
            f.close()
    trained = [r for r in records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in trained] == list(range(1, 41))  # every step once: group 0 wrote them all
    assert trained[-1]["outer_syncs"] == 14  # steps 3, 6, ..., 39 and the last: each once, with at least one group
    events = [r for r in records(run_dir) if r["kind"] == "event"]
    quorums = [(e["groups"], e["step"]) for e in events if e.get("event") == "quorum"]
    # Membership moves at outer syncs only (a group that starts first may train the first interval alone).
    assert all(step % 3 == 1 or step == 41 for _, step in quorums), quorums  # 41: the last step's sync
    # Group 2 died inside an outer sync: the round it was in was discarded, then committed by the groups left.
    [after_drill] = [e for e in events if e.get("event") == "quorum" and e["left"] == [2]]
    assert after_drill["groups"] == [0, 1] and after_drill["discarded_steps"] >= 1, after_drill
    assert died_at - 1 < after_drill["time"] < killed_at, after_drill  # before group 1 was killed: none but 2 left
    said = (tmp_path / "group0.log").read_text()
    assert f"outer sync at step {after_drill['step'] - 1} discarded" in said, said[-3000:]
    assert "this group dies in an outer sync" in (tmp_path / "group2.log").read_text()
    assert [e["verified"] for e in events if e.get("event") == "heal" and e["replica_group"] == 2] == [True]
    together = [g for g, _ in quorums]
    lost = together.index([0], together.index([0, 1]))  # group 1 left: group 0 synced alone ...
    assert [0, 1] in together[lost:], quorums  # ... until the replacement joined
    heals = [e for e in events if e.get("event") == "heal" and e["replica_group"] == 1]
    assert heals and heals[-1]["verified"] and heals[-1]["time"] > killed_at
    assert any(e.get("event") == "resume" and e["replica_group"] == 1 for e in events)  # from the durable checkpoint


@pytest.mark.timeout(150)
def test_diloco_groups_that_start_late_wait_for_the_first_one_and_a_straggler_does_not_rewrite_the_end(
    tmp_path: Path,
) -> None:
    """Groups 1 and 2 start together while group 0, started first, trains its first interval alone: they are a
    majority of the groups heartbeating to the Lighthouse, whose join timeout (1 s here) is shorter than the
    interval (8 s), so their quorum forms without group 0. Were they to train in it, two jobs would write the folder
    and take the same samples; instead they wait until group 0 is in their quorum (at its outer sync), heal from it
    and train on with it. Then group 2, which takes 2 of the 4 micro-batches a step (the others 1), reaches the
    last step's sync 2 s after them: they end the job without it, and it ends without writing that step again.
    Every step is logged once, by one writer, on one share of the samples; the last checkpoint is never replaced."""
    address = f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    light_log = open(tmp_path / "lighthouse.log", "wb")
    flags = ["--join-timeout-ms", "1000", "--heartbeat-timeout-ms", "1000"]
    light = start_ddptrain(["lighthouse", "--bind", address, *flags], stdout=light_log, stderr=subprocess.STDOUT)
    shape = ["model.kwargs.step_sleep=0.25", "train.max_steps=16", "ckpt.every_steps=8"]  # 0.25 s a micro-batch
    argv = ["train", *TOY, *shape, "train.diloco.every_steps=8", f"run.dir={run_dir}"]
    gate = tmp_path / "late-now"
    logs = [open(tmp_path / f"group{n}.log", "wb") for n in range(3)]
    commands = [[sys.executable, "-m", "ddptrain", *argv]] + [[sys.executable, "-c", HELD_BACK, str(gate), *argv]] * 2
    groups: list[subprocess.Popen[bytes]] = []
    try:
        wait_listening(address, light)
        for n, (command, log) in enumerate(zip(commands, logs)):
            groups.append(subprocess.Popen(command, env=ft_env(n, address), stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 90
        while (
            not [r for r in records(run_dir) if r["kind"] == "train"] or not gate.with_name("late-now.ready").exists()
        ):
            assert time.monotonic() < deadline and groups[0].poll() is None, (tmp_path / "group0.log").read_text()
            time.sleep(0.02)
        gate.touch()  # group 0 is inside its first interval, alone
        for n, proc in enumerate(groups):
            assert proc.wait(timeout=90) == 0, (tmp_path / f"group{n}.log").read_text()[-3000:]
    finally:
        for proc in groups:
            proc.kill()
        light.send_signal(signal.SIGTERM)
        light.wait(timeout=10)
        for f in [*logs, light_log]:
            f.close()
    trained = [r for r in records(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in trained] == list(range(1, 17))
    events = [r for r in records(run_dir) if r["kind"] == "event"]
    quorums = [(e["groups"], e["step"]) for e in events if e.get("event") == "quorum"]
    assert quorums[0] == ([0], 1) and all(0 in groups for groups, _ in quorums), quorums  # no job without group 0
    assert ([0, 1, 2], 9) in quorums and all(step % 8 == 1 for _, step in quorums), quorums
    assert {r["world_size"] for r in trained if r["step"] <= 8} == {1}  # group 0 took every sample of them
    assert {r["world_size"] for r in trained if r["step"] > 8} == {3}
    heals = [e for e in events if e.get("event") == "heal"]
    assert sorted(e["replica_group"] for e in heals) == [1, 2] and all(e["verified"] for e in heals), heals
    certificate = [json.loads(line) for line in (run_dir / "certificate.jsonl").read_text().splitlines()]
    assert [c["step"] for c in certificate] == list(range(1, 17))
    assert "heartbeat outside this quorum: waiting for them to join" in (tmp_path / "group1.log").read_text()
    straggler = (tmp_path / "group2.log").read_text()
    assert "ended the job at step 16 without this group's last interval" in straggler, straggler[-3000:]
    assert ([0, 1], 17) in quorums and not list(run_dir.rglob("*replaced-step*"))
