"""Checkpoint cost: ddptrain's Checkpointer (sync and async) vs torch.save + fsync of the same state.

One process, the default model and a ~100 MB-of-state model, each after one optimizer step (so the
AdamW moments exist). Per round, interleaved: torch.save + fsync into one file; a sync save; an
async save (the time the loop is blocked; then it is waited for, untimed); loading each back.
Saves go to runs/bench on the repository's disk, so fsync reaches the device; loads read files
that were just written (warm page cache), as a resume on the same node would.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bench.build import DEFAULT_MODEL, LARGE_MODEL, SMOKE_MODEL, bench_config, build_trainer
from bench.common import Options, Row, interleave, summary
from ddptrain.checkpoint import Checkpointer, verify_checkpoint
from ddptrain.config import Config
from ddptrain.dist import DistContext
from ddptrain.train.rng import load_rng_state, rng_state
from ddptrain.train.trainer import Trainer


class _Bench:
    """The variants of one model, sharing one trained Trainer."""

    def __init__(self, trainer: Trainer, cfg: Config, folder: Path) -> None:
        self.trainer, self.folder = trainer, folder
        ctx = DistContext()
        config = cfg.model_dump(mode="json", by_alias=True)
        self.sync = Checkpointer(
            cfg.ckpt.model_copy(update={"async_save": False, "keep": 2}), folder / "sync", ctx, config
        )
        self.async_ = Checkpointer(
            cfg.ckpt.model_copy(update={"async_save": True, "keep": 2}), folder / "async", ctx, config
        )
        self.file = folder / "torch-save.pt"
        self.n = 0
        self.last_sync: Path | None = None
        self.async_total: list[float] = []

    def torch_save(self) -> float:
        t0 = time.perf_counter()
        with open(self.file, "wb") as f:
            torch.save({"state": self.trainer.state_dict(), "rng": rng_state()}, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def _save(self, ckpt: Checkpointer) -> float:
        self.n += 1
        t0 = time.perf_counter()
        ckpt.save(self.n, self.trainer.state_dict(), {"rng": rng_state()})  # what Trainer.save_checkpoint does
        blocked = time.perf_counter() - t0
        ckpt.wait()  # untimed; also joins the prune behind the commit, so it never overlaps the next variant
        (result,) = ckpt.finished()
        assert result.ok and result.path is not None, result.error
        if ckpt is self.sync:
            self.last_sync = result.path
        else:
            self.async_total.append(result.total_s)
        return blocked

    def save_sync(self) -> float:
        return self._save(self.sync)

    def save_async(self) -> float:
        return self._save(self.async_)

    def load_ddptrain(self) -> float:
        assert self.last_sync is not None
        t0 = time.perf_counter()
        self.trainer.resume(verify_checkpoint(self.last_sync))
        return time.perf_counter() - t0

    def load_torch(self) -> float:
        t0 = time.perf_counter()
        saved = torch.load(self.file, map_location="cpu", weights_only=True)
        self.trainer.load_state_dict(saved["state"])
        load_rng_state(saved["rng"])
        return time.perf_counter() - t0

    def profile_sync_save(self) -> list[str]:
        """The top functions of one sync save by own time (cProfile), for docs/benchmarks.md."""
        prof = cProfile.Profile()
        prof.enable()
        self.save_sync()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(8)
        return [line for line in out.getvalue().splitlines() if line.strip()][-9:]


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Both models; per-round times; ratios against torch.save."""
    models = {"smoke": SMOKE_MODEL} if opts.smoke else {"default": DEFAULT_MODEL, "~100 MB": LARGE_MODEL}
    rows: list[Row] = []
    data: dict[str, Any] = {}
    for label, model in models.items():
        folder = opts.work_dir / "checkpoint" / label.replace(" ", "").replace("~", "")
        # A previous run's higher step numbers would make keep= prune this run's checkpoints.
        shutil.rmtree(folder, ignore_errors=True)
        cfg = bench_config(model, opts.data_dir, folder)
        trainer = build_trainer(cfg, DistContext())
        trainer.train_step()  # AdamW state now exists
        b = _Bench(trainer, cfg, folder)
        b.save_sync()  # the load variants need a checkpoint from the start
        t = interleave(
            {
                "torch.save+fsync": b.torch_save,
                "sync": b.save_sync,
                "async": b.save_async,
                "torch.load": b.load_torch,
                "ddptrain load": b.load_ddptrain,
            },
            opts,
        )
        mb = b.file.stat().st_size / 1e6
        speed = summary([a / s for a, s in zip(t["torch.save+fsync"], t["sync"])])
        async_share = summary([a / s for a, s in zip(t["async"], t["sync"])])
        load = summary([a / s for a, s in zip(t["torch.load"], t["ddptrain load"])])
        ms = {k: summary(v)["median"] * 1000 for k, v in t.items()}
        rows += [
            Row(
                "checkpoint",
                f"sync save speed vs torch.save+fsync, {label} model ({mb:.0f} MB)",
                speed,
                "x",
                ">= 0.9",
                speed["median"] >= 0.9,
                f"sync {ms['sync']:.0f} ms, torch.save {ms['torch.save+fsync']:.0f} ms",
            ),
            Row(
                "checkpoint",
                f"async blocked time / sync, {label} model",
                async_share,
                "x",
                "<= 0.2",
                async_share["median"] <= 0.2,
                f"async blocks {ms['async']:.0f} ms, commits after {summary(b.async_total)['median'] * 1000:.0f} ms",
            ),
            Row(
                "checkpoint",
                f"load speed vs torch.load, {label} model (verify + restore)",
                load,
                "x",
                "reported",
                None,
                f"ddptrain {ms['ddptrain load']:.0f} ms, torch.load {ms['torch.load']:.0f} ms",
            ),
        ]
        data[label] = {
            "seconds": t,
            "state_MB": mb,
            "async_total_s": b.async_total,
            "sync_save_profile": b.profile_sync_save(),
        }
        trainer.metrics.close()
    return rows, data
