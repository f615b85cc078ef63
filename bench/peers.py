"""The peers: the same model, data, batch and optimizer under PyTorch Lightning and HF Accelerate.

Each is written the way its documentation shows a plain DDP-on-CPU run, with nothing disabled
that a user would keep except the logger and progress bar (ddptrain's metrics are cheap lines;
turning those off only favours the peer).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from bench.common import Baton
from bench.raw_loop import make_optimizer
from ddptrain.config import Config
from ddptrain.data.dataset import TokenDataset, load_split
from ddptrain.models.gpt import GPT


def _dataset(cfg: Config) -> TokenDataset:
    return load_split(Path(cfg.data.dir), "train", cfg.model.block_size)


def lightning_worker(cfg: Config, baton: Baton, steps: int) -> None:
    """Lightning's Trainer, strategy ddp on CPU (under torchrun); rounds are cut by a callback."""
    import lightning.pytorch as pl

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(cfg.run.seed)
            self.model = GPT(cfg.model)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(*batch)

        def configure_optimizers(self) -> Any:
            opt, sched = make_optimizer(self.model, cfg)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Rounds(pl.Callback):
        """Waits for the baton before a round's first step and reports after its last."""

        def __init__(self) -> None:
            self.done, self.t0, self.losses = 0, 0.0, []

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            if self.done % steps == 0:
                if not baton.wait():
                    raise RuntimeError("stopped before the planned rounds ended")
                trainer.strategy.barrier()
                self.t0 = time.perf_counter()

        def on_train_batch_end(
            self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.done += 1
            self.losses.append(outputs["loss"].detach())
            if self.done % steps == 0:
                seconds = time.perf_counter() - self.t0
                baton.report(
                    {
                        "seconds": seconds,
                        "steps": steps,
                        "samples": steps * cfg.train.global_batch_size,
                        "threads": torch.get_num_threads(),
                        "losses": [float(x) for x in self.losses],
                    }
                )
                self.losses.clear()

    world = int(os.environ["WORLD_SIZE"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=cfg.train.max_steps,
        gradient_clip_val=cfg.train.grad_clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Rounds()],
    )
    loader = DataLoader(_dataset(cfg), batch_size=cfg.data.micro_batch_size, shuffle=True)
    trainer.fit(LitGPT(), loader)
    while baton.wait():  # the driver's final "stop"
        raise RuntimeError("more rounds asked than train.max_steps allows")


def accelerate_worker(cfg: Config, baton: Baton, steps: int) -> None:
    """Accelerate's documented loop: prepare(), accelerator.backward, clip, step."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model)
    opt, sched = make_optimizer(model, cfg)
    loader = DataLoader(_dataset(cfg), batch_size=cfg.data.micro_batch_size, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    batches = iter(loader)
    losses: list[float] = []

    def run_round() -> None:
        for _ in range(steps):
            x, y = next(batches)
            loss = model(x, y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))

    def drain() -> list[float]:
        out = list(losses)
        losses.clear()
        return out

    baton.serve_rounds(run_round, acc.wait_for_everyone, steps, cfg.train.global_batch_size, drain)
    acc.end_training()
