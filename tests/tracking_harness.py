"""A real MLflow tracking server for tests, and a reader for W&B's offline run files."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """`mlflow server` on 127.0.0.1, SQLite backend, local artifact folder; stop() then start() keeps the data."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root, self.port = root, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "server.log"

    def start(self, timeout_s: float = 150) -> None:
        """Start the server and wait until /health answers (it takes ~10-30 s on a loaded 2-core machine)."""
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(mlflow),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
        ]
        with open(self.log, "ab") as log:
            # Its own session: stop() ends the server and the workers it forks, and nothing else.
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server not up within {timeout_s}s:\n{self.log.read_text()[-3000:]}")

    def healthy(self) -> bool:
        """True when /health answers OK."""
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after 20 s."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        self.proc = None

    def client(self) -> Any:
        """An MlflowClient talking to this server."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf Records of a W&B run file (run-<id>.wandb), read from its log format.

    The file starts with a 7-byte header (":W&B", a magic, a version), then 32 KiB blocks of
    records, each with a 7-byte header (checksum, length, type: full, first, middle or last piece).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    block = 32768
    buf = path.read_bytes()
    assert buf[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        data = buf[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            pending = data
        elif kind == 2:
            pending = data
            continue
        elif kind == 3:
            pending += data
            continue
        else:
            pending += data
        record = pb.Record()
        record.ParseFromString(pending)
        yield record
