"""Save with the sharded writer, or resume from it, under torchrun (or alone, world size 1).

save RUN_DIR: a tiny GPT and AdamW after one step, saved asynchronously (each rank snapshots and
writes its share) as step 1; rank 0 keeps that state in RUN_DIR/reference.pt. Another state is
saved as step 2, and one byte of a part of it that only rank 1 reads at a 2-rank resume is flipped
(its name goes to RUN_DIR/flipped.txt). Then it loads as below: step 2 must be rejected and every
rank must get step 1.
load RUN_DIR: a differently seeded model and optimizer resume from the newest checkpoint; rank r
writes RUN_DIR/loaded-<mode>-<world>-rank<r>.json: whether every parameter and optimizer tensor
equals the saved one, the manifest's writer and world size, whether this rank got its RNG state
back, and the bytes it read from checkpoint files.
die RUN_DIR: as load, but rank 1 exits (os._exit, no cleanup) in the middle of the exchange of
verified files: no rank may write its loaded file, and the job must fail.
nodes RUN_DIR HOST,HOST,...: as load with ckpt.load=auto, as if rank r ran on the r-th host named
(several ranks of one machine made to look like nodes); each rank also notes the files its plan
says it reads.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

import ddptrain.checkpoint.shared_load as shared_load
from ddptrain.checkpoint import Checkpointer, VerifiedCheckpoint
from ddptrain.checkpoint.hashing_reader import bytes_read
from ddptrain.checkpoint.load_plan import nodes_of
from ddptrain.checkpoint.verify import checked_manifest
from ddptrain.config import CkptConfig, DistConfig, ModelConfig
from ddptrain.dist import DistContext, close_distributed, init_distributed
from ddptrain.models.gpt import GPT


def trained(seed: int) -> tuple[GPT, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
    model(x, x).backward()
    opt.step()
    return model, opt


def main() -> None:
    """Save or load, as argv says."""
    mode, run_dir = sys.argv[1], Path(sys.argv[2])
    ctx = init_distributed(DistConfig(timeout_s=30))
    if mode == "nodes":
        ctx = replace(ctx, hosts=tuple(sys.argv[3].split(",")))
    if mode == "save":
        ckpt = Checkpointer(CkptConfig(async_save=True, keep=3), run_dir, ctx, {"note": "shard"})
        ckpt.setup()
        for step, seed in ((1, 1), (2, 3)):
            model, opt = trained(seed)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": step}}
            ckpt.save(step, state, {"rng": {"rank": ctx.rank}})
            ckpt.wait()
            (result,) = ckpt.finished()
            assert result.ok, result.error
            if ctx.is_main and step == 1:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, run_dir / "reference.pt")
        if ctx.rank == 1:  # corrupt a part that only rank 1 reads at a 2-rank resume, after the commit
            flip_in_share(run_dir / "checkpoints" / "step-00000002", run_dir / "flipped.txt", rank=1, world=2)
        torch.distributed.barrier()
    if mode == "die" and ctx.rank == 1:
        die_in_exchange()
    load(ctx, run_dir, mode, "auto" if mode == "nodes" else "shared")  # a new Checkpointer, as a restarted run builds
    if mode == "save":  # and again with every rank reading every file itself (ckpt.load's one-host choice)
        load(ctx, run_dir, mode, "every-rank")
    close_distributed(ctx)


def flip_in_share(folder: Path, note: Path, rank: int, world: int) -> None:
    """Flip one byte of a tensor part that `rank` alone reads and verifies when `world` ranks resume."""
    manifest = checked_manifest(folder)
    plan = VerifiedCheckpoint(folder, manifest).writer.load_plan(manifest, world)
    name = next(n for n in plan.reads(rank) if n.startswith("tensors-"))
    data = bytearray((folder / name).read_bytes())
    data[-5] ^= 0x04
    (folder / name).write_bytes(bytes(data))
    note.write_text(name)


def die_in_exchange() -> None:
    """This rank exits at its second transfer of verified files, sent or received (a rank lost during the exchange)."""
    calls = [0]

    def dying(real: Callable[..., None]) -> Callable[..., None]:
        def transfer(*args: object) -> None:
            calls[0] += 1
            if calls[0] == 2:
                os._exit(17)
            real(*args)

        return transfer

    shared_load.send_buffers = dying(shared_load.send_buffers)  # type: ignore[assignment]
    shared_load.recv_buffers = dying(shared_load.recv_buffers)  # type: ignore[assignment]


def load(ctx: DistContext, run_dir: Path, mode: str, how: str) -> None:
    """Resume a differently seeded model and optimizer; note whether they now equal the saved ones."""
    ckpt = Checkpointer(CkptConfig(timeout_s=30, load=how), run_dir, ctx, {"note": "shard"})  # type: ignore[arg-type]
    ckpt.setup()
    model, opt = trained(seed=2)
    before = bytes_read()
    point = ckpt.find_resume(print)
    assert point is not None
    shared, local = ckpt.read(point.checkpoint)
    model.load_state_dict(shared["model"])
    opt.load_state_dict(shared["optimizer"])
    ref = torch.load(run_dir / "reference.pt", weights_only=True)
    equal = all(torch.equal(v, ref["model"][k]) for k, v in model.state_dict().items()) and all(
        torch.equal(v, ref["optimizer"]["state"][i][k])
        for i, s in opt.state_dict()["state"].items()
        for k, v in s.items()
    )
    out: dict[str, object] = {
        "equal": equal,
        "writer": point.checkpoint.manifest.writer,
        "saved_world": point.checkpoint.manifest.world_size,
        "rng": local["rng"] if local else None,
        "bytes_read": bytes_read() - before,
    }
    if mode == "nodes":
        plan = point.checkpoint.writer.load_plan(point.checkpoint.manifest, ctx.world_size, nodes_of(ctx.hosts))
        out["plan_reads"] = plan.reads(ctx.rank)
    suffix = "" if how == "shared" or mode == "nodes" else f"-{how}"
    (run_dir / f"loaded-{mode}{suffix}-{ctx.world_size}-rank{ctx.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
