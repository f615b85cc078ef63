"""`ddptrain report RUN_DIR`: plots and a short summary from a run's metrics.jsonl.

Works while the run is going and after it crashed: a last line cut off mid-write is skipped.
Writes run.dir/report/{loss,lr,throughput,step_time,goodput}.png and summary.txt, mixture.png for a
mixture of data sources (each source's share of every log window's samples), and a
metric-<name>.png per metric of your own (train/custom_metrics.py: the names a train record lists in
`custom_metrics`, and the val_<name> of evaluations). A run that was
restarted is told as one story (review/story.py): records of abandoned attempts are dropped,
restarts, resumes, world-size changes, skipped steps, failed saves and how each attempt ended
(completed, finished early, interrupted, preempted, stopped, crashed: observe/endings.py), or an in-place job's
group failures, restarts and evictions (review/groups.py), are marked on every plot, each kind in a colour and marker of its own with a legend, and listed with their times;
throughput is given per world-size segment, and the goodput figure shows where the wall time went.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

from ddptrain.checkpoint import committed_checkpoints  # noqa: E402
from ddptrain.data.mixture import SOURCE_VAL_LOSS  # noqa: E402
from ddptrain.errors import ConfigError, DataError  # noqa: E402
from ddptrain.review.diagnostic_events import (  # noqa: E402
    diagnostic_events,
    draw_diagnostic_events,
    summarize_diagnostic_events,
)
from ddptrain.review.groups import GroupStory, group_lines, in_place_groups  # noqa: E402
from ddptrain.review.membership import membership_report  # noqa: E402
from ddptrain.review.records import PHASES, read_records  # noqa: E402
from ddptrain.review.story import Goodput, Story, goodput, tell  # noqa: E402
from ddptrain.run_folder import checkpoints_dir, metrics_file, read_config_sections, report_dir  # noqa: E402
from ddptrain.safe_files import ensure_dir, replacing, write_text_replace  # noqa: E402

__all__ = ["EVENT_STYLE", "event_marks", "read_records", "report"]


def _of(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


# How each kind of event is drawn on every plot: colour, line style, marker. Each way an attempt
# ends (observe/endings.py) has a colour and a marker of its own.
EVENT_STYLE = {
    "completed": ("darkgreen", "-", "*"),
    "finished_early": ("tab:olive", "-", "p"),
    "interrupted": ("tab:cyan", "-.", "P"),
    "preempted": ("tab:orange", "-.", "s"),
    "stopped": ("tab:pink", ":", "h"),
    "crashed": ("tab:red", "-", "X"),
    "resume": ("tab:green", "--", "v"),
    "world size": ("tab:purple", "-", "D"),
    "skipped steps": ("tab:brown", ":", "o"),
    "save failed": ("black", "--", "x"),
    # an in-place job's replica groups (review/groups.py)
    "group failed": ("firebrick", "-", "X"),
    "group evicted": ("darkorange", "-", "x"),
    "group restart": ("seagreen", "--", "v"),
    "group joined": ("tab:blue", ":", "^"),
    "group left": ("tab:gray", ":", "v"),
}
_OTHER_STYLE = ("grey", ":", ".")


@dataclass(frozen=True)
class Mark:
    """One event as the plots draw it: at its step, `height` (axes fraction) under the top, in its kind's style."""

    step: int
    kind: str
    label: str
    colour: str
    style: str
    marker: str
    height: float


def event_marks(story: Story) -> list[Mark]:
    """The marks every plot draws: one per event kind and step, stacked downwards when several share a step."""
    marks: list[Mark] = []
    seen: dict[int, list[str]] = {}
    for e in story.events:
        if e.kind == "recovery":
            continue  # a timing, told in summary.txt; its restart is already marked as "resume"
        kinds = seen.setdefault(e.step, [])
        if e.kind in kinds:
            continue
        kinds.append(e.kind)
        colour, style, marker = EVENT_STYLE.get(e.kind, _OTHER_STYLE)
        label = e.detail if e.kind == "world size" else e.kind
        marks.append(Mark(e.step, e.kind, label, colour, style, marker, 1.0 - 0.07 * (len(kinds) - 1)))
    return marks


@dataclass(frozen=True)
class RunInfo:
    """What the plot titles say about the run."""

    name: str
    world_sizes: list[int]
    global_batch: Any

    def title(self, what: str) -> str:
        """'<what> - run NAME, world size 2 -> 1, global batch 32'."""
        sizes = " -> ".join(str(w) for w in self.world_sizes) or "?"
        return f"{what} - run {self.name}, world size {sizes}, global batch {self.global_batch}"


def _run_info(run_dir: Path, story: Story) -> RunInfo:
    sizes = [ws for ws, *_ in segments(story)]  # the ranks of the steps (in the in-place mode: all groups')
    train = _of(story.kept, "train")
    name = run_dir.name
    try:
        name = str(read_config_sections(run_dir)["run"]["name"])
    except (ConfigError, KeyError, TypeError):
        pass
    return RunInfo(name, sizes, train[-1].get("global_batch_size", "?") if train else "?")


def _figure(what: str, info: RunInfo, story: Story, ylabel: str) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    ax.set_title(info.title(what), fontsize=11)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    draw_diagnostic_events(ax, diagnostic_events(story.kept))  # straggler, slow-communication and hang episodes
    return fig, ax


def _mark_events(ax: Any, story: Story) -> list[Any]:
    """Draw every mark (a vertical line per step in its first event's style, a marker and a name per
    event); returns one legend handle per event kind drawn."""
    handles: dict[str, Any] = {}
    lined: set[int] = set()
    for m in event_marks(story):
        if m.step not in lined:
            lined.add(m.step)
            ax.axvline(m.step, color=m.colour, linestyle=m.style, linewidth=1.2, alpha=0.8)
        (handle,) = ax.plot(
            [m.step],
            [m.height],
            marker=m.marker,
            color=m.colour,
            markersize=9,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            linestyle="none",
        )
        ax.annotate(
            m.label,
            (m.step, m.height),
            xycoords=ax.get_xaxis_transform(),
            xytext=(7, 0),
            textcoords="offset points",
            color=m.colour,
            fontsize=8,
            va="center",
            ha="left",
        )
        handles.setdefault(m.kind, handle)
    for kind, handle in handles.items():
        handle.set_label(kind)
    return list(handles.values())


def _save(fig: Any, ax: Any, story: Story, path: Path) -> Path:
    marks = _mark_events(ax, story)
    handles = [h for h in ax.get_legend_handles_labels()[0] if h not in marks] + marks
    if handles:
        ax.legend(handles=handles, fontsize="small", loc="best")
    fig.tight_layout()
    return _write_png(fig, path)


def _write_png(fig: Any, path: Path) -> Path:
    """Render into a fresh temp file, then rename over path: a link planted at path is replaced, never followed."""
    try:
        with replacing(path) as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)
    return path


def segments(story: Story) -> list[tuple[int, int, int, list[dict[str, Any]]]]:
    """(world size, first step, last step, train records) per stretch of kept records at one world size."""
    out: list[tuple[int, int, int, list[dict[str, Any]]]] = []
    for r in _of(story.kept, "train"):
        ws = int(r.get("world_size", 0))
        if out and out[-1][0] == ws:
            out[-1][3].append(r)
            out[-1] = (ws, out[-1][1], r["step"], out[-1][3])
        else:
            out.append((ws, r["step"], r["step"], [r]))
    return out


def custom_metric_names(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[str]:
    """The metrics of the run's own: listed by its train records, or recorded by its evaluations as val_<name>."""
    names = {str(n) for r in train for n in r.get("custom_metrics", [])}
    names |= {
        k.removeprefix("val_")
        for e in evals
        for k in e
        if k.startswith("val_") and k != "val_loss" and not k.startswith(SOURCE_VAL_LOSS)
    }
    return sorted(names)


def source_val_names(evals: list[dict[str, Any]]) -> list[str]:
    """The sources of a mixture whose own val loss the evaluations recorded (`val_loss/<name>`), in order."""
    return list(
        dict.fromkeys(k.removeprefix(SOURCE_VAL_LOSS) for e in evals for k in e if k.startswith(SOURCE_VAL_LOSS))
    )


def mixture_shares(mixed: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per source of a mixture: (step, % of the samples of the log window ending there), from the cumulative
    `source_samples` of logged steps (data/mixture.py)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    previous: dict[str, int] = {}
    for r in mixed:
        taken = {str(k): int(v) for k, v in r["source_samples"].items()}
        window = {k: v - previous.get(k, 0) for k, v in taken.items()}
        total = sum(window.values())
        if total > 0:
            for name, n in window.items():
                steps, shares = out.setdefault(name, ([], []))
                steps.append(int(r["step"]))
                shares.append(100 * n / total)
        previous = taken
    return out


def _mixture_line(train: list[dict[str, Any]]) -> list[str]:
    last = next((r for r in reversed(train) if isinstance(r.get("source_samples"), dict)), None)
    if last is None:
        return []
    total = sum(last["source_samples"].values()) or 1
    parts = ", ".join(f"{k} {v:,} ({100 * v / total:.1f}%)" for k, v in last["source_samples"].items())
    return [f"data mixture: {parts} by step {last['step']}"]


def _diloco_line(train: list[dict[str, Any]]) -> list[str]:
    """DiLoCo's groups, outer syncs, their bytes and the time the steps spent blocked in them (train/sync/diloco.py)."""
    synced = [r for r in train if isinstance(r.get("outer_syncs"), int)]
    if not synced:
        return []
    last, blocked = synced[-1], sum(float(r.get("outer_sync_s", 0.0)) for r in synced)
    return [
        f"DiLoCo: {last.get('diloco_groups', '?')} groups, {last['outer_syncs']} outer syncs by step {last['step']} "
        f"({last.get('outer_sync_bytes', 0) / 1e6:.4g} MB sent each), {blocked:,.2f} s blocked in them"
    ]


def _throughput_key(train: list[dict[str, Any]]) -> str:
    return "tokens_per_s" if any("tokens_per_s" in r for r in train) else "samples_per_s"


def plot_all(run_dir: Path, story: Story, out: Path) -> list[Path]:
    """The PNGs: loss, learning rate, throughput per world-size segment, step time, goodput."""
    train, evals, ranks = _of(story.kept, "train"), _of(story.kept, "eval"), _of(story.kept, "ranks")
    info = _run_info(run_dir, story)
    paths = []

    fig, ax = _figure("loss", info, story, "loss (mean over the log window)")
    ax.plot(*_series(train, "loss"), label="train loss")
    if evals:
        ax.plot(*_series(evals, "val_loss"), "o-", label="val loss")
        for name in source_val_names(evals):  # a mixture: each source's own
            ax.plot(*_series(evals, f"{SOURCE_VAL_LOSS}{name}"), ".--", label=f"val loss {name}")
    paths.append(_save(fig, ax, story, out / "loss.png"))

    fig, ax = _figure("learning rate", info, story, "learning rate")
    ax.plot(*_series(train, "lr"), label="lr")
    paths.append(_save(fig, ax, story, out / "lr.png"))

    key = _throughput_key(train)
    unit = key.replace("_per_s", "/s")
    fig, ax = _figure("throughput", info, story, f"{unit}, global (all ranks)")
    for i, (ws, first, last, rows) in enumerate(segments(story)):
        (line,) = ax.plot(*_series(rows, key), color=f"C{i % 10}", label=f"world size {ws}, steps {first}-{last}")
        steady = rows[1:] or rows  # the first window of a segment carries start-up costs
        mean = fmean(r[key] for r in steady if key in r) if any(key in r for r in steady) else None
        if mean is not None:
            ax.hlines(mean, first, last, colors=line.get_color(), linestyles="--", linewidth=1)
    if any("mfu" in r for r in train):
        twin = ax.twinx()
        steps, values = _series(train, "mfu")
        twin.plot(steps, [100 * v for v in values], color="tab:gray", alpha=0.6)
        twin.set_ylabel("MFU (%)", color="tab:gray")
    paths.append(_save(fig, ax, story, out / "throughput.png"))

    fig, ax = _figure("step time", info, story, "seconds per optimizer step")
    ax.plot(*_series(train, "step_time_s"), color="black", label="step (all ranks)")
    if ranks:
        for r in range(len(ranks[-1]["local_step_s"])):
            rows = [x for x in ranks if r < len(x["local_step_s"])]
            ax.plot([x["step"] for x in rows], [x["local_step_s"][r] for x in rows], "o-", label=f"rank {r} local")
    else:
        for phase in PHASES:
            ax.plot(*_series(train, phase), label=phase.removesuffix("_s"))
    paths.append(_save(fig, ax, story, out / "step_time.png"))

    paths.append(_plot_goodput(info, goodput(story), out / "goodput.png"))
    mixed = [r for r in train if isinstance(r.get("source_samples"), dict)]
    if mixed:
        fig, ax = _figure("data mixture", info, story, "share of the window's samples (%)")
        for name, (steps, shares) in mixture_shares(mixed).items():
            ax.plot(steps, shares, "o-", label=name)
        paths.append(_save(fig, ax, story, out / "mixture.png"))
    for name in custom_metric_names(train, evals):
        fig, ax = _figure(name, info, story, f"{name} (mean over the log window)")
        ax.plot(*_series(train, name), label=f"train {name}")
        ax.plot(*_series(evals, f"val_{name}"), "o-", label=f"val {name}")
        paths.append(_save(fig, ax, story, out / f"metric-{name}.png"))
    return paths


def _plot_goodput(info: RunInfo, g: Goodput, path: Path) -> Path:
    """One horizontal bar of the wall time, split into productive step time and each loss."""
    fig, ax = plt.subplots(figsize=(10, 3.2), dpi=100)
    parts = [("productive steps", g.productive_s), *g.lost.items()]
    colours = ["tab:green", "tab:red", "tab:orange", "tab:purple", "tab:gray"]
    left = 0.0
    for (what, seconds), colour in zip(parts, colours):
        ax.barh([0], [seconds], left=left, color=colour, label=f"{what}: {seconds:,.1f} s")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds of wall time, first start to last record")
    ax.set_title(info.title(f"goodput {100 * g.ratio:.1f}%"), fontsize=11)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    fig.tight_layout()
    return _write_png(fig, path)


def _num(value: Any) -> str:
    # Non-finite losses are stored as strings ("nan"): show them as they are.
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def _max_steps(run_dir: Path) -> int | None:
    try:
        return int(read_config_sections(run_dir)["train"]["max_steps"])
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


def _clock(t: float, t0: float) -> str:
    return f"{time.strftime('%H:%M:%S', time.gmtime(t))} UTC (+{t - t0:,.0f} s)"


def _status(records: list[dict[str, Any]], story: Story, last_step: int, max_steps: int | None) -> str:
    """How the run stands: how its last attempt ended, or that it may still be running."""
    ending = story.endings[-1]
    if ending.kind == "completed":
        return f"finished ({max_steps} steps)" if max_steps is not None else f"finished at step {last_step}"
    if ending.recorded:
        again = "; run the same command again to resume" if ending.kind in ("interrupted", "preempted") else ""
        return ending.detail + again
    age = time.time() - records[-1].get("time", time.time())
    return f"incomplete: still running or crashed (last record {age:.0f}s ago, step {last_step} of {max_steps or '?'})"


def _checkpoint_lines(run_dir: Path, events: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> list[str]:
    """Checkpoints committed, failed and on disk; how often the straggler checks flagged a rank."""
    lines = []
    saved = [e for e in events if e.get("event") == "checkpoint"]
    failed = [e for e in events if e.get("event") == "checkpoint_failed"]
    present = [p.name for p in committed_checkpoints(checkpoints_dir(run_dir))]
    lines.append(
        f"checkpoints: {len(saved)} committed during the run"
        + (f", {len(failed)} failed" if failed else "")
        + f"; on disk now: {', '.join(present) or 'none'}"
    )
    if ranks:
        flagged = [r for r in ranks if "straggler_rank" in r]
        # A record's fields are what a version wrote, or what a damaged file kept: a flag without its host still counts.
        who = sorted({f"rank {r['straggler_rank']} on {r.get('straggler_host', 'an unknown host')}" for r in flagged})
        lines.append(
            f"stragglers: flagged in {len(flagged)} of {len(ranks)} checks" + (f" ({'; '.join(who)})" if who else "")
        )
    return lines


def _attempt_lines(story: Story, groups: GroupStory | None) -> list[str]:
    """How each attempt ended, one line each (a crash without an end record says what may have killed it); an
    in-place job's groups: their failures, restarts and evictions, and how the job ended."""
    if groups is not None:
        return group_lines(groups, story.endings[-1].detail)
    lines = [f"attempts: {', '.join(e.kind for e in story.endings)}"]
    for i, (attempt, ending) in enumerate(zip(story.attempts, story.endings), 1):
        what = (
            ending.detail
            if ending.detail.startswith(ending.kind.replace("_", " "))
            else f"{ending.kind}: {ending.detail}"
        )
        lines.append(
            f"  attempt {i} from step {attempt.start.get('step', 0)} at world size {attempt.world_size}: {what}"
        )
    return lines


def _metric_lines(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[str]:
    """Per metric of the run's own: its first and last logged value, and its last evaluation."""
    lines = []
    for name in custom_metric_names(train, evals):
        parts = []
        steps, values = _series(train, name)
        if steps:
            parts.append(f"{_num(values[0])} at step {steps[0]} -> {_num(values[-1])} at step {steps[-1]}")
        steps, values = _series(evals, f"val_{name}")
        if steps:
            parts.append(f"val {_num(values[-1])} at step {steps[-1]}")
        lines.append(f"{name}: {'; '.join(parts)}")
    return lines


def _throughput_lines(story: Story, key: str) -> list[str]:
    """Throughput per world-size segment (its first log window left out as warm-up), MFU, the step time's split."""
    lines = [f"throughput ({key.replace('_per_s', '/s')}, global; first window of each segment left out as warm-up):"]
    for ws, first, last_step, rows in segments(story):
        steady = [r for r in (rows[1:] or rows) if key in r]
        mean = f"{fmean(r[key] for r in steady):,.0f}" if steady else "n/a"
        step_ms = 1000 * fmean(r["step_time_s"] for r in steady) if steady else float("nan")
        lines.append(
            f"  world size {ws}, steps {first}-{last_step}: {mean} mean over {len(steady)} log windows, "
            f"{step_ms:.1f} ms per step"
        )
    steady_all = [r for _, _, _, rows in segments(story) for r in (rows[1:] or rows)]
    if any("mfu" in r for r in steady_all):
        lines.append(f"MFU: {100 * fmean(r['mfu'] for r in steady_all if 'mfu' in r):.1f}% mean")
    elif any("flops_per_s_per_device" in r for r in steady_all):
        flops = fmean(r["flops_per_s_per_device"] for r in steady_all if "flops_per_s_per_device" in r)
        lines.append(f"MFU: n/a (device peak unknown); achieved {flops / 1e9:,.2f} GFLOP/s per device")
    phases = {
        p: fmean(r[p] for r in steady_all if p in r)
        for p in (*PHASES, "exposed_comm_s")
        if any(p in r for r in steady_all)
    }
    if phases:
        split = ", ".join(f"{p.removesuffix('_s')} {1000 * v:.1f} ms" for p, v in phases.items())
        lines.append(f"step time split: {split}")
    return lines


def summarize(
    run_dir: Path, records: list[dict[str, Any]], truncated: bool, story: Story, groups: GroupStory | None = None
) -> str:
    """The text summary: status, steps, losses, throughput per segment, goodput, events with times, checkpoints."""
    kept = story.kept
    train, evals, events, ranks = (_of(kept, k) for k in ("train", "eval", "event", "ranks"))
    last = train[-1]
    max_steps = _max_steps(run_dir)
    status = _status(records, story, last["step"], max_steps)
    info = _run_info(run_dir, story)
    sizes = " -> ".join(map(str, info.world_sizes)) or "?"
    cut_off = "; the last line was cut off mid-write" if truncated else ""
    who = f"{len(groups.groups)} replica group(s) in place" if groups else f"{len(story.attempts)} attempt(s)"
    lines = [
        f"run: {info.name} ({run_dir})",
        f"status: {status}{cut_off}",
        f"steps: {last['step']} (world size {sizes}, global batch {last.get('global_batch_size', '?')}; {who})",
        f"loss: {_num(train[0]['loss'])} at step {train[0]['step']} -> {_num(last['loss'])} at step {last['step']}",
    ]
    lines += _attempt_lines(story, groups)
    val = [e for e in evals if isinstance(e.get("val_loss"), (int, float))]
    if val:
        best = min(val, key=lambda e: e["val_loss"])
        lines.append(f"best val loss: {best['val_loss']:.4f} at step {best['step']} (last {val[-1]['val_loss']:.4f})")
    lines += _metric_lines(train, evals)
    lines += _mixture_line(train)
    lines += _diloco_line(train)
    lines += _throughput_lines(story, _throughput_key(train))
    if "peak_mem_mb" in last:
        lines.append(f"peak memory: {last['peak_mem_mb']:,.0f} MiB ({last.get('peak_mem_kind', '?')}, rank 0)")
    g = goodput(story)
    lost = "; ".join(f"{what} {seconds:,.1f} s" for what, seconds in g.lost.items())
    lines.append(
        f"goodput: {100 * g.ratio:.1f}% ({g.productive_s:,.1f} s of productive steps in {g.wall_s:,.1f} s "
        f"wall time); lost: {lost}" + (f" ({story.redone_steps} steps re-done)" if story.redone_steps else "")
    )
    t0 = min((float(r["time"]) for r in records if "time" in r), default=0.0)
    lines.append(f"events: {len(story.events) or 'none'}")
    for e in story.events:
        lines.append(f"  {_clock(e.time, t0)}  step {e.step:>6}  {e.kind}: {e.detail}")
    lines += _checkpoint_lines(run_dir, events, ranks)
    lines += summarize_diagnostic_events(diagnostic_events(records))
    return "\n".join(lines)


def report(run_dir: Path, out: Path | None = None) -> tuple[str, list[Path]]:
    """Write the plots and summary.txt into out (default run_dir/report); returns (summary, files)."""
    records, truncated = read_records(metrics_file(run_dir))
    if out is None:
        out = report_dir(run_dir)
        try:
            ensure_dir(out, run_dir)  # a link planted as run.dir/report is refused, never followed
        except OSError as e:
            raise DataError(f"cannot write the report into {out}: {e.strerror or e}") from None
    else:
        out.mkdir(parents=True, exist_ok=True)  # the user's own --out: where they point it
    max_steps = _max_steps(run_dir)
    last_train = _of(records, "train")[-1]["step"]
    story = tell(records, finished=max_steps is not None and last_train >= max_steps)
    groups = in_place_groups(records, story)  # an in-place job: its groups' failures, restarts, evictions
    in_place, drawn = membership_report(records, out)  # in-place runs: quorum changes, heals, step goodput
    summary = summarize(run_dir, records, truncated, story, groups) + in_place
    write_text_replace(out / "summary.txt", summary + "\n")  # a link planted there is replaced, not followed
    return summary, [*plot_all(run_dir, story, out), *drawn, out / "summary.txt"]
