"""Every user error exits with code 2 and one clear message, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_ddptrain

pytestmark = pytest.mark.dist


def assert_user_error(result, message: str) -> None:  # type: ignore[no-untyped-def]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    assert_user_error(run_ddptrain(["train", "-c", str(tmp_path / "nope.yaml")]), "config file not found")


def test_invalid_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {max_steps: 3\n")
    assert_user_error(run_ddptrain(["train", "-c", str(bad)]), "is not valid YAML")


def test_unknown_key_and_wrong_type(tiny_args: list[str]) -> None:
    assert_user_error(run_ddptrain(["train", *tiny_args, "train.max_stpes=3"]), "unknown key 'train.max_stpes'")
    assert_user_error(run_ddptrain(["train", *tiny_args, "data.micro_batch_size=four"]), "data.micro_batch_size")


def test_indivisible_batch(tiny_args: list[str]) -> None:
    result = run_ddptrain(["train", *tiny_args, "train.global_batch_size=10"])
    assert_user_error(result, "train.global_batch_size=10 is not divisible by data.micro_batch_size=4")


def test_missing_data(tiny_args: list[str], tmp_path: Path) -> None:
    result = run_ddptrain(["train", *tiny_args, f"data.dir={tmp_path / 'absent'}"])
    assert_user_error(result, "no prepared corpus in")


def test_rank_out_of_range(tiny_args: list[str]) -> None:
    env = {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    assert_user_error(run_ddptrain(["train", *tiny_args], env=env), "RANK=2 is out of range for WORLD_SIZE=2")


def test_prepare_with_no_matching_files(tmp_path: Path) -> None:
    result = run_ddptrain(["prepare", str(tmp_path / "*.txt"), "--out", str(tmp_path / "out")])
    assert_user_error(result, "no files match")


@pytest.mark.timeout(120)
def test_bad_input_under_torchrun_exits_2_on_every_rank(tiny_args: list[str]) -> None:
    result = run_ddptrain(["train", *tiny_args, "train.global_batch_size=12"], nproc=2)
    assert result.returncode != 0
    assert "train.global_batch_size=12 is not divisible" in result.stderr
    assert "exitcode  : 2" in result.stderr or "exitcode: 2" in result.stderr.replace(" ", "")


@pytest.mark.timeout(120)
def test_sharding_that_cannot_run_exits_2_on_every_rank(tiny_args: list[str], tmp_path: Path) -> None:
    # A shard group size that does not divide the world: refused before the rendezvous.
    bad_groups = run_ddptrain(["train", *tiny_args, "dist.strategy=hsdp", "dist.shard_size=3"], nproc=2)
    # A user's model under fsdp with no shard units named: refused while wrapping, on every rank alike.
    toy = ["model.target=toy:build_model", "data.target=toy:build_datasets", "data.micro_batch_size=4",
           "train.global_batch_size=8", "train.max_steps=2", f"run.dir={tmp_path / 'toy'}"]  # fmt: skip
    no_units = run_ddptrain(["train", *toy, "dist.strategy=fsdp"], nproc=2)
    for result, message in (
        (bad_groups, "dist.shard_size=3 does not divide the world size 2"),
        (no_units, "cannot tell which submodules of RecordingRegressor to shard or checkpoint: set model.shard_units"),
    ):
        # One line per rank (the two ranks' lines may interleave on the shared stderr).
        assert result.stderr.count("ddptrain train: error:") == result.stderr.count(message) == 2, result.stderr[-3000:]
        # Both ranks printed their line; torchrun may SIGTERM the second before its own exit 2 lands,
        # so only the first failure's exit code is certain.
        assert result.returncode != 0 and "exitcode:2" in result.stderr.replace(" ", ""), result.stderr[-3000:]
        # The one traceback is torchrun's agent reporting the failed workers; the workers print none.
        assert result.stderr.count("Traceback") == 1 and "ChildFailedError" in result.stderr


def test_a_warm_up_covering_the_whole_run_is_warned_once_and_trains(tiny_args: list[str]) -> None:
    result = run_ddptrain(["train", *tiny_args, "train.max_steps=3", "train.warmup_steps=3", "ckpt.every_steps=0"])
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "covers the whole run" in line]
    assert warned == [
        "warning: train.warmup_steps=3 covers the whole run (train.max_steps=3): the learning rate never reaches "
        "train.lr=0.003; set train.warmup_steps below train.max_steps (e.g. train.warmup_steps=1)"
    ]
    fine = run_ddptrain(["train", *tiny_args, "train.max_steps=3", "train.warmup_steps=2", "ckpt.resume=never",
                         "ckpt.existing=archive", "ckpt.every_steps=0"])
    assert fine.returncode == 0 and "covers the whole run" not in fine.stdout + fine.stderr, fine.stderr
