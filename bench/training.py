"""Training-speed figures: trainer overhead, scaling and peers, from one baton session.

Per round r every variant runs the same S steps; a figure is a per-round ratio between variants
(paired within the round, so that slow phases of a shared machine hit both sides), summarised by
its median and spread over the measured rounds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from bench.common import Options, Row, Session, Variant, interleave_sessions, summary


def _variant(name: str, kind: str, opts: Options, model: str, steps: int, nproc: int, threads: int = 1) -> Variant:
    total = (opts.warmup + opts.rounds) * steps
    folder = opts.work_dir / "session"
    args = [
        kind,
        "--baton",
        str(folder),
        "--name",
        name,
        "--steps",
        str(steps),
        "--total-steps",
        str(total),
        "--model",
        model,
        "--data",
        str(opts.data_dir),
        "--run-dir",
        str(opts.work_dir / "runs" / name),
    ]
    return Variant(name, "bench.train_worker", args, nproc=nproc, threads=threads, forked=opts.smoke)


def _session(opts: Options, variants: Sequence[Variant]) -> dict[str, list[dict[str, Any]]]:
    with Session(opts.work_dir / "session", variants) as s:
        return interleave_sessions(s, [v.name for v in variants], opts)


def _per_round(results: dict[str, list[dict[str, Any]]], key: str = "seconds") -> dict[str, list[float]]:
    return {name: [r[key] for r in rounds] for name, rounds in results.items()}


def _losses(results: dict[str, list[dict[str, Any]]], name: str) -> list[float]:
    return [x for r in results[name] for x in r["losses"]]


FIGURES = ("overhead", "scaling", "peers")


def peers_available() -> dict[str, bool]:
    """Which peers are installed (the bench extra)."""
    return {name: importlib.util.find_spec(name) is not None for name in ("lightning", "accelerate")}


def _plan(figures: set[str], opts: Options) -> list[Variant]:
    """The union of the variants the chosen figures need: one session serves them all."""
    model, steps = ("tiny", 2) if opts.smoke else ("default", 10)
    plan = [_variant("ddptrain", "ddptrain", opts, model, steps, 2)]
    if "overhead" in figures:
        plan.append(_variant("raw", "raw", opts, model, steps, 2))
        if not opts.smoke:  # in smoke mode the main pair already is the tiny model
            plan += [
                _variant("ddptrain-tiny", "ddptrain", opts, "tiny", 60, 2),
                _variant("raw-tiny", "raw", opts, "tiny", 60, 2),
            ]
    if "scaling" in figures:
        plan += [
            _variant("1x1", "ddptrain", opts, model, steps, 0, threads=1),
            _variant("1x2", "ddptrain", opts, model, steps, 0, threads=2),
        ]
    if "peers" in figures:
        plan += [_variant(n, n, opts, model, steps, 2) for n, ok in peers_available().items() if ok]
    return plan


def run(opts: Options, figures: set[str]) -> tuple[list[Row], dict[str, Any]]:
    """One session, interleaving every variant the chosen figures need; their rows."""
    plan = _plan(figures, opts)
    res = _session(opts, plan)
    seconds = _per_round(res)
    sps = {n: [r["samples"] / r["seconds"] for r in rounds] for n, rounds in res.items()}
    steps = {v.name: res[v.name][0]["steps"] for v in plan}
    rows: list[Row] = []
    if "overhead" in figures:
        rows += _overhead(res, seconds, steps)
    if "scaling" in figures:
        rows += _scaling(sps)
    if "peers" in figures:
        rows += _peers(sps)
    data = {
        "seconds": seconds,
        "samples_per_s": sps,
        "steps_per_round": steps,
        "threads": {n: rounds[0]["threads"] for n, rounds in res.items()},
        "losses": {n: _losses(res, n) for n in res if n.startswith(("ddptrain", "raw"))},
    }
    return rows, data


def _overhead(res: dict[str, list[dict[str, Any]]], t: dict[str, list[float]], steps: dict[str, int]) -> list[Row]:
    rows = []
    for suffix in ("", "-tiny"):
        a, b = f"ddptrain{suffix}", f"raw{suffix}"
        if b not in res:
            continue
        # Bit-identical losses: same init, data order, optimizer and schedule; any difference is a bug.
        identical = _losses(res, a) == _losses(res, b)
        raw_ms = summary([x / steps[b] * 1000 for x in t[b]])["median"]
        note = f"raw loop {raw_ms:.1f} ms/step; losses bit-identical over {len(_losses(res, b))} steps: {identical}"
        if suffix == "":
            s = summary([x / y for x, y in zip(t[a], t[b])])
            rows.append(
                Row(
                    "trainer overhead",
                    "step-time ratio ddptrain / raw loop, 2 ranks",
                    s,
                    "x",
                    "<= 1.02",
                    s["median"] <= 1.02 and identical,
                    note,
                )
            )
        else:
            s = summary([(x - y) / steps[b] * 1000 for x, y in zip(t[a], t[b])])
            rows.append(
                Row(
                    "trainer overhead",
                    "extra time per step vs raw loop, tiny model, 2 ranks",
                    s,
                    "ms",
                    "<= 5 ms",
                    s["median"] <= 5 and identical,
                    note,
                )
            )
    return rows


def _scaling(sps: dict[str, list[float]]) -> list[Row]:
    linear = summary([a / (2 * b) for a, b in zip(sps["ddptrain"], sps["1x1"])])
    vs_threads = summary([a / b for a, b in zip(sps["ddptrain"], sps["1x2"])])
    note = (
        f"samples/s: 2 ranks {summary(sps['ddptrain'])['median']:.0f}, 1x1 {summary(sps['1x1'])['median']:.0f}, "
        f"1x2 {summary(sps['1x2'])['median']:.0f}"
    )
    return [
        Row(
            "scaling",
            "2 ranks x 1 thread vs 2 x (1 rank x 1 thread)",
            linear,
            "of linear",
            ">= 0.85",
            linear["median"] >= 0.85,
            note,
        ),
        Row(
            "scaling",
            "2 ranks x 1 thread vs 1 process x 2 threads",
            vs_threads,
            "x",
            ">= 0.90",
            vs_threads["median"] >= 0.90,
        ),
    ]


def _peers(sps: dict[str, list[float]]) -> list[Row]:
    rows = []
    for peer, ok in peers_available().items():
        if not ok:
            rows.append(
                Row(
                    "peers",
                    f"ddptrain vs {peer}",
                    None,
                    target=">= 1 within spread",
                    note=f"skipped: {peer} not installed (pip install -e '.[bench]')",
                )
            )
            continue
        s = summary([a / b for a, b in zip(sps["ddptrain"], sps[peer])])
        # Met when ddptrain is at least as fast within the spread: the best round ratio reaches 1.
        rows.append(
            Row(
                "peers",
                f"samples/s ddptrain / {peer}, 2 ranks",
                s,
                "x",
                ">= 1 within spread",
                s["max"] >= 1.0,
                f"{peer}: {summary(sps[peer])['median']:.0f} samples/s",
            )
        )
    return rows
