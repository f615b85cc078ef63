"""`python -m ddptrain ARGS` for the tests, forked from a process that has already imported it.

Most of the suite's time was interpreters starting: each `python -m ddptrain` (a command, or the agent of
`ddptrain launch`) spent ~3 CPU-seconds importing torch and ddptrain before doing anything, ~200 times a
session. A zygote is a process that imports that once (per pytest process) and then forks a child per
command; the child is what `python -m ddptrain ARGS` would be: it takes the test's argv, environment,
working directory and output pipes, runs ddptrain/__main__.py (runpy, as `-m` does) and ends through the
interpreter's usual exit. The zygote never runs a command itself, starts no thread and initialises no
parallel region before it forks, so each child starts from the same clean state a fresh interpreter has.

Protocol (one Unix-socket connection per command): the test sends one JSON line (argv, env, cwd,
max_file_bytes) with the write ends of its stdout and stderr pipes (SCM_RIGHTS); the zygote answers the
child's pid, then its exit status (Popen's convention: -N for a signal) when the child ends.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

_READY = "zygote ready"
_ZYGOTE_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def serve(socket_path: str) -> None:
    """The zygote: preload, then fork a command per connection until the test process goes away (stdin)."""
    import torch._dynamo  # noqa: F401  (what the first optimizer imports)

    import ddptrain.cli  # noqa: F401
    import ddptrain.launch.launcher  # noqa: F401  (the agent of `ddptrain launch`)
    import ddptrain.run  # noqa: F401

    try:  # the HF models' commands (prepare with a tokenizer, export, eval) import it first thing
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: F401
    except ImportError:
        pass
    assert threading.active_count() == 1, "a zygote must not fork with threads running"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    print(_READY, flush=True)
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        readable, _, _ = select.select([listener, sys.stdin, *running], [], [])
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            return  # the test process ended: its children end with their pipes
        if listener in readable:
            conn, _ = listener.accept()
            pid = _fork_command(conn, [listener, *(c for _, c in running.values())], list(running))
            conn.sendall(f"{pid}\n".encode())
            running[os.pidfd_open(pid)] = (pid, conn)
        for pidfd in [fd for fd in readable if isinstance(fd, int)]:
            pid, conn = running.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()
            os.close(pidfd)


def _fork_command(conn: socket.socket, zygote_sockets: list[socket.socket], zygote_fds: list[int]) -> int:
    """Fork a child that becomes `python -m ddptrain ARGV` as the request on `conn` describes; its pid."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    request = json.loads(message)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:
        # Closed through their socket objects: an os.close of the number would leave each object to close it
        # again when the zygote's frames unwind at the command's exit, by then another file's number (seen: the
        # epoll descriptor of wandb's event loop, whose thread then died and left its atexit hook waiting).
        for sock in [*zygote_sockets, conn]:
            sock.close()
        for fd in zygote_fds:
            os.close(fd)
        _become_command(request, fds)
    except BaseException as e:  # noqa: BLE001  (the child must never return into the zygote's loop)
        code = e.code if isinstance(e, SystemExit) else 1
        if not isinstance(e, SystemExit):
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # The interpreter's own exit (atexit handlers, as a fresh `python -m ddptrain` runs them): raise
        # out of serve() with nothing of the zygote's left to clean up.
        raise SystemExit(code if isinstance(code, int) else 1) from None
    raise SystemExit(0)


def _become_command(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the request's streams, directory, environment and limits, then run ddptrain."""
    import runpy

    null = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, null), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    # sys.path as `python -m` in that directory with that PYTHONPATH builds it: the working directory first,
    # then PYTHONPATH, then the interpreter's own (the zygote's directory and PYTHONPATH are not inherited).
    own = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    zygote_paths = set(_ZYGOTE_PYTHONPATH) | {sys.path[0]}
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = [request["cwd"], *own, *(p for p in sys.path if p not in zygote_paths)]
    if request["new_session"]:
        os.setsid()
    if request["netns"]:
        _enter_host(request["netns"], request["hostname"])
    if request["max_file_bytes"] is not None:
        limit = request["max_file_bytes"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.argv = ["ddptrain", *request["argv"]]
    runpy.run_module("ddptrain", run_name="__main__", alter_sys=True)


def _enter_host(netns: str, hostname: str) -> None:
    """Become a process of a namespace host (tests/cluster/netns.py), as `ip netns exec NS unshare --uts` and
    `hostname` would make it: its network namespace, then a UTS namespace of its own with the host's name."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)
    if libc.unshare(0x04000000) != 0:  # CLONE_NEWUTS
        raise OSError(ctypes.get_errno(), "unshare the UTS namespace")
    socket.sethostname(hostname)


class Zygote:
    """The test side: one zygote process per pytest process, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="ddptrain-zygote-"))
        self._socket = str(self._dir / "socket")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "zygote", self._socket],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # SIGINT handled as in a terminal (a test runner or background shell may have it ignored): its
            # commands then get Python's KeyboardInterrupt handler, as a fresh interpreter in a terminal does.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().decode().strip()
        assert line == _READY, f"the test zygote did not start: {line!r}"

    def start(self, argv: list[str], env: dict[str, str], **options: Any) -> ZygoteProcess:
        """Start `python -m ddptrain ARGV`, as subprocess.Popen would with these options: stdout and stderr
        (None, PIPE, DEVNULL, STDOUT for stderr, a file or a descriptor), text, cwd, start_new_session,
        max_file_bytes (RLIMIT_FSIZE), and netns with hostname (a namespace host's, tests/cluster/netns.py)."""
        known = {"stdout", "stderr", "text", "cwd", "start_new_session", "max_file_bytes", "netns", "hostname"}
        unknown = set(options) - known
        assert not unknown, f"the zygote does not take {unknown}"
        cwd = options.get("cwd")
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd or os.getcwd()),
            "max_file_bytes": options.get("max_file_bytes"),
            "new_session": bool(options.get("start_new_session")),
            "netns": options.get("netns"),
            "hostname": options.get("hostname"),
        }
        ours: list[int] = []  # descriptors opened here for the child, closed once it has its copies
        out, out_pipe = _stream(options.get("stdout"), 1, ours)
        err, err_pipe = (
            (out, None) if options.get("stderr") == subprocess.STDOUT else _stream(options.get("stderr"), 2, ours)
        )
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._socket)
        socket.send_fds(conn, [json.dumps(request).encode()], [out, err])
        for fd in ours:
            os.close(fd)
        text = bool(options.get("text"))
        streams = [None if r is None else os.fdopen(r, "r" if text else "rb") for r in (out_pipe, err_pipe)]
        return ZygoteProcess(conn, [sys.executable, "-m", "ddptrain", *argv], streams[0], streams[1])

    def run(
        self, argv: list[str], env: dict[str, str], cwd: Path | None, timeout: float, max_file_bytes: int | None
    ) -> subprocess.CompletedProcess[str]:
        """What subprocess.run(["python", "-m", "ddptrain", *argv], capture_output=True, text=True) returns."""
        proc = self.start(
            argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, max_file_bytes=max_file_bytes
        )
        stdout, stderr = proc.communicate(timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def close(self) -> None:
        """End the zygote (closing its stdin is its signal) and remove its socket."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


def _stream(spec: Any, own: int, ours: list[int]) -> tuple[int, int | None]:
    """The descriptor the child writes to for a Popen-style stdout/stderr spec, and the read end of a PIPE."""
    if spec == subprocess.PIPE:
        read_end, write_end = os.pipe()
        ours.append(write_end)
        return write_end, read_end
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY)
        ours.append(fd)
        return fd, None
    if spec is None:
        return own, None  # inherited, as Popen does
    return (spec if isinstance(spec, int) else spec.fileno()), None


class ZygoteProcess:
    """A command forked by the zygote, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, conn: socket.socket, args: list[str], stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        self.args, self.stdout, self.stderr = args, stdout, stderr
        self._conn, self._replies = conn, b""
        self.pid = int(self._reply(None))
        self.returncode: int | None = None

    def _reply(self, timeout: float | None) -> str:
        """The zygote's next line; raises TimeoutError when none came within timeout (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._replies:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self._conn], [], [], left)[0]:
                raise TimeoutError
            data = self._conn.recv(64)
            assert data, "the test zygote went away"
            self._replies += data
        line, self._replies = self._replies.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        """The exit status if the command has ended, else None."""
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command's end (subprocess.TimeoutExpired after timeout seconds); its exit status."""
        if self.returncode is None:
            try:
                self.returncode = int(self._reply(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the command unless it has ended (as Popen.send_signal)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the PIPE streams until every writer closed them (the command and what it started) and wait for
        the end; past `timeout` the command is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        texts: dict[int, Any] = {}
        readers = [threading.Thread(target=lambda s=s: texts.update({id(s): s.read()}), daemon=True) for s in streams]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        timed_out = any(reader.is_alive() for reader in readers)
        if timed_out:
            self.kill()
            for reader in readers:
                reader.join(10)  # what it started may still hold the pipes for a moment
        out, err = (texts.get(id(s)) if s is not None else None for s in (self.stdout, self.stderr))
        self.wait()
        if timed_out:
            raise subprocess.TimeoutExpired(self.args, timeout or 0, out, err)
        return out, err

    def __enter__(self) -> ZygoteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
    os._exit(0)  # the zygote's own end (a child raises out of serve instead): nothing to free object by object
