"""Save with the sharded writer, or resume from it, under torchrun (or alone, world size 1).

save RUN_DIR: a tiny GPT and AdamW after one step, saved asynchronously (each rank snapshots and
writes its share) as step 1; rank 0 keeps that state in RUN_DIR/reference.pt. Another state is
saved as step 2, and one byte of one of rank 1's parts of it is flipped. Then it loads as below:
step 2 must be rejected and every rank must get step 1.
load RUN_DIR: a differently seeded model and optimizer resume from the newest checkpoint; rank r
writes RUN_DIR/loaded-<world>-rank<r>.json: whether every parameter and optimizer tensor equals
the saved one, the manifest's writer and world size, and whether this rank got its RNG state back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ddptrain.checkpoint import Checkpointer
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
        if ctx.rank == 1:  # corrupt rank 1's own share of step 2, after the commit
            part = run_dir / "checkpoints" / "step-00000002" / "tensors-3-of-4.bin"
            data = bytearray(part.read_bytes())
            data[-5] ^= 0x04
            part.write_bytes(bytes(data))
        torch.distributed.barrier()
    load(ctx, run_dir)  # a new Checkpointer, as a restarted run builds
    close_distributed(ctx)


def load(ctx: DistContext, run_dir: Path) -> None:
    """Resume a differently seeded model and optimizer; note whether they now equal the saved ones."""
    ckpt = Checkpointer(CkptConfig(), run_dir, ctx, {"note": "shard"})
    ckpt.setup()
    model, opt = trained(seed=2)
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
    out = {
        "equal": equal,
        "writer": point.checkpoint.manifest.writer,
        "saved_world": point.checkpoint.manifest.world_size,
        "rng": local["rng"] if local else None,
    }
    (run_dir / f"loaded-{ctx.world_size}-rank{ctx.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
