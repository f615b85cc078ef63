"""Single-GPU figures: matmul ceiling, GPT-2 124M throughput and MFU, ddptrain vs a raw loop,
1-rank NCCL DDP and FSDP2 vs neither, checkpoint save/load of the full training state, the 2- and 4-rank
checkpoint figures of bench/checkpoint_ranks.py on its CPUs (saves per format, verified and shared loads,
bytes read per resume), and the checksums' speed on this machine's CPU (bench/hashes.py: SHA-256, BLAKE3 one thread and all cores, xxh3_128). About 5-8 minutes.

    python bench/gpu.py --out DIR            # on a machine with one CUDA GPU; writes DIR/gpu-<date>.json
    python bench/gpu.py --smoke --out DIR    # a tiny model on the CPU: checks that the script runs

GPT-2 124M: 12 layers, 12 heads, width 768, T=1024, vocab 50304 (50257 padded to a multiple of 64),
bf16 autocast, SDPA attention (the built-in GPT), fused AdamW, synthetic tokens (no download).
MFU = tokens/s x training FLOPs per token (6N + 12·L·C·T, PaLM appendix B) / the GPU's dense
bf16 peak (ddptrain.observe.perf's data-sheet table). Ratios (ddptrain / raw, DDP / none, FSDP / none, compiled /
eager) are measured A B A B in rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import socket
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

# Run as a script, sys.path[0] is bench/ (whose names could shadow the standard library): use the repository root.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import summary  # noqa: E402
from bench.hashes import machine_report  # noqa: E402
from ddptrain.checkpoint import Checkpointer, verify_checkpoint  # noqa: E402
from ddptrain.config import Config, load_config  # noqa: E402
from ddptrain.dist import DistContext  # noqa: E402
from ddptrain.models.gpt import GPT  # noqa: E402
from ddptrain.observe.metrics import MetricsWriter, Progress  # noqa: E402
from ddptrain.observe.perf import device_name, peak_flops  # noqa: E402
from ddptrain.train.trainer import Trainer  # noqa: E402

GPT2 = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024", "model.vocab_size=50304"]
SMOKE = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64", "model.vocab_size=256"]


class RandomTokens(Dataset):
    """Fixed random token windows: GPU throughput does not depend on what the tokens say."""

    def __init__(self, vocab: int, block: int, samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (samples * block + 1,), generator=g)
        self.block, self.samples = block, samples
        self.tokens_per_sample = block

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.block : (i + 1) * self.block + 1]
        return w[:-1], w[1:]


class Bench:
    """Shared setup: device, config, dataset, timing."""

    def __init__(self, smoke: bool, batch: int, steps: int, rounds: int) -> None:
        self.smoke, self.steps, self.rounds = smoke, steps, rounds
        self.device = torch.device("cpu") if smoke else torch.device("cuda", 0)
        overrides = [
            *(SMOKE if smoke else GPT2),
            f"data.micro_batch_size={batch}",
            f"train.global_batch_size={batch}",
            "train.precision=bf16",
            "train.eval_every=0",
            "ckpt.every_steps=0",
            "train.warmup_steps=10",
        ]
        self.cfg: Config = load_config(None, overrides)
        self.dataset = RandomTokens(self.cfg.model.vocab_size, self.cfg.model.block_size, 64 * batch)
        self.tokens_per_step = batch * self.cfg.model.block_size

    def sync(self) -> None:
        """Wait for the GPU (time only completed work)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def model(self) -> GPT:
        """A freshly initialised GPT on the device (same seed every time)."""
        torch.manual_seed(self.cfg.run.seed)
        return GPT(self.cfg.model).to(self.device)

    def optimizer(self, model: nn.Module) -> torch.optim.AdamW:
        """Fused AdamW on CUDA (one kernel for all parameters)."""
        return torch.optim.AdamW(
            model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=self.device.type == "cuda"
        )

    def batches(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """An endless stream of pinned, asynchronously copied batches."""
        loader = DataLoader(
            self.dataset,
            batch_size=self.cfg.data.micro_batch_size,
            shuffle=False,
            pin_memory=self.device.type == "cuda",
            drop_last=True,
        )
        state = {"it": iter(loader)}

        def nxt() -> tuple[torch.Tensor, torch.Tensor]:
            try:
                x, y = next(state["it"])
            except StopIteration:
                state["it"] = iter(loader)
                x, y = next(state["it"])
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

        return nxt

    def raw_step(self, model: nn.Module, opt: torch.optim.Optimizer, nxt: Callable[[], Any]) -> Callable[[], None]:
        """The hand-written step: autocast forward, backward, clip, fused AdamW."""
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16)

        def step() -> None:
            x, y = nxt()
            with autocast:
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def seconds_per_step(self, step: Callable[[], None]) -> float:
        """Mean wall time of `steps` steps, the GPU drained before and after."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(self.steps):
            step()
        self.sync()
        return (time.perf_counter() - t0) / self.steps

    def interleave(self, variants: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
        """Warm each variant up (3 steps; smoke: 1, the code path), then rounds A B A B ...; per-round seconds per
        step."""
        for step in variants.values():
            for _ in range(1 if self.smoke else 3):
                step()
        out: dict[str, list[float]] = {n: [] for n in variants}
        names = list(variants)
        for r in range(self.rounds):
            for n in names if r % 2 == 0 else reversed(names):
                out[n].append(self.seconds_per_step(variants[n]))
        return out


def peak(device: torch.device, measured: float) -> tuple[float, str]:
    """The GPU's dense bf16 peak from ddptrain's data-sheet table, else the measured matmul ceiling."""
    nominal = peak_flops(device_name(device), "bf16") if device.type == "cuda" else None
    if nominal is not None:
        return nominal, "data sheet (ddptrain.observe.perf)"
    return measured, "measured matmul ceiling (device not in ddptrain.observe.perf's table)"


def matmul_ceiling(b: Bench) -> dict[str, Any]:
    """bf16 GEMM TFLOP/s at a few square sizes: the best the tensor cores give here."""
    sizes = [256, 512] if b.smoke else [4096, 8192, 16384]
    out = {}
    for n in sizes:
        x = torch.randn(n, n, device=b.device, dtype=torch.bfloat16)
        y = torch.randn(n, n, device=b.device, dtype=torch.bfloat16)
        iters = 3 if b.smoke else max(5, int(4e13 / (2 * n**3)))
        for _ in range(2):
            x @ y
        b.sync()
        times = []
        for _ in range(b.rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                x @ y
            b.sync()
            times.append(2 * n**3 * iters / (time.perf_counter() - t0) / 1e12)
        out[str(n)] = summary(times)
    best = max(v["median"] for v in out.values())
    return {"tflops": out, "best_tflops": best}


def gpt2(b: Bench, peak_per_s: float) -> dict[str, Any]:
    """Tokens/s and MFU, eager vs torch.compile, on the same model and optimizer."""
    model = b.model()
    opt = b.optimizer(model)
    nxt = b.batches()
    compiled = torch.compile(model, backend="eager" if b.smoke else "inductor")
    t0 = time.perf_counter()
    b.raw_step(compiled, opt, nxt)()  # the first call compiles
    b.sync()
    compile_s = time.perf_counter() - t0
    t = b.interleave({"eager": b.raw_step(model, opt, nxt), "compiled": b.raw_step(compiled, opt, nxt)})
    fpt = model.flops_per_token()
    res: dict[str, Any] = {
        "flops_per_token": fpt,
        "tokens_per_step": b.tokens_per_step,
        "compile_s": compile_s,
        "params": model.num_params(),
    }
    for name, secs in t.items():
        tps = [b.tokens_per_step / s for s in secs]
        res[name] = {"tokens_per_s": summary(tps), "mfu": summary([x * fpt / peak_per_s for x in tps])}
    res["compile_speedup"] = summary([e / c for e, c in zip(t["eager"], t["compiled"])])
    del model, compiled, opt
    return res


def trainer_vs_raw(b: Bench, run: Path) -> dict[str, Any]:
    """ddptrain's Trainer.train_step vs the hand-written step, same model, data, batch (eager)."""
    ctx = DistContext(device=b.device)
    cfg = b.cfg.model_copy(deep=True)
    cfg.run.dir = str(run / "trainer")
    checkpointer = Checkpointer(cfg.ckpt, run / "trainer", ctx, cfg.model_dump(mode="json", by_alias=True))
    trainer = Trainer(
        cfg,
        ctx,
        b.model(),
        b.dataset,
        None,
        checkpointer,
        MetricsWriter(run / "trainer", True),
        Progress(False, cfg.train.max_steps, 0),
    )
    raw_model = b.model()
    t = b.interleave(
        {"ddptrain": lambda: trainer.train_step(), "raw": b.raw_step(raw_model, b.optimizer(raw_model), b.batches())}
    )
    ratio = summary([a / r for a, r in zip(t["ddptrain"], t["raw"])])
    return {"seconds_per_step": {k: summary(v) for k, v in t.items()}, "ratio": ratio, "trainer": trainer}


def wrapper_overhead(b: Bench) -> dict[str, Any]:
    """1-rank DDP and 1-rank FSDP2 (NCCL on GPU, gloo in smoke) vs the bare model: each wrapper's own cost.

    FSDP shards each block, then the root (as dist.strategy=fsdp does); at one rank its all-gathers and
    reduce-scatters are copies, so what it costs over the bare model is the wrapper's bookkeeping.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "gloo" if b.smoke else "nccl"
    kwargs = {} if b.smoke else {"device_id": b.device}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kwargs)
    try:
        bare = b.model()
        wrapped = b.model()
        ddp = DDP(wrapped, device_ids=None if b.smoke else [0], gradient_as_bucket_view=True)
        sharded = b.model()
        for block in sharded.blocks:
            fully_shard(block)
        fully_shard(sharded)
        t = b.interleave(
            {
                "no DDP": b.raw_step(bare, b.optimizer(bare), b.batches()),
                "DDP": b.raw_step(ddp, b.optimizer(wrapped), b.batches()),
                "FSDP": b.raw_step(sharded, b.optimizer(sharded), b.batches()),
            }
        )
    finally:
        dist.destroy_process_group()
    times = {k: summary(v) for k, v in t.items()}
    ddp_result = {"seconds_per_step": times, "overhead": summary([d / n - 1 for d, n in zip(t["DDP"], t["no DDP"])])}
    fsdp_result = {"overhead": summary([f / n - 1 for f, n in zip(t["FSDP"], t["no DDP"])])}
    return {"ddp": ddp_result, "fsdp": fsdp_result}


def checkpoint(b: Bench, trainer: Trainer, run: Path) -> dict[str, Any]:
    """Sync and async save (blocked and total time) and verified load of the Trainer's full state."""
    ctx = DistContext(device=b.device)
    config = trainer.cfg.model_dump(mode="json", by_alias=True)
    ckpts = {
        "sync": Checkpointer(
            trainer.cfg.ckpt.model_copy(update={"async_save": False, "keep": 1}), run / "sync", ctx, config
        ),
        "async": Checkpointer(
            trainer.cfg.ckpt.model_copy(update={"async_save": True, "keep": 1}), run / "async", ctx, config
        ),
    }
    res: dict[str, Any] = {}
    path = None
    for name, ckpt in ckpts.items():
        trainer.checkpointer = ckpt
        blocked, total = [], []
        for _ in range(max(2, b.rounds // 2)):
            trainer.step += 1  # a new folder each time, as in training
            t0 = time.perf_counter()
            trainer.save_checkpoint()
            blocked.append(time.perf_counter() - t0)
            ckpt.wait()
            (r,) = ckpt.finished()
            assert r.ok and r.path is not None, r.error
            total.append(r.total_s)
            path = r.path
        res[name] = {"blocked_s": summary(blocked), "total_s": summary(total)}
    assert path is not None
    size = sum(f.stat().st_size for f in path.iterdir())
    loads = []
    for _ in range(2):
        t0 = time.perf_counter()
        trainer.resume(verify_checkpoint(path))
        b.sync()
        loads.append(time.perf_counter() - t0)
    res["load_s"] = summary(loads)
    res["state_GB"] = size / 1e9
    return res


def checkpoint_ranks(smoke: bool, rounds: int, work: Path) -> list[dict[str, Any]]:
    """The 2- and 4-rank checkpoint rows (bench/checkpoint_ranks.py: sync and async saves of each format,
    verified and shared loads against torch.load, bytes read per resume) on this machine's CPUs and disk:
    the figures 2 cores bound (hashing, the exchange over loopback) measured where there are more."""
    from bench.checkpoint_ranks import run as run_checkpoint_ranks
    from bench.common import Options

    rows, _ = run_checkpoint_ranks(Options(smoke=smoke, rounds=rounds, work_dir=work))
    return [dataclasses.asdict(row) for row in rows]


def _hash_line(hashes: dict[str, Any]) -> str:
    """GB/s of each checksum on the largest buffer measured."""
    size = max((k for k in hashes if k.endswith("MB")), key=lambda k: int(k[:-2]))
    speeds = ", ".join(f"{name} {v['GBps']['median']:.2f}" for name, v in hashes[size].items())
    return f"hash GB/s ({size}): {speeds}"


def main() -> int:
    """Run every figure and write DIR/gpu-<date>.json."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu-<date>.json")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 1 round")
    p.add_argument("--batch", type=int, default=16, help="micro-batch (sequences of 1024 tokens)")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU visible; use --smoke to check the script on a CPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    b = Bench(args.smoke, 2 if args.smoke else args.batch, steps=2 if args.smoke else 20, rounds=1 if args.smoke else 4)
    started = datetime.now(timezone.utc)
    result: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "device": torch.cuda.get_device_name(0) if b.device.type == "cuda" else "cpu",
        "batch": b.cfg.data.micro_batch_size,
        "block_size": b.cfg.model.block_size,
    }
    t_all = time.perf_counter()
    result["matmul"] = matmul_ceiling(b)
    peak_per_s, source = peak(b.device, result["matmul"]["best_tflops"] * 1e12)
    result["peak_flops"], result["peak_source"] = peak_per_s, source
    t0 = time.perf_counter()
    result["gpt2"] = gpt2(b, peak_per_s)
    print(f"gpt2: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    result.update(wrapper_overhead(b))
    print(f"ddp, fsdp: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    # Checkpoints go under --out (a real disk, so fsync means something; /tmp may be RAM) and are removed after.
    run = args.out / "gpu-work"
    shutil.rmtree(run, ignore_errors=True)
    tv = trainer_vs_raw(b, run)
    trainer = tv.pop("trainer")
    result["trainer_vs_raw"] = tv
    result["checkpoint"] = checkpoint(b, trainer, run)
    trainer.metrics.close()
    result["checkpoint_ranks"] = checkpoint_ranks(args.smoke, 1 if args.smoke else 3, run / "ranks")
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    result["hashes"] = machine_report(rounds=b.rounds + 1, smoke=args.smoke)  # the host CPU's, as checkpoints hash
    print(f"hashes: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    result["wall_s"] = time.perf_counter() - t_all
    result["targets"] = {
        "mfu_compiled >= 0.40": result["gpt2"]["compiled"]["mfu"]["median"] >= 0.40,
        "ddp_overhead <= 0.03": result["ddp"]["overhead"]["median"] <= 0.03,
        "trainer / raw <= 1.02": result["trainer_vs_raw"]["ratio"]["median"] <= 1.02,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"gpu-{started:%Y-%m-%dT%H%MZ}{'-smoke' if args.smoke else ''}.json"
    out.write_text(json.dumps(result, indent=1))
    g = result["gpt2"]
    print(
        f"{result['device']}: matmul {result['matmul']['best_tflops']:.0f} TFLOP/s; GPT-2 124M "
        f"eager {g['eager']['tokens_per_s']['median']:,.0f} tok/s (MFU {g['eager']['mfu']['median']:.1%}), "
        f"compiled {g['compiled']['tokens_per_s']['median']:,.0f} tok/s (MFU {g['compiled']['mfu']['median']:.1%}); "
        f"ddptrain/raw {tv['ratio']['median']:.3f}; DDP overhead {result['ddp']['overhead']['median']:+.1%}, "
        f"FSDP (1 rank) {result['fsdp']['overhead']['median']:+.1%}; "
        f"save sync {result['checkpoint']['sync']['blocked_s']['median']:.2f} s, async blocked "
        f"{result['checkpoint']['async']['blocked_s']['median']:.2f} s, load {result['checkpoint']['load_s']['median']:.2f} s "
        f"({result['checkpoint']['state_GB']:.2f} GB); {_hash_line(result['hashes'])}; "
        f"{result['wall_s']:.0f} s in all -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
