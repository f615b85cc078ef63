"""Two ranks under torchrun (real DDP and FSDP, the built-in GPT, a stop request installed): no host sync on unlogged steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TESTS_DIR, TINY, read_metrics, run_ddptrain

from ddptrain.data.corpus import PrepareOptions, prepare_corpus

pytestmark = pytest.mark.dist

STEPS, LOG_EVERY = 9, 4


def _instruction_corpus(tmp_path: Path) -> Path:
    """Prompt/completion records of unequal answer lengths: the step weighs micro-batches by answer tokens."""
    source = tmp_path / "records.jsonl"
    records = [{"prompt": f"question {i}?", "completion": " answer" * (1 + i % 5)} for i in range(300)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    return prepare_corpus([source], tmp_path / "sft", 0.1, PrepareOptions(sft="prompt,completion")).out_dir


# A model with metrics of its own (tests/metrics_toy.py) and train.metrics: summed on the device every micro-batch,
# read on logged steps only.
METRICS = [
    "model.target=metrics_toy:plateau_model",
    "data.target=varlen_toy:bare_datasets",
    "train.metrics=metrics_toy:target_mean",
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("strategy", "sft", "extra"),
    [("ddp", False, []), ("fsdp", False, []), ("ddp", True, []), ("ddp", False, METRICS)],
    ids=["ddp", "fsdp", "sft", "metrics"],
)
def test_two_ranks_make_no_host_sync_on_unlogged_steps(
    strategy: str, sft: bool, extra: list[str], corpus_dir: Path, tmp_path: Path
) -> None:
    # Under fsdp the clipped norm is a DTensor made full by an all-reduce: a collective, not a host read.
    # With instruction data the step's answer-token count is an all-reduce of a device tensor, not a host read.
    corpus_dir = _instruction_corpus(tmp_path) if sft else corpus_dir
    overrides = [
        *TINY,
        f"dist.strategy={strategy}",
        f"data.dir={corpus_dir}",
        f"run.dir={tmp_path / 'run'}",
        f"train.max_steps={STEPS}",
        f"log.every_steps={LOG_EVERY}",
        "ckpt.every_steps=0",
        "log.straggler_every=0",
        *extra,
    ]
    done = run_ddptrain([str(TESTS_DIR / "sync_worker.py"), str(tmp_path), *overrides], nproc=2, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    if extra:
        assert [r["custom_metrics"] for r in read_metrics(tmp_path / "run")] == [
            ["abs_err", "plateau", "target_mean"]
        ] * 3
    logged = {s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS}
    for rank in range(2):
        calls = json.loads((tmp_path / f"syncs-rank{rank}.json").read_text())["calls"]
        device = [(step, kind, where) for step, kind, where, host_side in calls if not host_side]
        assert [c for c in device if c[0] not in logged] == [], f"rank {rank}"
        assert {c[0] for c in device} == logged, f"rank {rank}: the recorder saw no reads on the logged steps"
