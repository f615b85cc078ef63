"""Writes to a stdout/stderr nobody reads never fail the program (ddptrain/streams.py), and the agent
watch's inputs (train/agent_watch.py): real pipes, real closed descriptors, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ddptrain import streams
from ddptrain.train.agent_watch import AGENT_PID_ENV, DEFAULT_GRACE_S, GRACE_ENV, AgentWatch, stop_grace_s

# The children load streams.py alone (a leaf): importing the package would import torch, seconds each.
LOAD_STREAMS = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("streams", {streams.__file__!r})
streams = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(streams)
"""


def test_a_pipe_whose_reader_is_gone_is_silenced_and_later_writes_succeed() -> None:
    read_end, write_end = os.pipe()
    with open(write_end, "w", buffering=1) as stream:
        assert streams.write(stream, "seen\n")
        assert os.read(read_end, 100) == b"seen\n"
        os.close(read_end)
        assert not streams.write(stream, "lost\n")  # EPIPE: reported, not raised
        assert streams.write(stream, "into /dev/null\n")  # the descriptor now points there
        assert os.readlink(f"/proc/self/fd/{write_end}") == os.devnull


def test_a_closed_stream_object_is_not_an_error() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w")
    stream.close()
    assert not streams.write(stream, "text")
    assert not streams.write(None, "text")


@pytest.mark.parametrize("flushed", [True, False])
def test_at_exit_a_broken_stdout_keeps_the_exit_code(flushed: bool) -> None:
    """Python exits 120 when its last flush of stdout fails; flush_standard_streams() keeps the program's code."""
    code = LOAD_STREAMS + textwrap.dedent(f"""
        import select, sys, time
        sys.stdout.write("x" * 100)  # buffered: the exit flush is the first write to the pipe
        poll = select.poll()
        poll.register(1, select.POLLOUT)
        while not any(event & select.POLLERR for _, event in poll.poll()):  # until the reader has gone
            time.sleep(0.01)
        if {flushed}:
            streams.flush_standard_streams()
        raise SystemExit(130)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if flushed else 120), err.decode()
    assert (b"BrokenPipeError" in err) is not flushed


def test_closed_standard_descriptors_become_dev_null() -> None:
    code = LOAD_STREAMS + textwrap.dedent("""
        import os, sys
        assert sys.stdout is None  # what Python makes of a closed fd 1
        streams.ensure_standard_streams()
        print("to /dev/null")
        with open(os.devnull) as f:
            assert f.fileno() > 2, f.fileno()  # no file takes descriptor 1
        assert os.readlink("/proc/self/fd/1") == os.devnull
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()


def test_stop_grace_comes_from_the_launcher_or_defaults_to_torchruns() -> None:
    assert stop_grace_s({GRACE_ENV: "12"}) == 12.0
    assert stop_grace_s({}) == DEFAULT_GRACE_S
    for bad in ("soon", "-1", "nan", "inf"):
        assert stop_grace_s({GRACE_ENV: bad}) == DEFAULT_GRACE_S


def test_no_watch_without_an_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert AgentWatch.under_agent() is None  # a plain `ddptrain train` goes on when its shell exits


def test_a_stale_agent_pid_is_ignored_and_the_parent_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AGENT_PID_ENV, str(os.getpid()))  # neither this process's parent nor its grandparent
    watch = AgentWatch(grace_s=1.0)
    assert watch.agent == os.getppid() and watch.agent_alive()
