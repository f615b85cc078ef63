"""The toy runs the tests share, declared once: a tiny GPT on the prepared corpus, and the fault-injecting toy
model (tests/faulty.py) on synthetic data. A test adds its own overrides after these (the last value wins)."""

from __future__ import annotations

# A GPT small enough that a step takes milliseconds on one CPU core (add data.dir and run.dir).
TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.max_steps=6",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "log.every_steps=1",
    "ckpt.every_steps=3",
]

# tests/faulty.py's model (faults and delays set through model.kwargs) on tests/toy.py's data: no corpus needed.
FAULTY = [
    "model.target=faulty:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.eval_every=0",
]

# The coordinated-stop runs (Ctrl-C, preemption): every step logged, a checkpoint every 10 of 40 steps.
# test_interrupt.py and test_preemption.py compare their resumed runs with one uninterrupted 2-rank run of it.
STOPPABLE = [*FAULTY, "log.every_steps=1", "ckpt.every_steps=10", "train.max_steps=40"]
