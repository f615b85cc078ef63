"""`ddptrain report RUN_DIR`: plots and a short summary from a run's metrics.jsonl.

Works while the run is going and after it crashed: a last line cut off mid-write is skipped.
Writes run.dir/report/{loss,lr,throughput,step_time}.png and summary.txt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from ddptrain.checkpoint import committed_checkpoints  # noqa: E402
from ddptrain.errors import DataError  # noqa: E402

_PHASES = ("data_wait_s", "forward_s", "backward_s", "optimizer_s")


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(records, last line was cut off). DataError when missing, empty or malformed before the end."""
    if not path.is_file():
        raise DataError(f"no metrics file at {path}: is this a run folder (run.dir)?")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records, truncated = [], False
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "kind" not in record:
                raise ValueError("not a metrics record (a JSON object with a 'kind')")
        except ValueError as e:
            if i == len(lines):  # the run died while writing its last line
                truncated = True
                break
            raise DataError(f"{path} line {i} is malformed ({e}); only a cut-off last line is tolerated") from None
        records.append(record)
    if not any(r["kind"] == "train" for r in records):
        what = "is empty" if not records else "has no training records yet"
        raise DataError(f"{path} {what}: nothing to report (training logs every log.every_steps steps)")
    return records, truncated


def _of(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _restart_steps(records: list[dict[str, Any]]) -> list[int]:
    return [r["step"] for r in _of(records, "event") if r.get("event") == "resume"]


def _figure(title: str, records: list[dict[str, Any]]) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=80)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    for i, step in enumerate(_restart_steps(records)):
        ax.axvline(step, color="grey", linestyle=":", label="resume" if i == 0 else None)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_all(records: list[dict[str, Any]], out: Path) -> list[Path]:
    """The four PNGs: loss (and val loss), learning rate, throughput (and MFU), per-rank step time."""
    train, evals, ranks = _of(records, "train"), _of(records, "eval"), _of(records, "ranks")
    paths = []

    fig, ax = _figure("loss", records)
    ax.plot(*_series(train, "loss"), label="train loss")
    if evals:
        ax.plot(*_series(evals, "val_loss"), "o-", label="val loss")
    ax.legend()
    paths.append(_save(fig, out / "loss.png"))

    fig, ax = _figure("learning rate", records)
    ax.plot(*_series(train, "lr"))
    paths.append(_save(fig, out / "lr.png"))

    key = "tokens_per_s" if any("tokens_per_s" in r for r in train) else "samples_per_s"
    fig, ax = _figure("throughput", records)
    ax.plot(*_series(train, key), label=key.replace("_per_s", "/s"))
    ax.set_ylabel(key.replace("_per_s", "/s"))
    if any("mfu" in r for r in train):
        twin = ax.twinx()
        steps, values = _series(train, "mfu")
        twin.plot(steps, [100 * v for v in values], color="tab:orange", label="MFU")
        twin.set_ylabel("MFU (%)", color="tab:orange")
    paths.append(_save(fig, out / "throughput.png"))

    fig, ax = _figure("step time", records)
    ax.plot(*_series(train, "step_time_s"), color="black", label="step (all ranks)")
    if ranks:
        for r in range(len(ranks[-1]["local_step_s"])):
            rows = [x for x in ranks if r < len(x["local_step_s"])]
            ax.plot([x["step"] for x in rows], [x["local_step_s"][r] for x in rows], "o-", label=f"rank {r} local")
    else:
        for phase in _PHASES:
            ax.plot(*_series(train, phase), label=phase.removesuffix("_s"))
    ax.set_ylabel("seconds")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "step_time.png"))
    return paths


def _num(value: Any) -> str:
    # Non-finite losses are stored as strings ("nan"): show them as they are.
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def _max_steps(run_dir: Path) -> int | None:
    try:
        return int(yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def summarize(run_dir: Path, records: list[dict[str, Any]], truncated: bool) -> str:
    """The text summary: status, steps, losses, throughput, MFU, time split, memory, restarts, checkpoints."""
    train, evals, events, ranks = (_of(records, k) for k in ("train", "eval", "event", "ranks"))
    last = train[-1]
    max_steps = _max_steps(run_dir)
    stopped = [e for e in events if e.get("event") == "stopped"]
    if stopped:
        status = f"stopped at step {stopped[-1]['step']}: {stopped[-1].get('reason', '?')}"
    elif max_steps is not None and last["step"] >= max_steps:
        status = f"finished ({max_steps} steps)"
    else:
        age = time.time() - records[-1].get("time", time.time())
        status = f"incomplete: still running or crashed (last record {age:.0f}s ago, step {last['step']} of {max_steps or '?'})"
    lines = [f"run: {run_dir}", f"status: {status}" + ("; the last line was cut off mid-write" if truncated else ""),
             f"steps: {last['step']} (world size {last.get('world_size', '?')}, global batch {last.get('global_batch_size', '?')})",
             f"loss: {_num(train[0]['loss'])} at step {train[0]['step']} -> {_num(last['loss'])} at step {last['step']}"]
    val = [e for e in evals if isinstance(e.get("val_loss"), (int, float))]
    if val:
        best = min(val, key=lambda e: e["val_loss"])
        lines.append(f"best val loss: {best['val_loss']:.4f} at step {best['step']} (last {val[-1]['val_loss']:.4f})")
    # The first window carries start-up costs (allocation, kernel selection): left out of the means.
    steady = train[1:] or train
    key = "tokens_per_s" if "tokens_per_s" in last else "samples_per_s"
    lines.append(f"throughput: {fmean(r[key] for r in steady):,.0f} {key.replace('_per_s', '/s')} mean "
                 f"over {len(steady)} log windows (first window left out as warm-up)")
    if any("mfu" in r for r in steady):
        lines.append(f"MFU: {100 * fmean(r['mfu'] for r in steady if 'mfu' in r):.1f}% mean")
    elif any("flops_per_s_per_device" in r for r in steady):
        flops = fmean(r["flops_per_s_per_device"] for r in steady if "flops_per_s_per_device" in r)
        lines.append(f"MFU: n/a (device peak unknown); achieved {flops / 1e9:,.2f} GFLOP/s per device")
    phases = {p: fmean(r[p] for r in steady if p in r) for p in (*_PHASES, "exposed_comm_s") if any(p in r for r in steady)}
    if phases:
        step_s = fmean(r["step_time_s"] for r in steady)
        split = ", ".join(f"{p.removesuffix('_s')} {1000 * v:.1f} ms" for p, v in phases.items())
        lines.append(f"step time: {1000 * step_s:.1f} ms mean; {split}")
    if "peak_mem_mb" in last:
        lines.append(f"peak memory: {last['peak_mem_mb']:,.0f} MiB ({last.get('peak_mem_kind', '?')}, rank 0)")
    starts = [e for e in events if e.get("event") in ("start", "resume")]
    resumed = [e["step"] for e in starts if e.get("event") == "resume"]
    lines.append(f"restarts: {max(len(starts) - 1, 0)}" + (f" (resumed at step {', '.join(map(str, resumed))})" if resumed else ""))
    saved = [e for e in events if e.get("event") == "checkpoint"]
    failed = [e for e in events if e.get("event") == "checkpoint_failed"]
    present = [p.name for p in committed_checkpoints(run_dir / "checkpoints")]
    lines.append(f"checkpoints: {len(saved)} committed during the run" + (f", {len(failed)} failed" if failed else "")
                 + f"; on disk now: {', '.join(present) or 'none'}")
    if ranks:
        flagged = [r for r in ranks if "straggler_rank" in r]
        who = sorted({f"rank {r['straggler_rank']} on {r['straggler_host']}" for r in flagged})
        lines.append(f"stragglers: flagged in {len(flagged)} of {len(ranks)} checks" + (f" ({'; '.join(who)})" if who else ""))
    return "\n".join(lines)


def report(run_dir: Path, out: Path | None = None) -> tuple[str, list[Path]]:
    """Write the plots and summary.txt into out (default run_dir/report); returns (summary, files)."""
    records, truncated = read_records(run_dir / "metrics.jsonl")
    out = out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run_dir, records, truncated)
    (out / "summary.txt").write_text(summary + "\n")
    return summary, [*plot_all(records, out), out / "summary.txt"]
