"""LoRA (model.peft, r=8) vs a full fine-tune of a small Llama-style model, 2 ranks under torchrun (gloo).

One job builds both runs exactly as `ddptrain train` does (build_run: a transformers Llama from a saved
folder, model.init_from the same folder; the LoRA run adds model.peft on q_proj and v_proj) and measures:

- bytes all-reduced per step: a DDP communication hook on each run's DDP module (chained behind the
  Trainer's own, StepTimer.send_through) adds up the size of every gradient bucket it all-reduces, then
  calls DDP's default all-reduce; compared with the bytes of the gradients of the parameters that
  train (LoRA: the adapters);
- step time: training steps of the two runs in interleaved rounds, the order alternating; a round's
  value is the slowest rank's mean step;
- checkpoint size: each run saves one checkpoint (the run's own format, sharded) after the rounds;
  the size of every file of it, LoRA over full.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from bench.build import bench_config, build_trainer
from bench.common import Options, Row, Variant, interleave, run_job, summary
from ddptrain.config import DistConfig
from ddptrain.dist import DistContext, close_distributed, init_distributed
from ddptrain.train.trainer import Trainer

LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8, "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip
SMOKE_LLAMA = {**LLAMA, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 2}  # fmt: skip
LORA = "model.peft={r: 8, alpha: 16, target_modules: [q_proj, v_proj]}"


class BucketBytes:
    """A DDP communication hook's state: the bytes of every bucket it all-reduced."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group, self.bytes = group, 0

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations (this file's)
        """Count the bucket (a dist.GradBucket), then all-reduce it as DDP would; a future of the result."""
        buffer = bucket.buffer()
        self.bytes += buffer.numel() * buffer.element_size()
        return allreduce_hook(self.group, bucket)  # type: ignore[arg-type]


def _trainer(ctx: DistContext, base: Path, data: Path, run_dir: Path, block: int, extra: list[str]) -> Trainer:
    model = [f"model.hf.config={base}", f"model.init_from={base}", f"model.block_size={block}"]
    batch = ["data.micro_batch_size=8", "train.global_batch_size=16", "train.max_steps=100000", "log.every_steps=1000"]
    return build_trainer(bench_config([*model, *batch], data, run_dir, [*extra, "ckpt.resume=never"]), ctx)


def _timed(trainer: Trainer, steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    t = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _checkpoint_bytes(trainer: Trainer) -> int:
    trainer.save_checkpoint()
    trainer.checkpointer.wait()
    dist.barrier()
    folders = sorted((trainer.cfg.run_dir / "checkpoints").glob("step-*"))
    return sum(f.stat().st_size for f in folders[-1].iterdir())


def worker(base: Path, data: Path, work: Path, out: Path, opts: Options) -> None:
    """Inside torchrun: both runs built, counted and timed in interleaved rounds, then one checkpoint each."""
    torch.set_num_threads(1)
    ctx = init_distributed(DistConfig(timeout_s=600))
    block = 32 if opts.smoke else 128
    runs = {
        "full": _trainer(ctx, base, data, work / "full", block, []),
        "lora": _trainer(ctx, base, data, work / "lora", block, [LORA]),
    }
    counters = {name: BucketBytes(ctx.group) for name in runs}
    for name, trainer in runs.items():
        trainer.timer.send_through(trainer.ddp, counters[name].hook)  # DDP takes one hook: the Trainer's forwards
    steps = 1 if opts.smoke else 3
    seconds = interleave({n: lambda t=t: _timed(t, steps) for n, t in runs.items()}, opts)  # type: ignore[misc]
    done = {n: t.step for n, t in runs.items()}
    result = {
        "seconds": seconds,
        "allreduce_bytes_per_step": {n: counters[n].bytes / done[n] for n in runs},
        "gradient_bytes": {
            n: sum(p.numel() * p.element_size() for p in t.model.parameters() if p.requires_grad)
            for n, t in runs.items()
        },
        "parameters": {n: sum(p.numel() for p in t.model.parameters()) for n, t in runs.items()},
        "checkpoint_bytes": {n: _checkpoint_bytes(t) for n, t in runs.items()},
    }
    for trainer in runs.values():
        trainer.metrics.close()
    if ctx.is_main:
        out.write_text(json.dumps(result))
    close_distributed(ctx)


def _save_base(folder: Path, smoke: bool) -> Path:
    """The 'released' model both runs start from: a Llama from a config, saved by transformers (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(SMOKE_LLAMA if smoke else LLAMA))).save_pretrained(str(folder))
    return folder


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """One job of 2 ranks; rows: checkpoint size ratio, all-reduced bytes vs adapter gradients, step times."""
    work = opts.work_dir / "lora"
    shutil.rmtree(work, ignore_errors=True)  # fresh run folders: the last run's checkpoints would be refused
    base = _save_base(work / "base", opts.smoke)
    out = work / "result.json"
    args = ["--base", str(base), "--data", str(opts.data_dir), "--work", str(work), "--out", str(out),
            "--rounds", str(opts.rounds), "--warmup", str(opts.warmup), *(["--smoke"] if opts.smoke else [])]  # fmt: skip
    run_job(Variant("lora", "bench.lora", args, nproc=2, forked=opts.smoke), work / "lora.log")
    r: dict[str, Any] = json.loads(out.read_text())
    ckpt, sent, grads = r["checkpoint_bytes"], r["allreduce_bytes_per_step"], r["gradient_bytes"]
    t = r["seconds"]
    ms = {n: summary(v)["median"] * 1000 for n, v in t.items()}
    size = ckpt["lora"] / ckpt["full"]
    figure = "lora (2 ranks)"
    rows = [
        Row(figure, "checkpoint size LoRA r=8 / full fine-tune (every file of one checkpoint)", summary([size]),
            "x", "<= 0.05", size <= 0.05, f"LoRA {ckpt['lora'] / 1e3:.0f} kB, full {ckpt['full'] / 1e6:.1f} MB"),
        Row(figure, "bytes all-reduced per step (DDP comm hook) / the adapters' gradient bytes",
            summary([sent["lora"] / grads["lora"]]), "x", "= 1", sent["lora"] == grads["lora"],
            f"LoRA {sent['lora'] / 1e3:.0f} kB a step; full fine-tune {sent['full'] / 1e6:.1f} MB "
            f"(its gradients {grads['full'] / 1e6:.1f} MB)"),
        Row(figure, "step time LoRA / full fine-tune (interleaved rounds)",
            summary([a / b for a, b in zip(t["lora"], t["full"])]), "x", "reported", None,
            f"LoRA {ms['lora']:.0f} ms, full {ms['full']:.0f} ms; {r['parameters']['full'] / 1e6:.1f}M parameters"),
    ]  # fmt: skip
    return rows, r


def main() -> None:
    """Worker entry point (under torchrun)."""
    p = argparse.ArgumentParser()
    for name in ("--base", "--data", "--work", "--out"):
        p.add_argument(name, type=Path, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    worker(a.base, a.data, a.work, a.out, Options(smoke=a.smoke, rounds=a.rounds, warmup=a.warmup))


if __name__ == "__main__":
    main()
