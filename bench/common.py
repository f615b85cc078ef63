"""Shared pieces of the benchmarks: fixed threads, interleaved rounds, statistics, and the baton.

Every figure is a set of variants measured in rounds, A B A B ... (the order alternates each
round so that neither variant always runs after the other), after warm-up rounds that are
discarded. Variants that must live in their own processes (different world sizes, peers) are
started once and then take turns: the driver hands a *baton* (a file) to one variant at a time,
so only one variant computes while the others sleep.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.forked import ForkedJob

REPO = Path(__file__).resolve().parent.parent
# Idle variants poll for the baton rarely: every wake-up of a waiting process takes a core for a
# moment, and a 2-thread OpenMP step (barriers in every operator) stalls on each such preemption.
# Polling every 0.01 s, 13 waiting processes made "1 process x 2 threads" 6x slower (23 vs 136
# samples/s) and a 2-rank step 1.7x slower, in back-to-back runs of `make bench` here.
WAIT_POLL_S = 0.25
DRIVER_POLL_S = 0.05


def fix_threads(n: int) -> None:
    """Pin intra-op threads (OMP_NUM_THREADS for children, torch for this process)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


@dataclass(frozen=True)
class Options:
    """Sizes of one benchmark run; smoke mode shrinks everything to check that scripts start."""

    smoke: bool = False
    rounds: int = 5
    warmup: int = 1
    work_dir: Path = REPO / "runs" / "bench"
    data_dir: Path = REPO / "data" / "stdlib"
    fault_every_s: float = 30.0  # the goodput figure's schedule: a kill every this many seconds ...
    fault_for_s: float = 300.0  # ... for this long
    steps: int | None = None  # slow_links: steps per job (default its STEPS)
    rate: str | None = None  # slow_links: the hosts' link rate (default its RATE)
    hosts: int | None = None  # slow_links: namespace hosts, one rank each (default its HOSTS)
    modes: tuple[str, ...] = ()  # slow_links, goodput: the modes to run (default all)

    def order(self, names: Sequence[str], r: int) -> list[str]:
        """Variant order of round r: A B C, then C B A, then A B C ..."""
        return list(names) if r % 2 == 0 else list(reversed(names))


def chosen_modes(opts: Options, modes: Mapping[str, Any], figure: str) -> list[str]:
    """The modes of `figure` that --modes names, in its order (all of them when it names none); a name it does not
    have exits 2 with the choices."""
    unknown = [m for m in opts.modes if m not in modes]
    if unknown:
        print(f"python -m bench {figure}: no mode {unknown[0]!r}: pick from {', '.join(modes)}", file=sys.stderr)
        raise SystemExit(2)
    return list(opts.modes or modes)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max, inter-quartile range) of per-round values."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0], v[0], v[0]]
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "q1": q[0], "q3": q[2], "n": len(v)}


@dataclass
class Row:
    """One line of the results table."""

    figure: str
    metric: str
    stats: dict[str, float] | None  # None: nothing measured (a skipped figure)
    unit: str = ""
    target: str = ""
    met: bool | None = None
    note: str = ""

    def cells(self) -> list[str]:
        """Markdown cells: figure, metric, median, spread, target, met."""
        s = self.stats or {"median": math.nan, "n": 0}
        median = f"{_fmt(s['median'])} {self.unit}".strip() if self.stats else "–"
        spread = f"{_fmt(s['min'])}–{_fmt(s['max'])}" if s.get("n", 1) > 1 else "–"
        met = {True: "yes", False: "**no**", None: ""}[self.met]
        return [self.figure, self.metric, median, spread, self.target, met, self.note]


def _fmt(x: float) -> str:
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.3f}"
    return f"{x:.4f}" if a >= 0.001 else f"{x:.2e}"


def markdown_table(rows: Sequence[Row]) -> str:
    """The results as a markdown table."""
    head = ["figure", "metric", "median", "spread (min–max)", "target", "met", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def interleave(variants: dict[str, Callable[[], float]], opts: Options) -> dict[str, list[float]]:
    """Run in-process variants in alternating order; per-round values of the measured rounds."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(opts.warmup + opts.rounds):
        for name in opts.order(list(variants), r):
            value = variants[name]()
            if r >= opts.warmup:
                out[name].append(value)
    return out


# ---- the baton: variants in their own processes, taking turns ---------------------------------


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Baton:
    """Worker side: wait for the driver's go for round k, report the round's result."""

    def __init__(self, folder: str | Path, name: str, rank: int) -> None:
        self.folder, self.name, self.rank = Path(folder), name, rank
        self.round = 0

    def wait(self) -> bool:
        """Block until this variant's next round may run; False when the driver says stop."""
        if self.round == 0:
            (self.folder / f"{self.name}.ready.{self.rank}").touch()
        go = self.folder / f"{self.name}.go.{self.round}"
        stop = self.folder / f"{self.name}.stop"
        while not go.exists():
            if stop.exists():
                return False
            time.sleep(WAIT_POLL_S)
        return go.read_text() == "run"

    def report(self, result: dict[str, Any]) -> None:
        """Rank 0 publishes the round's result; every rank moves on to the next round."""
        if self.rank == 0:
            _write_atomic(self.folder / f"{self.name}.done.{self.round}", json.dumps(result))
        self.round += 1

    def serve_rounds(
        self,
        run_round: Callable[[], None],
        sync: Callable[[], None],
        steps: int,
        samples_per_step: int,
        losses: Callable[[], list[float]],
    ) -> None:
        """Serve rounds until told to stop: sync the ranks, time S steps, report (every worker kind, peers too)."""
        import torch

        while self.wait():
            sync()
            t0 = time.perf_counter()
            run_round()
            seconds = time.perf_counter() - t0
            self.report(
                {
                    "seconds": seconds,
                    "steps": steps,
                    "samples": steps * samples_per_step,
                    "threads": torch.get_num_threads(),
                    "losses": losses(),
                }
            )


@dataclass
class Variant:
    """A variant running in its own process(es): python -m MODULE ARGS, under torchrun when nproc > 0
    (forked: the same, forked from the smoke mode's preloaded server, bench/forked.py)."""

    name: str
    module: str
    args: list[str]
    nproc: int = 0  # 0: one plain process; N: torchrun --standalone --nproc-per-node N
    threads: int = 1
    forked: bool = False
    ranks: int = field(init=False)

    def __post_init__(self) -> None:
        self.ranks = max(self.nproc, 1)

    def command(self) -> list[str]:
        """The command line that starts this variant."""
        launcher = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}", "-m"]
            if self.nproc
            else [sys.executable, "-m"]
        )
        return [*launcher, self.module, *self.args]

    def start(self, log: Path) -> subprocess.Popen[bytes] | ForkedJob:
        """Start this variant's processes, their output into the fresh file `log`."""
        log.parent.mkdir(parents=True, exist_ok=True)
        env = child_env(self.threads)
        if self.forked:
            log.write_bytes(b"")
            return ForkedJob(self.module, self.args, self.nproc, env, log, REPO)
        with open(log, "wb") as f:
            return subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def child_env(threads: int) -> dict[str, str]:
    """Environment of a benchmark child: fixed threads, bench importable, no inherited torchrun state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Session:
    """Driver side: start every variant, wait until all are idle, then hand out rounds one by one."""

    def __init__(self, folder: Path, variants: Sequence[Variant], start_timeout_s: float = 300) -> None:
        self.folder = folder
        self.variants = {v.name: v for v in variants}
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen[bytes] | ForkedJob] = {}
        self.rounds: dict[str, int] = {v.name: 0 for v in variants}

    def __enter__(self) -> Session:
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("*.*"):
            if stale.is_file() and not stale.name.endswith(".log"):
                stale.unlink()
        for v in self.variants.values():
            self.procs[v.name] = v.start(self.folder / f"{v.name}.log")
        deadline = time.monotonic() + self.start_timeout_s
        for v in self.variants.values():
            for rank in range(v.ranks):
                self._wait_for(self.folder / f"{v.name}.ready.{rank}", v.name, deadline)
        return self

    def run(self, name: str, timeout_s: float = 600) -> dict[str, Any]:
        """Let one variant run its next round alone; its result."""
        k = self.rounds[name]
        _write_atomic(self.folder / f"{name}.go.{k}", "run")
        done = self.folder / f"{name}.done.{k}"
        self._wait_for(done, name, time.monotonic() + timeout_s)
        self.rounds[name] = k + 1
        return json.loads(done.read_text())

    def _wait_for(self, path: Path, name: str, deadline: float) -> None:
        while not path.exists():
            if self.procs[name].poll() is not None:
                raise RuntimeError(
                    f"bench variant {name} exited ({self.procs[name].returncode}):\n{self.log_tail(name)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench variant {name}: no {path.name} in time:\n{self.log_tail(name)}")
            time.sleep(DRIVER_POLL_S)

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The end of a variant's output (for error messages)."""
        text = (self.folder / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def __exit__(self, *exc: object) -> None:
        for name in self.variants:  # also reaches a variant still busy with an interrupted round
            (self.folder / f"{name}.stop").touch()
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        failed = [n for n, p in self.procs.items() if p.returncode != 0]
        if failed and exc[0] is None:
            raise RuntimeError(
                f"bench variant(s) {failed} failed at exit:\n" + "\n".join(self.log_tail(n) for n in failed)
            )


def interleave_sessions(session: Session, names: Sequence[str], opts: Options) -> dict[str, list[dict[str, Any]]]:
    """Rounds of process variants in alternating order; the results of the measured rounds."""
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(opts.warmup + opts.rounds):
        for name in opts.order(names, r):
            result = session.run(name)
            if r >= opts.warmup:
                out[name].append(result)
    return out


def run_job(variant: Variant, log: Path, timeout_s: float = 600) -> None:
    """Run a variant to completion (a figure measured inside one job); raise with its output on failure."""
    proc = variant.start(log)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"bench job {variant.name} failed ({proc.returncode}):\n{tail}")
