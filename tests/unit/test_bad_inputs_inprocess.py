"""Bad input to `ddptrain train`, in this process (milliseconds each): the cases tests/dist/test_bad_input.py
once ran in subprocesses. A real process exiting 2 with one line and writing nothing stays proven there."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers import one_line_exit_2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.cli import main
from ddptrain.config import load_config
from ddptrain.train.start import parameter_count, warn_if_all_warm_up


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_stpes=3"], "unknown key 'train.max_stpes'"),
        (["data.micro_batch_size=four"], "data.micro_batch_size"),
        (["train.global_batch_size=10"], "train.global_batch_size=10 is not divisible by data.micro_batch_size=4"),
    ],
)
def test_train_refuses_a_config_it_cannot_train_and_writes_nothing(
    overrides: list[str], message: str, tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in one_line_exit_2(["train", *tiny_args, *overrides], capsys)
    assert not (tmp_path / "run").exists()


def test_a_rank_outside_the_world_is_refused(
    tiny_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    rc = main(["train", *tiny_args])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in out + err, (rc, out, err)
    # A rank other than 0 says which it is.
    assert lines[0].startswith("[rank 2] ddptrain train: error: RANK=2 is out of range for WORLD_SIZE=2"), lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("warmup", "max_steps", "step", "warned"),
    [(3, 3, 0, True), (5, 3, 0, True), (2, 3, 0, False), (3, 3, 3, False)],  # the last: resumed at the end
)
def test_a_warm_up_covering_the_whole_run_is_a_warning(
    warmup: int, max_steps: int, step: int, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(None, [f"train.warmup_steps={warmup}", f"train.max_steps={max_steps}"])
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        warn_if_all_warm_up(cfg, step)
    said = [r.getMessage() for r in caplog.records if "covers the whole run" in r.getMessage()]
    expected = (
        f"train.warmup_steps={warmup} covers the whole run (train.max_steps={max_steps}): the learning rate never "
        "reaches train.lr=0.003; set train.warmup_steps below train.max_steps (e.g. train.warmup_steps=1)"
    )
    assert said == ([expected] if warned else [])


def test_a_pruned_step_lists_the_steps_there_and_a_longer_resume_at_the_floor_says_so(
    tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eval --step N` of a step ckpt.keep pruned lists the steps that are there; a finished run (its LR at the
    floor) resumed with a larger train.max_steps says in one line that the added steps train at the floor."""
    assert main(["train", *tiny_args, "ckpt.every_steps=2", "ckpt.keep=2"]) == 0
    out, err = capsys.readouterr()
    assert "the learning rate had reached its floor" not in out + err
    line = one_line_exit_2(["eval", str(tmp_path / "run"), "--step", "2"], capsys)
    assert line.endswith(f"no checkpoint for step 2 in {tmp_path / 'run' / 'checkpoints'}; the steps there: 4, 6")
    assert main(["train", *tiny_args, "ckpt.every_steps=2", "ckpt.keep=2", "train.max_steps=9"]) == 0
    out, err = capsys.readouterr()
    said = [line for line in (out + err).splitlines() if "the learning rate had reached its floor" in line]
    assert len(said) == 1 and "by step 6: steps 7 to 9 train at that floor, lr 3.00e-04" in said[0], out + err
    assert main(["eval", str(tmp_path / "run")]) == 0
    assert "perplexity" in capsys.readouterr().out  # the built-in GPT: a next-token cross-entropy


@given(st.integers(0, 10**12))
def test_a_parameter_count_is_never_zero_millions(n: int) -> None:
    shown = parameter_count(n)
    assert shown == f"{n:,}" if n < 10_000 else shown.endswith(("M", "B")) and float(shown[:-1]) > 0


LLAMA_KEYS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "head_dim"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(LLAMA_KEYS), at=st.integers(0, 100))
def test_a_typo_in_an_inline_hf_config_key_is_refused_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, at: int
) -> None:
    """transformers keeps an unknown key as an attribute no model reads (`num_hiden_layers`): refused before
    anything is written, naming the closest settings of the config class."""
    pytest.importorskip("transformers")
    typo = key[: at % len(key)] + key[at % len(key) + 1 :]
    config = f"model.hf.config={{model_type: llama, hidden_size: 64, {typo}: 2}}"
    line = one_line_exit_2(["train", config, f"run.dir={tmp_path / 'run'}"], capsys)
    assert f"model.hf.config.{typo}: LlamaConfig has no such setting" in line
    assert key in line.split("did you mean ")[1].split("?")[0], line
    assert not (tmp_path / "run").exists()


def test_a_model_type_typo_names_the_closest_few_and_declared_keys_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lama`: one short line naming llama (transformers' own lists all 800-odd model types); keys transformers
    consumes (rope_theta, torch_dtype) or maps (gpt2's hidden_size to n_embd) are no typos."""
    pytest.importorskip("transformers")
    from ddptrain.config.model import HFModelConfig
    from ddptrain.models.hf import check_hf_config

    line = one_line_exit_2(["train", "model.hf.config={model_type: lama}", f"run.dir={tmp_path / 'run'}"], capsys)
    assert "model.hf.config.model_type: model_type 'lama' is not one of the " in line and "llama" in line
    assert len(line) < 300 and not (tmp_path / "run").exists()
    check_hf_config(HFModelConfig(config={"model_type": "llama", "rope_theta": 500.0, "torch_dtype": "float32"}))
    check_hf_config(HFModelConfig(config={"model_type": "gpt2", "hidden_size": 64, "num_hidden_layers": 1}))
