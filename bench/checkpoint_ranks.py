"""Checkpoints written by every rank: the sharded writer vs the single writer, 2 ranks under torchrun (gloo).

One job of 2 ranks x 1 thread holds a ~100 MB state (a 6 x 352 GPT and its AdamW moments after one
step; identical on both ranks, as under DDP). Interleaved rounds, the order alternating:
- sync save, sharded and rank0-torch: the slowest rank's time from a barrier to the committed save;
- async save, both writers: the time the loop is blocked (the slowest rank's), then waited for untimed;
- verified load (read, hash, restore into the model and optimizer) of the newest sharded and
  rank0-torch checkpoints vs torch.load + restore of one torch.save file of the same state: on both
  ranks at once (a 2-rank resume on one host: the shared load split over the hosts, ckpt.load=auto,
  so each rank reads and verifies what it needs itself; the split over the ranks, ckpt.load=shared,
  each rank reading half and receiving the rest over gloo; and every rank verifying every file) and
  on rank 0 alone while rank 1 waits (one process: export, a resume at world size 1);
- bytes read from storage per resume / the checkpoint's size with the split over hosts: each file
  counted once per host whose ranks read it (they share its page cache; every rank's HashingReader
  count is checked against the plan), at 2 ranks on one host and (a second job) 4 ranks made to
  look like 2 hosts x 2 ranks; the bytes every rank read, summed, in the note.
- FSDP: the same model fully_shard-ed over the 2 ranks (each holds half of the state), saved with
  the dcp writer (sync, and async blocked time) and verified-loaded into the sharded model, vs the
  sharded writer's DDP figures above.
Files go to runs/bench on the repository's disk (fsync reaches the device); loads read warm files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from bench.common import Options, Row, Variant, interleave, run_job, summary
from ddptrain.checkpoint import Checkpointer, VerifiedCheckpoint, verify_checkpoint
from ddptrain.checkpoint.hashing_reader import bytes_read
from ddptrain.checkpoint.load_plan import nodes_of
from ddptrain.checkpoint.shared_load import load_shared
from ddptrain.checkpoint.verify import read_manifest
from ddptrain.config import CkptConfig, DistConfig, ModelConfig
from ddptrain.dist import DistContext, close_distributed, init_distributed
from ddptrain.models.gpt import GPT, Block

WRITER_NAMES = ("sharded", "rank0-torch")


class _Worker:
    """Both ranks: the state, one Checkpointer per writer and mode, and the timed variants."""

    def __init__(self, ctx: DistContext, folder: Path, large: bool, fsdp: bool = True) -> None:
        self.ctx, self.folder, self.n = ctx, folder, 0
        self.model, self.opt = self._trained(large, sharded=False)
        if fsdp:
            self.fsdp, self.fsdp_opt = self._trained(large, sharded=True)
        self.dcp = {
            a: Checkpointer(CkptConfig(async_save=a, keep=2, format="dcp"), folder / f"dcp-{a}", ctx, {})
            for a in ((False, True) if fsdp else ())
        }
        self.ckpts = {
            (w, a): Checkpointer(
                CkptConfig(async_save=a, keep=2, format=w), folder / f"{w}-{'async' if a else 'sync'}", ctx, {}
            )
            for w in WRITER_NAMES
            for a in (False, True)
        }
        for c in [*self.ckpts.values(), *self.dcp.values()]:
            c.setup()
        self.file = folder / "torch-save.pt"
        if ctx.is_main:
            with open(self.file, "wb") as f:
                torch.save({"state": self.state(), "rng": {"rank": 0}}, f)
                f.flush()
                os.fsync(f.fileno())
        self.newest: dict[str, Path] = {}

    @staticmethod
    def _trained(large: bool, sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The GPT after one AdamW step (the moments exist); sharded: fully_shard per block over both ranks."""
        torch.manual_seed(0)
        shape = dict(n_layer=6, n_head=4, n_embd=352) if large else dict(n_layer=1, n_head=2, n_embd=32)
        model = GPT(ModelConfig(**shape, block_size=64, dropout=0.0))  # type: ignore[arg-type]
        if sharded:
            mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # type: ignore[arg-type]
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
        model(x, x).backward()
        opt.step()
        return model, opt

    def save_dcp(self, is_async: bool) -> float:
        """The dcp writer's save of this rank's FSDP shards (the slowest rank's time; async: blocked time)."""
        ckpt = self.dcp[is_async]
        self.n += 1
        dist.barrier()
        t0 = time.perf_counter()
        m, o = ckpt.capture(self.fsdp, self.fsdp_opt)
        ckpt.save(self.n, {"model": m, "optimizer": o, "trainer": {"step": self.n}}, {"rng": {"rank": self.ctx.rank}})
        seconds = time.perf_counter() - t0
        ckpt.wait()
        (result,) = ckpt.finished()
        assert result.ok and result.path is not None, result.error
        if not is_async:
            self.newest["dcp"] = result.path
        return self.slowest(seconds)

    def load_dcp(self) -> float:
        """Both ranks: shared-load the newest dcp checkpoint and restore it (into the sharded model and optimizer)."""

        def work() -> None:
            ckpt = self.verified("dcp", nodes_of(self.ctx.hosts))  # as a resume does (ckpt.load=auto)
            self.dcp[False].restore(ckpt, self.fsdp, self.fsdp_opt)

        return self._timed_load(work, 2)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "trainer": {"step": self.n}}

    def slowest(self, seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def save(self, writer: str, is_async: bool) -> float:
        ckpt = self.ckpts[(writer, is_async)]
        self.n += 1
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(self.n, self.state(), {"rng": {"rank": self.ctx.rank}})
        seconds = time.perf_counter() - t0
        ckpt.wait()
        (result,) = ckpt.finished()
        assert result.ok and result.path is not None, result.error
        if not is_async:
            self.newest[writer] = result.path
        return self.slowest(seconds)

    def restore(self, shared: dict[str, Any]) -> None:
        self.model.load_state_dict(shared["model"])
        self.opt.load_state_dict(shared["optimizer"])

    def verified(self, writer: str, nodes: tuple[int, ...] | None) -> VerifiedCheckpoint:
        """The newest checkpoint of writer: shared-loaded by every rank (ranks on nodes; () for the split
        over the ranks), or (None) verified whole by this rank."""
        path = self.newest[writer]
        if nodes is None:
            return verify_checkpoint(path)
        return load_shared(path, self.ctx.rank, self.ctx.world_size, None, nodes or None)

    def load_verified(self, writer: str, ranks: int, nodes: tuple[int, ...] | None = None) -> float:
        def work() -> None:
            ckpt = self.verified(writer, nodes)
            state, _ = ckpt.writer.read(ckpt, self.ctx.rank, self.ctx.world_size)
            self.restore(state)

        return self._timed_load(work, ranks)

    def read_per_resume(self, writer: str, nodes: tuple[int, ...]) -> tuple[float, float]:
        """One resume split over `nodes` (not timed): (bytes read from storage, each file once per node
        that reads it; bytes every rank read, summed), each / the checkpoint's size."""
        before = bytes_read()
        self.load_verified(writer, self.ctx.world_size, nodes)
        manifest = read_manifest(self.newest[writer])
        plan = VerifiedCheckpoint(self.newest[writer], manifest).writer.load_plan(manifest, len(nodes), nodes)
        mine = bytes_read() - before
        assert mine == sum(manifest.files[n].size for n in plan.reads(self.ctx.rank)), "read other than planned"
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total)
        size = sum(e.size for e in manifest.files.values())
        storage = sum(manifest.files[n].size * len({nodes[r] for r in ranks}) for n, ranks in plan.readers.items())
        return storage / size, float(total) / size

    def load_torch(self, ranks: int) -> float:
        def work() -> None:
            saved = torch.load(self.file, map_location="cpu", weights_only=True)
            self.restore(saved["state"])

        return self._timed_load(work, ranks)

    def _timed_load(self, work: Callable[[], None], ranks: int) -> float:
        dist.barrier()
        seconds = 0.0
        if self.ctx.rank < ranks:
            t0 = time.perf_counter()
            work()
            seconds = time.perf_counter() - t0
        return self.slowest(seconds)


def worker(out: Path, folder: Path, rounds: int, warmup: int, large: bool) -> None:
    """Inside torchrun: every variant per round, interleaved; rank 0 writes the JSON."""
    torch.set_num_threads(1)
    ctx = init_distributed(DistConfig(timeout_s=300))
    w = _Worker(ctx, folder, large)
    for writer in WRITER_NAMES:
        w.save(writer, False)  # the loads need a checkpoint from the start
    w.save_dcp(False)
    variants: dict[str, Callable[[], float]] = {
        "sharded sync": lambda: w.save("sharded", False),
        "rank0 sync": lambda: w.save("rank0-torch", False),
        "sharded async": lambda: w.save("sharded", True),
        "rank0 async": lambda: w.save("rank0-torch", True),
        "dcp sync": lambda: w.save_dcp(False),
        "dcp async": lambda: w.save_dcp(True),
        "dcp load x2": w.load_dcp,
    }
    hosts = nodes_of(ctx.hosts)
    for ranks in (2, 1):
        variants[f"torch.load x{ranks}"] = lambda r=ranks: w.load_torch(r)  # type: ignore[misc]
        for writer in WRITER_NAMES:  # two ranks resume split over the hosts (auto); one process verifies all
            variants[f"{writer} load x{ranks}"] = lambda wr=writer, r=ranks: w.load_verified(  # type: ignore[misc]
                wr, r, hosts if r > 1 else None
            )
    for writer in WRITER_NAMES:  # split over the ranks (shared); every rank verifying every file
        variants[f"{writer} load x2 split"] = lambda wr=writer: w.load_verified(wr, 2, ())  # type: ignore[misc]
        variants[f"{writer} load x2 all"] = lambda wr=writer: w.load_verified(wr, 2)  # type: ignore[misc]
    times = interleave(variants, Options(rounds=rounds, warmup=warmup))
    read = _bytes_rows(w, hosts)
    if ctx.is_main:
        sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in w.newest.values()}
        out.write_text(
            json.dumps(
                {"seconds": times, "state_bytes": w.file.stat().st_size, "checkpoint_bytes": sizes, "read": read}
            )
        )
    close_distributed(ctx)


def _bytes_rows(w: _Worker, nodes: tuple[int, ...]) -> dict[str, tuple[float, float]]:
    """(bytes from storage, bytes every rank read) per resume / checkpoint size, split over nodes, per writer."""
    return {wr: w.read_per_resume(wr, nodes) for wr in WRITER_NAMES}


def bytes_worker(out: Path, folder: Path, large: bool) -> None:
    """Inside torchrun at an even world size: one save per writer, then the bytes a resume reads with the
    ranks made to look like hosts of 2 ranks each."""
    torch.set_num_threads(1)
    ctx = init_distributed(DistConfig(timeout_s=300))
    w = _Worker(ctx, folder, large, fsdp=False)
    for writer in WRITER_NAMES:
        w.save(writer, False)
    read = _bytes_rows(w, tuple(r // 2 for r in range(ctx.world_size)))
    if ctx.is_main:
        out.write_text(json.dumps({"read": read, "world_size": ctx.world_size}))
    close_distributed(ctx)


def _ratio(t: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    return summary([a / b for a, b in zip(t[num], t[den])])


def _launch(opts: Options, name: str, nproc: int, extra: list[str]) -> dict[str, Any]:
    """Run one job of this module under torchrun into a fresh folder; its JSON."""
    folder = opts.work_dir / name
    shutil.rmtree(folder, ignore_errors=True)  # keep= would prune by another run's step numbers
    folder.mkdir(parents=True)
    out = opts.work_dir / f"{name}.json"
    args = ["--out", str(out), "--folder", str(folder), *extra, *([] if opts.smoke else ["--large"])]
    run_job(
        Variant(name, "bench.checkpoint_ranks", args, nproc=nproc, forked=opts.smoke), opts.work_dir / f"{name}.log"
    )
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Launch the 2-rank job (timed, interleaved) and the 4-rank job (bytes read only); ratios per round."""
    data = _launch(opts, "checkpoint-ranks", 2, ["--rounds", str(opts.rounds), "--warmup", str(opts.warmup)])
    four = _launch(opts, "checkpoint-ranks-4", 4, ["--bytes-only"])
    t = data["seconds"]
    ms = {k: summary(v)["median"] * 1000 for k, v in t.items()}
    rows = [*_save_rows(t, ms, data["state_bytes"] / 1e6), *_load_rows(t, ms)]
    for what, num, den in (
        ("sync save time, dcp (FSDP shards) / sharded (DDP)", "dcp sync", "sharded sync"),
        ("async blocked time, dcp / sharded", "dcp async", "sharded async"),
        ("verified load time, dcp into FSDP / sharded into DDP, both ranks", "dcp load x2", "sharded load x2"),
    ):
        r = _ratio(t, num, den)
        rows.append(
            Row("checkpoint (2 ranks)", what, r, "x", "reported", None, f"{ms[num]:.0f} ms vs {ms[den]:.0f} ms")
        )
    for world, where, read in ((2, "1 host", data["read"]), (4, "as 2 hosts x 2 ranks", four["read"])):
        for writer in WRITER_NAMES:
            storage, ranks = read[writer]
            rows.append(
                Row(
                    f"checkpoint ({world} ranks)",
                    f"bytes read from storage per resume / checkpoint size, {writer}, split over hosts ({where})",
                    summary([storage]),
                    "x",
                    "= 1",
                    abs(storage - 1) < 1e-9,
                    f"read by the ranks, summed (page cache included): {ranks:.2f}x",
                )
            )
    return rows, {**data, "read_4_ranks": four}


def _save_rows(t: dict[str, list[float]], ms: dict[str, float], mb: float) -> list[Row]:
    sync, blocked = _ratio(t, "rank0 sync", "sharded sync"), _ratio(t, "sharded async", "rank0 async")
    return [
        Row(
            "checkpoint (2 ranks)",
            f"sync save speed, sharded vs rank0-torch ({mb:.0f} MB state)",
            sync,
            "x",
            ">= 1.6",
            sync["median"] >= 1.6,
            f"sharded {ms['sharded sync']:.0f} ms, rank0-torch {ms['rank0 sync']:.0f} ms",
        ),
        Row(
            "checkpoint (2 ranks)",
            "async blocked time, sharded / rank0-torch",
            blocked,
            "x",
            "<= 1",
            blocked["median"] <= 1.0,
            f"sharded {ms['sharded async']:.0f} ms, rank0-torch {ms['rank0 async']:.0f} ms",
        ),
    ]


def _load_rows(t: dict[str, list[float]], ms: dict[str, float]) -> list[Row]:
    rows = []
    for ranks, suffix, who in (
        (2, "", "both ranks at once (one host: split over hosts, ckpt.load=auto)"),
        (2, " split", "both ranks at once, split over the ranks (ckpt.load=shared)"),
        (2, " all", "both ranks at once, each verifying every file"),
        (1, "", "rank 0 alone"),
    ):
        for writer, target in (("sharded", "<= 1.5"), ("rank0-torch", "reported")):
            target = target if (suffix, ranks) == ("", 2) else "reported"
            name, base = f"{writer} load x{ranks}{suffix}", f"torch.load x{ranks}"
            r = _ratio(t, name, base)
            met = r["median"] <= 1.5 if target != "reported" else None
            rows.append(
                Row(
                    "checkpoint (2 ranks)",
                    f"verified load / torch.load, {writer}, {who}",
                    r,
                    "x",
                    target,
                    met,
                    f"{ms[name]:.0f} ms vs {ms[base]:.0f} ms",
                )
            )
    return rows


def main() -> None:
    """Worker entry point (under torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--large", action="store_true")
    p.add_argument("--bytes-only", action="store_true", help="only the bytes each way of resuming reads")
    a = p.parse_args()
    if a.bytes_only:
        bytes_worker(a.out, a.folder, a.large)
    else:
        worker(a.out, a.folder, a.rounds, a.warmup, a.large)


if __name__ == "__main__":
    main()
