"""The checkpoint format a run saves with (ckpt.format): every registered format names itself, `auto` picks today's format for each strategy, every format round-trips a Trainer's state through
save, verify and resume when chosen, and a format that cannot save the strategy's state is refused
in one line (exit 2) before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from helpers import make_trainer, one_line_exit_2

from ddptrain.checkpoint import verify_checkpoint
from ddptrain.checkpoint.formats.registry import auto_format, checkpoint_format, format_class
from ddptrain.config import CkptConfig, DistConfig
from ddptrain.config.kinds import FORMATS
from ddptrain.errors import ConfigError

STRATEGIES = get_args(DistConfig.model_fields["strategy"].annotation)


def test_auto_picks_the_format_each_strategy_saved_with_before_the_key_existed() -> None:
    assert CkptConfig().format == "auto" and FORMATS.choices == ["auto", *FORMATS]
    assert (
        {s: auto_format(s) for s in STRATEGIES}
        == {s: checkpoint_format("auto", s).name for s in STRATEGIES}
        == {
            "ddp": "sharded",
            "fsdp": "dcp",
            "hsdp": "dcp",
        }
    )


def test_each_format_names_itself_and_saves_some_strategy() -> None:
    for name in FORMATS:
        cls = format_class(name)
        assert cls().name == name and cls.strategies and cls.strategies <= set(STRATEGIES)
        assert checkpoint_format(name, sorted(cls.strategies)[0]).name == name


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_round_trips_a_trainer_when_chosen(corpus_dir: Path, tmp_path: Path, name: str) -> None:
    run_dir, chosen = tmp_path / "run", [f"ckpt.format={name}"]
    first = make_trainer(corpus_dir, run_dir, chosen)
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    (result,) = first.checkpointer.finished()
    assert result.ok and result.path is not None, result.error
    assert verify_checkpoint(result.path).manifest.writer == name

    second = make_trainer(corpus_dir, run_dir, chosen)  # ckpt.resume=auto: verifies and loads step 2
    assert second.step == 2
    assert _equal(first.model.state_dict(), second.model.state_dict())
    assert _equal(first.optimizer.state_dict(), second.optimizer.state_dict())
    assert _equal(first.scheduler.state_dict(), second.scheduler.state_dict())
    assert first.sampler.state_dict() == second.sampler.state_dict()
    rng = torch.get_rng_state()  # the resumed run's streams: both take the next step from them
    resumed = second.train_step()
    torch.set_rng_state(rng)
    assert torch.equal(first.train_step().loss, resumed.loss)


@pytest.mark.parametrize("name", sorted(n for n in FORMATS if "fsdp" not in format_class(n).strategies))
def test_a_format_that_cannot_save_the_strategy_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=f"ckpt.format={name} cannot save a dist.strategy=fsdp run; use "):
        checkpoint_format(name, "fsdp")


def test_the_refusal_is_one_line_before_anything_is_written(
    tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line_exit_2(["train", *tiny_args, "dist.strategy=fsdp", "ckpt.format=sharded"], capsys)
    assert "ckpt.format=sharded cannot save a dist.strategy=fsdp run; use ckpt.format=auto or one of: dcp" in line
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "checkpoints").exists()
