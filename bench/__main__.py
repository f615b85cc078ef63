"""`python -m bench all` runs every figure, writes bench/results/<date>.json and .md, prints the table.

python -m bench all                 # the full run (make bench), ~10 minutes on 2 cores
python -m bench overhead peers      # some figures
python -m bench all --smoke         # tiny sizes, one round: checks that everything starts
python -m bench goodput ft_overhead # only when named (root, torchft; minutes): fault tolerance
python -m bench slow_links          # only when named (root; minutes): 2 hosts on a tc tbf link
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import REPO, Options, Row, fix_threads, markdown_table

FIGURES = [
    "overhead",
    "scaling",
    "peers",
    "allreduce",
    "compression",
    "overlap",
    "checkpoint",
    "checkpoint_ranks",
    "hashes",
    "replicas",
    "certificate",
    "fsdp",
    "lora",
    "data",
    "tracking",
    "prepare",
]
# Run only when named: they need root (namespace hosts) or torchft, and take minutes even in smoke mode.
ON_DEMAND = ["goodput", "ft_overhead", "slow_links"]


def _figures(names: list[str]) -> list[tuple[str, Callable[[Options], tuple[list[Row], dict[str, Any]]]]]:
    """(label, run) per job: the training-speed figures share one session, the others run alone."""
    from bench import training

    jobs = []
    chosen = {n for n in names if n in training.FIGURES}
    if chosen:
        jobs.append(("training (" + ", ".join(sorted(chosen)) + ")", lambda o: training.run(o, chosen)))
    for name in names:
        if name not in training.FIGURES:
            jobs.append((name, __import__(f"bench.{name}", fromlist=["run"]).run))
    return jobs


def _corpus(opts: Options) -> None:
    from ddptrain.data.corpus import corpus_ready, prepare_corpus, stdlib_sources

    if corpus_ready(opts.data_dir):
        return
    files = stdlib_sources()
    if opts.smoke:  # a few modules (~200 KB) are plenty for a handful of tiny steps
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [root / n for n in ("argparse.py", "typing.py", "inspect.py")]
    prepare_corpus(files, opts.data_dir, val_fraction=0.05)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: the CPU model, more telling than the architecture
        models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        info["processor"] = models[0] if models else info["processor"]
    for name in ("lightning", "accelerate"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def main(argv: list[str] | None = None) -> int:
    """Run the chosen figures and write the results."""
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("figures", nargs="+", choices=["all", *FIGURES, *ON_DEMAND])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round, no warm-up")
    p.add_argument("--rounds", type=int, help="measured rounds per figure (default 5; smoke 1)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for <date>.json and .md")
    p.add_argument("--fault-every", type=float, default=30.0, help="goodput: seconds between kills (default 30)")
    p.add_argument("--fault-for", type=float, default=300.0, help="goodput: seconds of the schedule (default 300)")
    p.add_argument("--warmup", type=int, help="warm-up rounds per figure, not measured (default 1; smoke 0)")
    p.add_argument("--steps", type=int, help="slow_links: steps per job (default 100)")
    p.add_argument("--rate", help="slow_links: the link rate, as tc tbf takes it (default 50mbit)")
    p.add_argument("--hosts", type=int, help="slow_links: namespace hosts of one rank each (default 2)")
    p.add_argument("--modes", help="slow_links, goodput: comma-separated modes to run (default all)")
    p.add_argument("--work-dir", type=Path, help="scratch folder (default runs/bench; smoke: OUT/work)")
    args = p.parse_args(argv)
    names = FIGURES if "all" in args.figures else list(dict.fromkeys(args.figures))
    work = args.work_dir or (args.out / "work" if args.smoke else REPO / "runs" / "bench")
    opts = Options(
        smoke=args.smoke,
        rounds=args.rounds or (1 if args.smoke else 5),
        warmup=0 if args.smoke else 1 if args.warmup is None else args.warmup,
        work_dir=work.resolve(),
        data_dir=(work / "data").resolve() if args.smoke else REPO / "data" / "stdlib",
        fault_every_s=args.fault_every,
        fault_for_s=args.fault_for,
        steps=args.steps,
        rate=args.rate,
        hosts=args.hosts,
        modes=tuple(m.strip() for m in args.modes.split(",")) if args.modes else (),
    )
    fix_threads(1)
    _corpus(opts)
    started = datetime.now(timezone.utc)
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    details: dict[str, Any] = {}
    for name, run in _figures(names):
        t0 = time.perf_counter()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        figure_rows, data = run(opts)
        rows += figure_rows
        details[name] = {**data, "wall_s": time.perf_counter() - t0}
        print(markdown_table(figure_rows), file=sys.stderr, flush=True)
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    # Other users' load is what makes figures noisy here: record it beside them.
    load = {"before": load_before, "after": os.getloadavg()[0]}
    wall = (datetime.now(timezone.utc) - started).total_seconds()
    result = {
        "date": started.isoformat(timespec="seconds"),
        "command": command,
        "machine": machine(),
        "loadavg_1min": load,
        "wall_s": wall,
        "options": {"smoke": opts.smoke, "rounds": opts.rounds, "warmup": opts.warmup},
        "rows": [r.__dict__ for r in rows],
        "figures": details,
    }
    table = markdown_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = started.strftime("%Y-%m-%dT%H%MZ") + ("-smoke" if opts.smoke else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    m = result["machine"]
    header = (
        f"`{command}` on {started:%Y-%m-%d %H:%M} UTC: {m['cpus']} CPUs ({m['processor']}), torch {m['torch']}, "
        f"Lightning {m['lightning']}, Accelerate {m['accelerate']}, "
        f"Python {m['python']}, {opts.rounds} measured rounds after {opts.warmup} warm-up, interleaved; "
        f"{wall / 60:.1f} minutes; 1-minute load average {load['before']:.1f} before, {load['after']:.1f} after.\n\n"
    )
    (args.out / f"{stem}.md").write_text(header + table + "\n")
    print(header + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
