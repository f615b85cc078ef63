"""A user error exits with code 2 and one clear message, never a traceback: in real processes, alone and on
2 ranks (the refusals one by one are checked in-process, tests/unit/test_bad_inputs*.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import one_error_line, run_ddptrain, start_ddptrain
from tracking_harness import free_port

pytestmark = pytest.mark.dist


def test_a_refused_command_exits_2_with_one_line_and_writes_nothing(tiny_args: list[str], tmp_path: Path) -> None:
    """The exit-code path in a real process. The many refusals themselves are checked in-process, in milliseconds:
    tests/unit/test_bad_inputs.py and tests/unit/test_bad_inputs_inprocess.py."""
    result = run_ddptrain(["train", "-c", str(tmp_path / "nope.yaml"), *tiny_args])
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert one_error_line(result).startswith("ddptrain train: error: config file not found")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_bad_input_under_torchrun_exits_2_on_every_rank(tiny_args: list[str]) -> None:
    result = run_ddptrain(["train", *tiny_args, "train.global_batch_size=12"], nproc=2, launcher="torchrun")
    assert result.returncode != 0
    assert "train.global_batch_size=12 is not divisible" in result.stderr
    assert "exitcode  : 2" in result.stderr or "exitcode: 2" in result.stderr.replace(" ", "")


def each_rank_alone(args: list[str], world_size: int) -> list[tuple[int, str]]:
    """`ddptrain ARGS` as every rank of a `world_size`-rank job, each a process with the variables torchrun gives
    its workers but no agent: none is stopped because another one exited first, so each shows what it does by
    itself. Each rank's exit code and stderr."""
    port = free_port()
    ranks = [
        start_ddptrain(
            args,
            env={
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    return [(proc.wait(90), proc.communicate()[1]) for proc in ranks]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case",
    [
        # A shard group size that does not divide the world: refused before the rendezvous (and by `ddptrain
        # launch` itself, before any worker starts).
        ("tiny", ["dist.strategy=hsdp", "dist.shard_size=3"], "dist.shard_size=3 does not divide the world size 2"),
        # A user's model under fsdp with no shard units named: refused while wrapping, after the rendezvous.
        ("toy", ["dist.strategy=fsdp"], "cannot tell which submodules of RecordingRegressor to shard or checkpoint"),
    ],
)
def test_sharding_that_cannot_run_exits_2_on_every_rank(
    case: tuple[str, list[str], str], tiny_args: list[str], tmp_path: Path
) -> None:
    model, overrides, message = case
    toy = ["model.target=toy:build_model", "data.target=toy:build_datasets", "data.micro_batch_size=4",
           "train.global_batch_size=8", "train.max_steps=2", f"run.dir={tmp_path / 'toy'}"]  # fmt: skip
    for rank, (code, err) in enumerate(
        each_rank_alone(["train", *(tiny_args if model == "tiny" else toy), *overrides], 2)
    ):
        # One line, no traceback; a rank other than 0 names itself, as its line shares the job's stderr.
        assert code == 2 and re.fullmatch(rf"(\[rank {rank}\] )?ddptrain train: error: [^\n]*\n", err), (code, err)
        assert message in err, err


def test_a_warm_up_covering_the_whole_run_is_warned_once_and_trains(tiny_args: list[str]) -> None:
    result = run_ddptrain(["train", *tiny_args, "train.max_steps=3", "train.warmup_steps=3", "ckpt.every_steps=0"])
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "covers the whole run" in line]
    assert warned == [
        "warning: train.warmup_steps=3 covers the whole run (train.max_steps=3): the learning rate never reaches "
        "train.lr=0.003; set train.warmup_steps below train.max_steps (e.g. train.warmup_steps=1)"
    ]
    # Below the run's length: no warning (tests/unit/test_bad_inputs_inprocess.py).
