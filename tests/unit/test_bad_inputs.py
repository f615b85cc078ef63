"""Every command turns bad input into exit code 2 and one line naming what is wrong, never a traceback.

The cases run through `cli.main` in this process (fast); tests/dist/test_bad_input.py and
tests/dist/test_exit_codes.py run the real command in subprocesses and under launchers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY, prepare_tiny_corpus

from ddptrain.cli import main


def assert_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """main(argv) exits 2 with exactly one stderr line that starts with the command and contains message."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert re.match(rf"(\[rank \S+\] )?ddptrain {argv[0]}: error:", lines[0]), lines  # a rank > 0 says which
    assert message in lines[0], lines[0]
    assert "Traceback" not in err + out


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def tiny(tiny_corpus: Path, tmp_path: Path) -> list[str]:
    return [*TINY, f"data.dir={tiny_corpus}", f"run.dir={tmp_path / 'run'}"]


# ---- train: values that cannot train ----------------------------------------------------------

BAD_VALUES = [
    ("train.lr=.inf", "train.lr: Input should be a finite number"),
    ("train.lr=.nan", "train.lr: Input should be a finite number"),
    ("train.lr=1e9", "train.lr"),
    ("train.lr=0", "train.lr"),
    ("train.betas=[0.9,2]", "each AdamW beta must be in [0, 1)"),
    ("train.betas=[0.9,-0.1]", "each AdamW beta must be in [0, 1)"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.betas=0.9", "train.betas"),
    ("train.weight_decay=.inf", "train.weight_decay"),
    ("train.grad_clip=.nan", "train.grad_clip"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("dist.timeout_s=.inf", "dist.timeout_s"),
    ("dist.timeout_s=1e300", "dist.timeout_s"),
    ("dist.startup_timeout_s=-5", "dist.startup_timeout_s"),
    ("ckpt.timeout_s=0", "ckpt.timeout_s"),
    ("dist.bucket_cap_mb=.inf", "dist.bucket_cap_mb"),
    ("run.seed=99999999999999999999", "run.seed"),
    ("run.seed=-1", "run.seed"),
    ("train.max_steps=true", "train.max_steps: Input should be a valid integer"),
    ("train.max_steps=3.0", "train.max_steps: Input should be a valid integer"),
    ("train.max_steps='5'", "train.max_steps"),
    ("data.micro_batch_size=false", "data.micro_batch_size"),
    ("ckpt.keep=1.5", "ckpt.keep"),
    ("ckpt.async=1", "ckpt.async"),
    ("train.compile=yes please", "train.compile"),
    ("log.straggler_factor=.nan", "log.straggler_factor"),
    ("log.peak_tflops=-1", "log.peak_tflops"),
    ("model.dropout=1", "model.dropout"),
    ("model.n_layer=0", "model.n_layer"),
    ("dist.strategy=zero3", "dist.strategy"),
    ("dist.strategy=hsdp", "dist.strategy=hsdp needs dist.shard_size"),
    ("dist.shard_size=2", "dist.shard_size applies to dist.strategy=hsdp only"),
    ("dist.shard_size=0", "dist.shard_size"),
    ("model.shard_units=Block", "model.shard_units: Input should be a valid list"),
    ("train.activation_checkpointing=some", "train.activation_checkpointing"),
    ("train.activation_checkpointing_every=0", "train.activation_checkpointing_every"),
    ("train.bogus=1", "unknown key 'train.bogus'"),
    ("train=3", "train"),
    ("train.max_steps.deeper=3", "is a value, not a section"),
    # run.name is a folder under runs/ (and a tracker's run name); paths and names are one line.
    ("run.name=''", "run.name: must name one folder under runs/"),
    ("run.name=..", "run.name: must name one folder under runs/"),
    ("run.name=a/b", "run.name: must name one folder under runs/"),
    ('run.name="x\\necho INJECTED >&2"', "run.name: must be one line without control characters"),
    ('run.dir="runs/a\\0b"', "run.dir: must be one line without control characters (found '\\x00'"),
    ('run.dir="runs/a\\nb"', "run.dir: must be one line"),
    ('data.dir="data/\\u2028x"', "data.dir: must be one line"),
    ('ckpt.resume="a\\rb"', "ckpt.resume: must be one line"),
    # A collate that cannot batch is refused before any collective, the run folder untouched.
    ("data.collate=no_such_module:collate", "data.collate='no_such_module:collate': cannot import 'no_such_module'"),
    (
        "data.collate=ddptrain.data.collate:PAD",
        "data.collate='ddptrain.data.collate:PAD': 'ddptrain.data.collate' has no callable 'PAD'",
    ),
    ("data.collate=padding", "data.collate='padding' must look like 'package.module:function'"),
    ("data.kwargs." + ".".join(["k"] * 40) + "=1", "nests deeper than 32 levels"),
    ("data.kwargs.k=" + "[" * 300 + "]" * 300, "nests deeper than 32 levels"),
]


@pytest.mark.parametrize(("override", "message"), BAD_VALUES)
def test_train_refuses_values_that_cannot_train(
    override: str, message: str, tiny: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_exit_2(["train", *tiny, override], message, capsys)


DILOCO = [
    (["dist.strategy=hsdp", "dist.shard_size=1"], "train.diloco trains each group with DDP or FSDP over its own ranks: dist.strategy=hsdp is not supported with it"),
    (["dist.grad_compression=powersgd"], "dist.grad_compression=powersgd is not supported with it"),
    (["ckpt.format=dcp"], "ckpt.format=dcp is not supported with it"),
    (["train.eval_every=3"], "train.eval_every=3 must be a multiple of train.diloco.every_steps=2"),
    (["train.on_nonfinite=stop"], "train.on_nonfinite=stop would stop one group alone: use skip"),
    (["train.diloco.groups=2"], "train.diloco.groups=2 does not divide the world size 1"),
    (["train.diloco.outer_momentum=1"], "train.diloco.outer_momentum"),
    (["train.diloco.outer_lr=0"], "train.diloco.outer_lr"),
    (["train.diloco.outer_dtype=int4"], "train.diloco.outer_dtype"),
    (["train.diloco.fragments=0"], "train.diloco.fragments"),
    (["train.diloco.fragments=3"], "train.diloco.fragments=3 must be at most every_steps=2"),
    (["train.diloco.fragments=2", "train.eval_every=2"], "train.eval_every must be 0 or at least train.max_steps"),
    (["train.diloco.every_steps=0", "train.diloco.outer_dtype=int8"], "set train.diloco.every_steps above 0"),
    (["train.diloco.every_steps=0", "train.diloco.delay_steps=1"], "set train.diloco.every_steps above 0"),
    (["train.diloco.delay_steps=-1"], "train.diloco.delay_steps"),
    (["train.diloco.delay_steps=2"], "train.diloco.delay_steps=2 must be below every_steps // fragments = 2"),
    (["train.diloco.fragments=2", "train.diloco.delay_steps=1"], "delay_steps=1 must be below every_steps // fragments = 1"),
    (["train.diloco.delay_steps=1", "train.eval_every=2"], "delay_steps=1 leaves every group on the global weights at the last step only"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), DILOCO)
def test_train_refuses_diloco_combinations_that_cannot_work(
    overrides: list[str], message: str, tiny: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_exit_2(["train", *tiny, "train.diloco.every_steps=2", *overrides], message, capsys)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_train_refuses_more_fragments_than_trainable_tensors(
    tiny: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Known once the model is built (as model.shard_units' typos are): the folder then holds its logs only."""
    fragments = ["train.diloco.every_steps=64", "train.diloco.fragments=64"]
    assert_one_line_exit_2(["train", *tiny, *fragments], "fragments=64 is more than the model's 9 trainable", capsys)


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_a_diloco_checkpoint_resumes_only_as_it_was_saved(
    tiny: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A change of every_steps, of the groups, of the fragments, of delay_steps or of dist.strategy, and leaving
    DiLoCo are refused in one line, leaving the folder as it was; its checkpoints hold this rank's own state
    (diloco-rank0.pt) beside the global weights. (Trained in 2 fragments sent in int8: fragment 1 syncs after step 2, both after 3.)"""
    streaming = ["train.diloco.every_steps=4", "train.diloco.fragments=2", "train.diloco.outer_dtype=int8"]
    assert main(["train", *tiny, *streaming, "train.max_steps=3", "ckpt.every_steps=3"]) == 0
    capsys.readouterr()
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-00000003" / "diloco-rank0.pt").is_file()
    before = _files(run)
    saved = "from a checkpoint saved with every_steps=4, 1 group(s), fragments=2, delay_steps=0"
    again = ["train", *tiny, "train.max_steps=6"]
    refused = f"every_steps=3, 1 group(s), fragments=1, delay_steps=0) {saved}"
    assert_one_line_exit_2([*again, "train.diloco.every_steps=3"], refused, capsys)
    refused = f"every_steps=4, 1 group(s), fragments=1, delay_steps=0) {saved}"
    assert_one_line_exit_2([*again, "train.diloco.every_steps=4", "train.diloco.outer_dtype=int8"], refused, capsys)
    refused = f"every_steps=4, 1 group(s), fragments=2, delay_steps=1) {saved}"
    assert_one_line_exit_2([*again, *streaming, "train.diloco.delay_steps=1"], refused, capsys)
    refused = "cannot resume DiLoCo under dist.strategy=fsdp from a checkpoint saved under dist.strategy=ddp"
    assert_one_line_exit_2([*again, *streaming, "dist.strategy=fsdp"], refused, capsys)  # its own state: whole
    assert_one_line_exit_2(again, "cannot resume without train.diloco from a checkpoint DiLoCo saved", capsys)
    after = _files(run)
    assert {k: v for k, v in after.items() if not k.startswith("logs/")} == {
        k: v for k, v in before.items() if not k.startswith("logs/")
    }


SHARDING = [
    (["dist.strategy=fsdp", "train.precision=fp16"], "train.precision=fp16 is not supported with dist.strategy=fsdp"),
    (["dist.strategy=hsdp", "dist.shard_size=3"], "dist.shard_size=3 does not divide the world size 1"),
    # Shard units are looked up for activation checkpointing too, so a single process sees the typo.
    (
        ["model.shard_units=[Blok]", "train.activation_checkpointing=full"],
        "model.shard_units ['Blok'] match no submodule",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), SHARDING)
def test_train_refuses_sharding_that_cannot_run(
    overrides: list[str], message: str, tiny: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_exit_2(["train", *tiny, *overrides], message, capsys)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


CONFIG_FILES = [
    (b"train:\n  max_steps: 3\ntrain:\n  lr: 0.1\n", "duplicate key 'train'"),
    (b"train:\n  max_steps: 3\n  max_steps: 4\n", "duplicate key 'max_steps'"),
    (b"train:\n  lr: 0.1\n  \xff\xfe bad bytes\n", "is not UTF-8 text"),
    (b"train: {max_steps: 3\n", "is not valid YAML"),
    (b"- a\n- list\n", "must hold a mapping of sections"),
    (b"train: {max_steps: !!python/object:os.system ls}\n", "is not valid YAML"),
    # A "billion laughs": aliases nested 7 deep expand to 10**8 values; refused before anything expands.
    pytest.param(
        b"data:\n  kwargs:\n    a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
        + b"".join(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n".encode() for i in range(1, 8)),
        "expands to more than 20,000 values",
        id="billion-laughs",
    ),
    pytest.param(
        b"data:\n  kwargs:\n    k: " + b"[" * 400 + b"]" * 400 + b"\n", "nests deeper than 32", id="deep-list"
    ),
    pytest.param(
        b"data:\n  kwargs:\n    k: " + b"{a: " * 400 + b"1" + b"}" * 400, "nests deeper than 32", id="deep-map"
    ),
    (b"data:\n  kwargs: &a\n    k: *a\n", "uses an alias inside its own anchor"),
    pytest.param(b"data:\n  kwargs:\n    k: " + b"9" * 5000 + b"\n", "Exceeds the limit (4300 digits)", id="bigint"),
    pytest.param(
        b"data:\n  kwargs:\n    k: &s " + b"x" * 200_000 + b"\n    j: *s\n",
        "expands to more than 262,144 characters",
        id="long-alias",
    ),
    pytest.param(b"run:\n  name: x\n" + b"#" * (4 << 20), "is larger than 4,194,304 bytes", id="huge-file"),
    (b'model:\n  init_from: "runs/a\\0b"\n', "model.init_from: must be one line without control characters"),
]


@pytest.mark.parametrize(("content", "message"), CONFIG_FILES)
def test_train_refuses_bad_config_files(
    content: bytes, message: str, tiny: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write(tmp_path / "cfg.yaml", content)
    assert_one_line_exit_2(["train", "-c", str(cfg), *tiny], message, capsys)


def test_train_refuses_config_paths_that_are_not_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_exit_2(["train", "-c", str(tmp_path)], "is not a file", capsys)
    assert_one_line_exit_2(["train", "-c", str(tmp_path / "absent.yaml")], "config file not found", capsys)
    if os.geteuid() != 0:  # root reads every file whatever its mode
        unreadable = write(tmp_path / "locked.yaml", b"train: {max_steps: 3}\n")
        unreadable.chmod(0)
        assert_one_line_exit_2(["train", "-c", str(unreadable)], "cannot read config file", capsys)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # no writer ever comes: a blocking open would hang (the test's timeout would end it)
    assert_one_line_exit_2(["train", "-c", str(fifo)], "is not a file", capsys)


def test_train_refuses_data_the_model_cannot_use(
    tiny: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_exit_2(["train", *tiny, "model.vocab_size=100"], "is smaller than the", capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    for split in ("train", "val"):
        (empty / f"{split}.bin").write_bytes(b"")
    nothing = hashlib.sha256(b"").hexdigest()  # a legacy corpus (train.bin, val.bin) of no bytes
    legacy = {"vocab_size": 256, "train_tokens": 0, "val_tokens": 0, "sha256": nothing}
    (empty / "meta.json").write_text(json.dumps(legacy))
    assert_one_line_exit_2(["train", *tiny, f"data.dir={empty}"], "holds 0 tokens in this split", capsys)
    (empty / "meta.json").write_text("{not json")
    assert_one_line_exit_2(["train", *tiny, f"data.dir={empty}"], "meta.json is not valid JSON", capsys)
    assert_one_line_exit_2(["train", *tiny, f"data.dir={tmp_path / 'absent'}"], "no prepared corpus in", capsys)


def test_train_refuses_a_run_folder_it_cannot_write(
    tiny: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = write(tmp_path / "file", b"")
    assert_one_line_exit_2(["train", *tiny, f"run.dir={a_file / 'run'}"], "Not a directory", capsys)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs (needs root and mount rights; skipped otherwise)."""
    path = tmp_path / "ro"
    path.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_train_on_a_read_only_disk(tiny: list[str], read_only_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_exit_2(["train", *tiny, f"run.dir={read_only_dir / 'run'}"], "Read-only file system", capsys)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ],
)
def test_train_refuses_a_bad_torchrun_environment(
    env: dict[str, str],
    message: str,
    tiny: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for key, value in {**base, **env}.items():
        monkeypatch.setenv(key, value)
    assert_one_line_exit_2(["train", *tiny], message, capsys)


# ---- the other commands ------------------------------------------------------------------------


def other_command_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, message) for every command but train; tmp holds a run folder and some files."""
    run = tmp / "run"
    a_file = tmp / "file.txt"
    slurm = ["slurm", "train.max_steps=5", f"run.dir={run}"]
    k8s = ["k8s", "--image", "registry/ddptrain:1", "train.max_steps=5", f"run.dir={run}"]
    return [
        (["prepare", "--val-fraction", "nan", str(a_file), "--out", str(tmp / "p")], "--val-fraction nan"),
        (["prepare", "--val-fraction", "0.7", str(a_file), "--out", str(tmp / "p")], "--val-fraction 0.7"),
        (["prepare", "--val-fraction", "0", str(a_file), "--out", str(tmp / "p")], "--val-fraction 0"),
        (["prepare", str(a_file), "--out", str(a_file)], "exists and is not a folder"),
        (["prepare", str(tmp / "*.none"), "--out", str(tmp / "p")], "no files match"),
        (["prepare", str(a_file), "--out", str(tmp / "p")], "corpus too small"),
        (["export", str(run), "--out", str(tmp)], "is a folder; give a file name"),
        (["export", str(run), "--out", str(a_file / "m.safetensors")], "Not a directory"),
        (["export", str(run), "--out", str(tmp / "m.json")], "use .safetensors"),
        (["export", str(tmp / "absent"), "--out", str(tmp / "m.safetensors")], "does not exist"),
        (["export", str(run), "--out", str(tmp / "m.safetensors"), "--step", "-3"], "--step -3"),
        (["export", str(run), "--out", str(tmp / "m.safetensors"), "--step", "7"], "no checkpoint for step 7"),
        (["export", str(run), "--out", str(tmp / "m.safetensors")], "no committed checkpoint"),
        (["report", str(run)], "without a valid 'loss'"),
        (["report", str(tmp / "absent")], "does not exist"),
        (["report", str(run), "--out", str(a_file)], "exists and is not a folder"),
        (["generate", str(run), "--temperature", "nan"], "--temperature nan"),
        (["generate", str(run), "--temperature", "inf"], "--temperature inf"),
        (["generate", str(run), "--temperature", "0"], "--temperature 0"),
        (["generate", str(run), "--top-k", "-5"], "--top-k -5"),
        (["generate", str(run), "--max-new-tokens", "-1"], "--max-new-tokens -1"),
        (["generate", str(run), "--seed", "-1"], "--seed -1"),
        (["generate", str(run), "--prompt", "caf\udce9"], "--prompt is not valid UTF-8"),
        (["generate", str(tmp / "absent")], "does not exist"),
        (["doctor", "--timeout", "nan"], "--timeout nan"),
        (["doctor", "--timeout", "-1"], "--timeout -1"),
        (["doctor", "--max-mb", "inf"], "--max-mb inf"),
        (["doctor", "--endpoint", "nohost"], "--endpoint 'nohost'"),
        (["doctor", "--params", "-5"], "--params -5"),
        (["doctor", "--step-s", "0.3"], "--step-s needs --params"),
        (["doctor", "--params", "1e6", "--step-s", "0"], "--step-s 0"),
        (["launch", "--nproc-per-node", "0", "--", "train"], "--nproc-per-node '0'"),
        (["launch", "--nproc-per-node", "x", "--", "train"], "--nproc-per-node 'x'"),
        (["launch", "--rdzv-endpoint", "h:99999", "--", "train"], "HOST:PORT"),
        (["launch", "--monitor-interval", "nan", "--", "train"], "--monitor-interval nan"),
        (["launch", "--exit-barrier-timeout", "inf", "--", "train"], "--exit-barrier-timeout inf"),
        (["launch", "--rdzv-timeout", "0", "--", "train"], "--rdzv-timeout 0"),
        (["launch", "--signals-to-handle", "SIGNOPE", "--", "train"], "'SIGNOPE' is not a signal name"),
        (["launch", "--rdzv-conf", "oops", "--", "train"], "must look like KEY=VALUE"),
        (["launch", "--", "train", "train.bogus=1"], "unknown key 'train.bogus'"),
        (["launch", "--dry-run", "--", "train", "train.lr=.inf"], "train.lr"),
        (["launch", "--dry-run", "--", "train", "-c", str(tmp / "absent.yaml")], "config file not found"),
        (
            [
                "launch",
                "--dry-run",
                "--nproc-per-node",
                "3",
                "--",
                "train",
                "train.global_batch_size=8",
                "data.micro_batch_size=4",
            ],
            "not divisible",
        ),
        (["launch", "--dry-run", "--", "train", "--no-such-flag"], "unrecognized arguments"),
        (["launch", "--dry-run", "--", "launch", "--", "train"], "cannot be launch itself"),
        (["launch", "--dry-run", "--", "nosuchcommand"], "invalid choice"),
        ([*slurm, "--out", str(tmp / "missing" / "job.sbatch")], "does not exist"),
        ([*slurm, "--out", str(tmp)], "is a folder"),
        ([*slurm, "--sbatch-arg", "--qos=high\nrm -rf /"], "must be one line"),
        ([*slurm, "--partition", "gpu\necho hi"], "must be one line"),
        ([*slurm, "--step-seconds", "inf"], "--step-seconds (inf)"),
        ([*slurm, "--save-seconds", "nan"], "--save-seconds (nan)"),
        ([*slurm, "--nodes", "0"], "--nodes must be at least 1"),
        ([*slurm, "--nproc-per-node", "0"], "--nproc-per-node"),
        ([*slurm, "--gpus-per-node", "-1"], "--gpus-per-node"),
        ([*slurm, "--rdzv-port", "0"], "--rdzv-port 0"),
        ([*slurm, "ckpt.resume=never"], "use ckpt.resume=auto"),
        ([*slurm, "train.lr=.nan"], "train.lr"),
        ([*k8s, "--step-seconds", "inf"], "--step-seconds (inf)"),
        ([*k8s, "--out", str(tmp / "missing" / "job.yaml")], "does not exist"),
        ([*k8s, "--nodes", "0"], "--nodes and --nproc-per-node"),
        ([*k8s, "--min-nodes", "5", "--nodes", "2"], "--min-nodes 5"),
        ([*k8s, "--namespace", "a\nb"], "must be one line"),
        (["k8s", "--image", "bad image", f"run.dir={run}"], "without spaces"),
        ([*k8s, "--grace-seconds", "5"], "--grace-seconds=5 s is shorter"),
        (["triage", str(tmp / "absent")], "stacks folder: this run recorded no hang"),
        (["triage", str(run)], "stacks folder: this run recorded no hang"),
        (["triage", str(a_file)], "stacks folder: this run recorded no hang"),
        (["verify-resume", str(run), "--steps", "0"], "--steps must be at least 1"),
        (["verify-resume", str(run), "--steps", "-4"], "--steps must be at least 1"),
        (["verify-resume", str(run)], "certificate.jsonl not found"),
        (["verify-resume", str(tmp / "absent"), "--from", "3"], "certificate.jsonl not found"),
    ]


def test_every_other_command_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # A metrics file whose records lack the keys a report reads.
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n')
    (tmp_path / "file.txt").write_text("x = 1\n")
    failures = []
    for argv, message in other_command_cases(tmp_path):
        try:
            assert_one_line_exit_2(argv, message, capsys)
        except AssertionError as e:
            failures.append(f"{argv}: {e}")
    assert not failures, "\n".join(failures)


def bad_inputs_per_command() -> Counter[str]:
    """How many bad inputs this module tries, per command (the figure the hardening issue asks for)."""
    counts = Counter(argv[0] for argv, _ in other_command_cases(Path("/tmp")))
    # BAD_VALUES, CONFIG_FILES, 3-4 config paths, 4 data cases, 2 run folders, 4 environments
    counts["train"] += len(BAD_VALUES) + len(CONFIG_FILES) + 3 + 4 + 2 + 4
    return counts


def test_every_command_is_tried() -> None:
    counts = bad_inputs_per_command()
    print("bad inputs tried per command:", dict(sorted(counts.items())))
    assert all(
        counts[c] >= 3
        for c in (
            "train",
            "prepare",
            "export",
            "report",
            "generate",
            "doctor",
            "launch",
            "slurm",
            "k8s",
            "triage",
            "verify-resume",
        )
    )
