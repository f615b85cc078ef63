"""`ddptrain launch --fault-tolerance torchft`: the per-group torchrun lines --dry-run prints, the one-line
refusals (exit 2), the job's exit code over its groups, and the command line a local job hands each group."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.run import get_args_parser

from ddptrain.cli import main
from ddptrain.cli_options import add_options, from_args, to_argv
from ddptrain.launch.ft_launch import groups_exit_code
from ddptrain.launch.options import LaunchOptions

FT = ["--fault-tolerance", "torchft"]


def dry_run_groups(capsys: pytest.CaptureFixture[str], *args: str) -> list[tuple[dict[str, str], argparse.Namespace]]:
    """(environment, torchrun's parse of the line) of each group line that --dry-run prints."""
    assert main(["launch", "--dry-run", *args]) == 0
    groups = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("#"):
            continue
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words[: words.index("torchrun")])
        groups.append((env, get_args_parser().parse_args(words[words.index("torchrun") + 1 :])))
    return groups


def test_a_local_job_splits_its_workers_into_groups_each_with_a_rendezvous_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    groups = dry_run_groups(capsys, *FT, "--replica-groups", "2", "--nproc-per-node", "4", "--", "doctor")
    assert [env["DDPTRAIN_REPLICA_GROUP"] for env, _ in groups] == ["0", "1"]
    for env, args in groups:
        assert env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:PORT"  # the port is free one chosen at start
        assert env["DDPTRAIN_BIND_ADDR"] == "127.0.0.1"
        assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.local_addr) == (
            "1",
            "2",
            "localhost:0",
            "127.0.0.1",
        )
        assert (args.training_script, args.training_script_args) == ("ddptrain", ["doctor"])


def test_a_node_joining_a_lighthouse_is_one_group_serving_on_its_address(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*FT, "--lighthouse", "127.0.0.1:29510", "--replica-group", "7", "--nproc-per-node", "2", "--", "doctor"]
    ((env, args),) = dry_run_groups(capsys, *argv)
    assert (env["TORCHFT_LIGHTHOUSE"], env["DDPTRAIN_REPLICA_GROUP"]) == ("http://127.0.0.1:29510", "7")
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1", "2", 3)


def test_without_fault_tolerance_nothing_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--nproc-per-node", "2", "--", "doctor"]) == 0
    out = capsys.readouterr().out
    assert "TORCHFT" not in out and "REPLICA" not in out and "replica group" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lighthouse", "h:1"], "--lighthouse needs --fault-tolerance torchft"),
        (["--replica-groups", "2"], "--replica-groups needs --fault-tolerance torchft"),
        ([*FT, "--nnodes", "2"], "--fault-tolerance torchft with --nnodes 2: each launch is one replica group"),
        ([*FT, "--nnodes", "1:2"], "with --nnodes 1:2"),
        ([*FT, "--rdzv-endpoint", "h:1"], "takes no --rdzv-endpoint"),
        ([*FT, "--replica-groups", "3", "--nproc-per-node", "4"], "--replica-groups 3 does not divide the 4 workers"),
        ([*FT, "--replica-groups", "0"], "--replica-groups 0 must be at least 1"),
        ([*FT, "--replica-group", "1"], "--replica-group needs --lighthouse"),
        ([*FT, "--lighthouse", "nohost", "--replica-group", "0"], "--lighthouse 'nohost' must look like HOST:PORT"),
        ([*FT, "--lighthouse", "0.0.0.0:29510", "--replica-group", "0"], "listens on all interfaces"),
        ([*FT, "--lighthouse", "127.0.0.1:29510"], "--lighthouse needs --replica-group N"),
        ([*FT, "--lighthouse", "127.0.0.1:1", "--replica-group", "-1"], "--replica-group -1 must be between 0 and"),
        ([*FT, "--lighthouse", "10.0.0.1:29510", "--replica-group", "0"], "is on another host: pass --node-addr"),
        (
            [*FT, "--lighthouse", "10.0.0.1:1", "--replica-group", "0", "--node-addr", "127.0.0.1"],
            "is on another host: pass --node-addr",
        ),
        (
            [*FT, "--lighthouse", "127.0.0.1:1", "--replica-group", "0", "--replica-groups", "2"],
            "--replica-groups needs a Lighthouse of its own",
        ),
    ],
)
def test_inconsistent_options_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    for dry in ([], ["--dry-run"]):
        assert main(["launch", *dry, *args, "--", "doctor"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_without_torchft_the_mode_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchft.coordination", None)  # what `import` finds when it is not installed
    assert main(["launch", "--dry-run", *FT, "--", "doctor"]) == 2
    assert capsys.readouterr().err == (
        "ddptrain launch: error: --fault-tolerance torchft needs torchft: pip install 'ddptrain[ft]'\n"
    )


def test_the_job_exit_code_over_its_groups() -> None:
    assert groups_exit_code([0, 0], None, 75) == 0
    assert groups_exit_code([0, 1], None, 75) == 1  # a group out of restarts fails the job, after the others end
    assert groups_exit_code([1, 2], None, 75) == 2  # bad input wins
    assert groups_exit_code([143, 0], None, 143) == 143  # a preemption exits --preempted-exit-code
    assert groups_exit_code([75, 75], signal.SIGTERM, 75) == 75  # stopped, checkpoint committed: resumable
    assert groups_exit_code([143, 143], signal.SIGTERM, 75) == 143  # killed before the workers stopped
    assert groups_exit_code([130, 130], signal.SIGINT, 75) == 130


def _parse(argv: list[str]) -> LaunchOptions:
    parser = argparse.ArgumentParser()
    add_options(parser, LaunchOptions)
    return from_args(LaunchOptions, parser.parse_args(argv))


words = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    nproc=st.sampled_from(["auto", "1", "8"]),
    restarts=st.integers(0, 5),
    start=st.sampled_from(["preloaded", "exec"]),
    lighthouse=st.none() | st.just("10.0.0.1:29510"),
    group=st.none() | st.integers(0, 99),
    node_addr=st.none() | words,
    command=st.lists(words, min_size=1, max_size=4),
)
def test_the_command_line_a_group_is_handed_reads_back_as_its_options(
    nproc: str,
    restarts: int,
    start: str,
    lighthouse: str | None,
    group: int | None,
    node_addr: str | None,
    command: list[str],
) -> None:
    options = LaunchOptions(
        nproc_per_node=nproc,
        max_restarts=restarts,
        worker_start=start,
        fault_tolerance="torchft",
        lighthouse=lighthouse,
        replica_group=group,
        node_addr=node_addr,
        worker_command=tuple(command),
    )
    assert _parse(to_argv(options)) == options
