"""`ddptrain launch --rdzv-conf`: each key checked for its backend before anything starts, --dry-run too.

What is accepted is what torch's rendezvous then takes: the c10d handler is built from it for real
(a store on loopback) and reads back the values given.
"""

from __future__ import annotations

import contextlib
import io
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from ddptrain.cli import main
from ddptrain.errors import LaunchError
from ddptrain.launch.agent import rendezvous_handler
from ddptrain.launch.rdzv_conf import KEYS, parse_rdzv_conf


def launch_dry_run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["launch", "--dry-run", "--nproc-per-node", "1", *args, "--", "train"])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("conf", "backend", "message"),
    [
        ("keep_alive_interval=abc", "c10d", "keep_alive_interval='abc' must be a whole number from 1 to 604800"),
        ("read_timeout=-1", "c10d", "read_timeout='-1' must be a whole number"),
        ("read_timeout=0", "c10d", "read_timeout='0' must be a whole number"),
        ("keep_alive_max_attempt=0", "c10d", "keep_alive_max_attempt='0'"),
        ("close_timeout=1e3", "c10d", "close_timeout='1e3'"),
        ("heartbeat_timeout=5_0", "c10d", "heartbeat_timeout='5_0'"),  # int() would read 50
        ("keep_alive_interval=99999999999", "c10d", "from 1 to 604800"),
        ("is_host=maybe", "c10d", "is_host='maybe' must be one of true, false, 1, 0"),
        ("is_host=yes", "c10d", "is_host='yes'"),  # torch reads yes, the launcher's store would not: refused
        ("keep_alive_intervall=5", "c10d", "'keep_alive_intervall' is not a c10d rendezvous option"),
        ("store_type=file", "c10d", "'store_type' is not a c10d rendezvous option"),
        ("protocol=https", "c10d", "'protocol' is not a c10d rendezvous option"),
        ("join_timeout=5", "c10d", "join_timeout: give it as --rdzv-timeout"),
        ("last_call_timeout=5", "c10d", "give it as --rdzv-last-call"),
        ("read_timeout=5,read_timeout=6", "c10d", "read_timeout is given twice"),
        ("read_timeout", "c10d", "must look like KEY=VALUE"),
        ("read_timeout=", "c10d", "must look like KEY=VALUE"),
        ("=5", "c10d", "must look like KEY=VALUE"),
        ("protocol=ftp", "etcd-v2", "protocol='ftp' must be one of http, https"),
        ("ca_cert=/nonexistent/ca.pem", "etcd-v2", "ca_cert='/nonexistent/ca.pem': no such file"),
        ("is_host=true", "etcd-v2", "'is_host' is not a etcd-v2 rendezvous option"),
        ("timeout=5", "etcd", "timeout: give it as --rdzv-timeout"),
        ("etcd_prefix=relative", "etcd", "must be an etcd key prefix starting with '/'"),
        ("keep_alive_interval=5", "etcd", "'keep_alive_interval' is not a etcd rendezvous option"),
    ],
)
def test_bad_rdzv_conf_is_refused_under_dry_run(conf: str, backend: str, message: str) -> None:
    etcd = ["--rdzv-endpoint", "127.0.0.1:2379", "--run-id", "j"] if backend != "c10d" else []
    rc, out, err = launch_dry_run("--rdzv-backend", backend, *etcd, "--rdzv-conf", conf)
    assert rc == 2 and out == "", (out, err)
    lines = [line for line in err.splitlines() if not line.startswith("ddptrain launch: --nproc-per-node")]
    assert len(lines) == 1 and lines[0].startswith("ddptrain launch: error: --rdzv-conf") and message in lines[0], err


def test_good_rdzv_conf_reaches_torchrun(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here, only that it exists\n")
    rc, out, err = launch_dry_run("--rdzv-conf", " keep_alive_interval=2 , read_timeout=30,is_host=false")
    assert rc == 0, err
    assert "keep_alive_interval=2 , read_timeout=30,is_host=false" in out
    etcd = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379", "--run-id", "j"]
    rc, out, err = launch_dry_run(*etcd, "--rdzv-conf", f"protocol=https,ca_cert={ca},keep_alive_max_attempt=5")
    assert rc == 0, err


def test_rendezvous_options_are_documented_per_backend() -> None:
    """The dynamic handler's keys are shared by c10d and etcd-v2; etcd reads neither them nor is_host."""
    assert {"keep_alive_interval", "keep_alive_max_attempt", "close_timeout", "read_timeout"} <= set(KEYS["c10d"])
    assert set(KEYS["c10d"]) - {"is_host"} <= set(KEYS["etcd-v2"])
    assert not {"keep_alive_interval", "is_host"} & set(KEYS["etcd"])


def _shut_down(handler: RendezvousHandler) -> None:
    """handler.shutdown() on a thread of its own: torch's shutdown logs each state change with the caller's
    name from inspect.stack(), which reads every frame's source; a fresh thread's stack is a few frames deep,
    a test's (pytest's and hypothesis's) about a hundred, which made each shutdown take a third of a second."""
    with ThreadPoolExecutor(1) as closer:
        closer.submit(handler.shutdown).result()  # raises what shutdown raised


BAD_VALUES = st.sampled_from(["abc", "-1", "0", " 7", "+5", "5_0", "1e3", "yes", "700000"])


def _value(key: str) -> st.SearchStrategy[tuple[str, str]]:
    """Mostly values torch can take for the key, sometimes one it cannot (or that is only refused here)."""
    good = st.sampled_from(["true", "false", "1", "0"]) if key == "is_host" else st.integers(1, 1000).map(str)
    return st.tuples(st.just(key), st.one_of(good, good, BAD_VALUES))


c10d_items = st.lists(
    st.sampled_from(sorted(KEYS["c10d"])).flatmap(_value), max_size=4, unique_by=lambda kv: kv[0]
).map(dict)


@settings(max_examples=30, deadline=None)
@given(items=c10d_items)
def test_what_is_accepted_torch_takes_as_given(items: dict[str, str]) -> None:
    """Any c10d conf: refused in one LaunchError, or torch's handler is built from it and reads the same values."""
    conf = ",".join(f"{k}={v}" for k, v in items.items())
    try:
        parsed = parse_rdzv_conf("c10d", conf)
    except LaunchError as e:
        assert "\n" not in str(e) and str(e).startswith("--rdzv-conf ")
        return
    assert parsed == {k: v.strip() for k, v in items.items()}
    params = RendezvousParameters("c10d", "127.0.0.1:0", "conf-test", 1, 1, **parsed)
    handler = rendezvous_handler(params, "127.0.0.1")  # hosts the store on loopback, as a one-node job does
    try:
        settings_ = handler._settings  # type: ignore[attr-defined]  # what the handler runs with
        if "keep_alive_interval" in parsed:
            assert settings_.keep_alive_interval == timedelta(seconds=int(parsed["keep_alive_interval"]))
        if "keep_alive_max_attempt" in parsed:
            assert settings_.keep_alive_max_attempt == int(parsed["keep_alive_max_attempt"])
        if "close_timeout" in parsed:
            assert settings_.timeout.close == timedelta(seconds=int(parsed["close_timeout"]))
    finally:
        _shut_down(handler)
