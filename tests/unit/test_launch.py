"""`ddptrain launch` option handling: the torchrun command it stands for, and its errors (exit 2)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest

from ddptrain.cli import main
from ddptrain.launch.agent import QuietStops
from ddptrain.launch.launcher import exit_code_for
from ddptrain.launch.torchrun_args import default_run_id, interface_of


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["launch", "--dry-run", *args]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_node_at_the_endpoint_hosts_the_rendezvous(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    common = ["--nnodes", "2", "--rdzv-endpoint", "10.9.0.1:29500"]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("train: {max_steps: 3}\n")  # --dry-run validates the worker command: the file must exist
    host = dry_run(capsys, *common, "--node-addr", "10.9.0.1", "--", "train", "-c", str(cfg), "train.max_steps=5")
    other = dry_run(capsys, *common, "--node-addr", "10.9.0.2", "--", "train", "-c", str(cfg), "train.max_steps=5")
    assert "--rdzv-conf is_host=true," in host and "--local-addr 10.9.0.1" in host
    assert "--rdzv-conf is_host=false," in other and "--local-addr 10.9.0.2" in other
    run_id = default_run_id("10.9.0.1:29500")
    for line in (host, other):  # the same id on every node, with nothing passed around
        assert f"--rdzv-id {run_id}" in line
        assert "--rdzv-backend c10d" in line and "SIGUSR1" in line
        assert line.endswith(f"-m ddptrain train -c {cfg} train.max_steps=5")


def test_dry_run_line_is_what_torchrun_parses(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from torch.distributed.run import get_args_parser

    line = dry_run(
        capsys,
        "--nnodes",
        "1:4",
        "--rdzv-endpoint",
        "127.0.0.1:29511",
        "--node-addr",
        "127.0.0.1",
        "--max-restarts",
        "5",
        "--run-id",
        "job7",
        "--",
        "train",
    )
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words[: words.index("torchrun")])
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # found from the advertised address
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    args = get_args_parser().parse_args(words[words.index("torchrun") + 1 :])
    assert (args.nnodes, args.rdzv_id, args.max_restarts, args.module) == ("1:4", "job7", 5, True)
    assert (args.training_script, args.training_script_args) == ("ddptrain", ["train"])


def test_single_node_needs_no_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    line = dry_run(capsys, "--nproc-per-node", "2", "--", "train")
    assert "--rdzv-endpoint localhost:0" in line and "--nproc-per-node 2" in line


def test_auto_on_a_node_without_a_gpu_is_one_worker_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto means one worker per GPU here")
    assert main(["launch", "--dry-run", "--nproc-per-node", "auto", "--", "train"]) == 0
    out, err = capsys.readouterr()
    assert "--nproc-per-node 1 " in out.splitlines()[0]  # torchrun's own auto: one worker per CPU
    assert err == (
        f"ddptrain launch: --nproc-per-node auto: no GPU on this node, so 1 worker using its {os.cpu_count()} "
        "CPUs through intra-op threads; pass a number for more ranks\n"
    )


def test_stale_torchrun_variables_are_ignored(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_NNODES", "7")
    line = dry_run(capsys, "--", "train")
    assert "--nnodes 1" in line


def test_scheduler_variables_that_contradict_the_command_are_named() -> None:
    """What the Kubeflow operator injects is compared with the command line, which wins."""
    from ddptrain.cli_options import add_options, from_args
    from ddptrain.launch.options import LaunchOptions
    from ddptrain.launch.torchrun_args import pet_conflicts

    parser = argparse.ArgumentParser()
    add_options(parser, LaunchOptions)
    argv = ["--nnodes", "2:2", "--rdzv-endpoint", "job-master-0:29400", "--", "train"]
    args = from_args(LaunchOptions, parser.parse_args(argv))
    agreeing = {"PET_NNODES": "2:2", "PET_RDZV_ENDPOINT": "job-master-0:29400", "PET_NODE_RANK": "1"}
    assert pet_conflicts(args, agreeing) == []
    (line,) = pet_conflicts(args, {**agreeing, "PET_RDZV_ENDPOINT": "job-worker-0:29400"})
    assert "PET_RDZV_ENDPOINT=job-worker-0:29400" in line and "--rdzv-endpoint job-master-0:29400" in line


def test_a_python_script_runs_as_torchrun_runs_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import shlex

    from torch.distributed.run import get_args_parser

    script = tmp_path / "train_api.py"
    script.write_text("import sys\nsys.exit(0)\n")
    words = shlex.split(dry_run(capsys, "--nproc-per-node", "2", "--", str(script), "runs/api", "--fast"))
    args = get_args_parser().parse_args(words[words.index("torchrun") + 1 :])
    assert (args.module, args.training_script, args.training_script_args) == (
        False,
        str(script),
        ["runs/api", "--fast"],
    )
    assert main(["launch", "--", str(tmp_path / "missing.py")]) == 2
    assert "worker command: no Python script" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2", "--", "train"], "needs --rdzv-endpoint"),
        (["--preempted-exit-code", "1", "--", "train"], "--preempted-exit-code 1 must be 3-255"),
        (["--nnodes", "3:2", "--rdzv-endpoint", "h:1", "--", "train"], "0 < MIN <= MAX"),
        (["--nnodes", "x", "--", "train"], "must be a number or MIN:MAX"),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost", "--", "train"], "HOST:PORT"),
        (["--max-restarts", "-1", "--", "train"], "--max-restarts -1 must be"),
        ([], "nothing to launch"),
    ],
)
def test_bad_options_exit_2_with_one_message(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["launch", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_job_exit_code_from_worker_codes() -> None:
    assert exit_code_for([0, 0]) == 0
    assert exit_code_for([75, -15]) == 75  # one worker preempted: the job is resumable
    assert exit_code_for([2, 2]) == 2
    assert exit_code_for([1, 2]) == 2  # bad input wins: a retry cannot help
    assert exit_code_for([-15, 2]) == 2
    assert exit_code_for([130, 130]) == 130
    assert exit_code_for([-9]) == 1


def test_interface_lookup() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here


def test_torch_lines_the_launcher_says_in_its_own_words_are_dropped_and_others_kept() -> None:
    """Issue 38, item 14: torchelastic's per-process lines of a stop or a failure give way to the launcher's one
    line; its other lines (a rendezvous, a restart's reason) still reach stderr."""
    quiet = QuietStops()

    def kept(msg: str, *args: object) -> bool:
        return quiet.filter(
            logging.LogRecord("torch.distributed.elastic", logging.WARNING, "api.py", 1, msg, args, None)
        )

    assert not kept("Received %s death signal, shutting down workers", 2)
    assert not kept("Closing process %s via signal %s", 123, "SIGINT")
    assert not kept("Terminating process %s via signal SIGTERM", 123)
    assert not kept("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)", 130, 0, 1, "f", "x")
    assert kept("[%s] Rendezvous complete for workers. Result:", "default")
    assert kept("Detected %s new nodes from group_rank=%s; will restart worker group", 1, 0)
