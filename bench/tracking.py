"""Step-time cost of experiment tracking: MLflow on, MLflow unreachable, and off, interleaved.

One process builds three runs of the tiny model (ddptrain.run.build_run, as `ddptrain train` does),
identical but for log.trackers: none; MLflow against a live `mlflow server` (SQLite, on 127.0.0.1,
started here); MLflow against a port where nothing listens (the server is down for the whole
figure). Logged every step (log.every_steps=1, the worst case: a record per step goes to the
tracker queue) and every 10 (the default). A round times `STEPS` steps of each variant, in
alternating order; ratios per round. The server shares this machine's cores with training.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import sys
import time
from typing import Any

from bench.build import SMOKE_MODEL, TINY_MODEL, bench_config
from bench.common import REPO, Options, Row, interleave, summary

STEPS = 20


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Rows: on/off and down/off step-time ratios; data: per-round seconds per step."""
    if importlib.util.find_spec("mlflow") is None:
        return [Row("tracking", "MLflow on / off", None, note="skipped: pip install 'ddptrain[mlflow]'")], {}
    sys.path.insert(0, str(REPO / "tests"))  # the test suite's MLflow server harness
    from tracking_harness import MlflowServer, free_port

    from ddptrain.dist import DistContext
    from ddptrain.observe.metrics import Progress
    from ddptrain.observe.trackers.background import BackgroundTracker
    from ddptrain.run import build_run

    folder = opts.work_dir / "tracking"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "server").mkdir(parents=True)
    server = MlflowServer(folder / "server")
    if not opts.smoke:  # smoke mode checks the script, not the server: MLflow writes SQLite in-process
        server.start()
    uri = f"sqlite:///{folder / 'server' / 'smoke.db'}" if opts.smoke else server.uri
    model = SMOKE_MODEL if opts.smoke else TINY_MODEL
    up_args = ["log.trackers=[mlflow]", f"log.mlflow.tracking_uri={uri}"]
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the server is down throughout
    down_args = ["log.trackers=[mlflow]", f"log.mlflow.tracking_uri={nowhere}", "log.tracker_flush_s=0"]
    # A record every step (the worst case), and every 10 steps (the default log.every_steps).
    trackers = {
        "off": ["log.every_steps=1"],
        "mlflow": ["log.every_steps=1", *up_args],
        "mlflow down": ["log.every_steps=1", *down_args],
        "off, every 10": ["log.every_steps=10"],
        "mlflow, every 10": ["log.every_steps=10", *up_args],
    }
    runs = {}
    try:
        for name, extra in trackers.items():
            cfg = bench_config(
                model,
                opts.data_dir,
                folder / name.replace(" ", "-").replace(",", ""),
                ["log.mlflow.experiment=bench", *extra],
            )
            runs[name] = build_run(cfg, DistContext())
            runs[name].triage.close()  # steps are driven here, without the watchdog
            runs[name].trainer.progress = Progress(False, cfg.train.max_steps, 0)  # no terminal line per step

        def steps(name: str) -> float:
            trainer = runs[name].trainer
            every = trainer.cfg.log.every_steps
            began = time.perf_counter()
            for _ in range(2 if opts.smoke else STEPS):
                result = trainer.train_step()
                if trainer.step % every == 0:
                    trainer.log_train(result.loss, 1, result.seconds, result.grad_norm)
            seconds = (time.perf_counter() - began) / (2 if opts.smoke else STEPS)
            # Untimed: let this variant's tracker deliver before the next variant runs, or its
            # HTTP calls and the server's writes would be charged to whichever variant comes next.
            if name != "mlflow down":
                deadline = time.monotonic() + 60
                sinks = [s for s in runs[name].metrics.sinks if isinstance(s, BackgroundTracker)]
                while any(s.pending() for s in sinks) and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.2)  # the server's own work after the last call
            return seconds

        t = interleave({name: functools.partial(steps, name) for name in runs}, opts)
    finally:
        for r in runs.values():
            r.close()
        server.stop()
    on = summary([a / b for a, b in zip(t["mlflow"], t["off"])])
    on10 = summary([a / b for a, b in zip(t["mlflow, every 10"], t["off, every 10"])])
    down = summary([a / b for a, b in zip(t["mlflow down"], t["off"])])
    ms = {k: summary(v)["median"] * 1000 for k, v in t.items()}
    rows = [
        Row(
            "tracking",
            "step time, MLflow on / off (tiny model, a record every step)",
            on,
            "x",
            "<= 1.05",
            on["median"] <= 1.05,
            f"on {ms['mlflow']:.1f} ms, off {ms['off']:.1f} ms",
        ),
        Row(
            "tracking",
            "step time, MLflow unreachable / off (a record every step)",
            down,
            "x",
            "<= 1.05",
            down["median"] <= 1.05,
            f"down {ms['mlflow down']:.1f} ms, off {ms['off']:.1f} ms",
        ),
        Row(
            "tracking",
            "step time, MLflow on / off (a record every 10 steps)",
            on10,
            "x",
            "<= 1.05",
            on10["median"] <= 1.05,
            f"on {ms['mlflow, every 10']:.1f} ms, off {ms['off, every 10']:.1f} ms",
        ),
    ]
    return rows, {"seconds_per_step": t}
