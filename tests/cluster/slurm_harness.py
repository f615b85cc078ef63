"""A real SLURM cluster for the tests: munged, slurmctld and slurmd as root, either one node on
loopback or one slurmd per network-namespace host of the multi-host harness (tests/cluster/netns.py).

Everything lives in folders of its own (config, state, spool, logs, munge socket and key) and on
free ports, so a test session neither needs nor disturbs a system-wide SLURM or munge. The daemons
are stopped by their pid files at the end. Debian's `slurm-wlm` and `munge` packages provide the
binaries (`.ci/install-slurm` installs them); without them, or without root, the tests skip.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from netns import Node

REQUEUE_DELAY_S = 11  # seconds a requeued job waits before it is eligible again (see cred_expire)
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel", "runuser", "nsenter")


def skip_reason() -> str | None:
    """Why a SLURM cluster cannot be started here, or None."""
    if not sys.platform.startswith("linux"):
        return "SLURM tests need Linux"
    if os.geteuid() != 0:
        return "SLURM tests run slurmctld/slurmd/munged as root; not root"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"SLURM packages not installed (missing {', '.join(missing)}); run .ci/install-slurm (Debian slurm-wlm, munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "user 'munge' does not exist (the munge package creates it)"
    return None


def report(config: pytest.Config, line: str) -> None:
    """A measurement line in the test log, shown even with -q and output capture on."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"[cluster] {line}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} missing)"


class SlurmCluster:
    """slurmctld + slurmd: by default one node named after `hostname -s` with NodeAddr=127.0.0.1;
    given network-namespace hosts (tests/cluster/netns.py), one slurmd per host under the host's
    name and address, and slurmctld on the first host."""

    def __init__(self, root: Path, hosts: Sequence[Node] = ()) -> None:
        self.root = root
        self.hosts = list(hosts)
        if self.hosts:
            self.nodes = [(h.hostname, h.addr) for h in self.hosts]
        else:
            self.nodes = [(socket.gethostname().split(".")[0], "127.0.0.1")]
        # munged insists that every folder above its socket is traversable by everyone, which the
        # test's tmp folder (0700) is not: the munge folders get a world-readable temp dir of their own.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="ddptrain-munge-"))
        self.conf = root / "slurm.conf"
        self.logs = root / "log"
        self.started_s: float | None = None
        self._daemons: list[subprocess.Popen[bytes]] = []  # foreground daemons on namespace hosts

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        """Start munged, slurmctld and slurmd and wait until the node is idle; skip if they fail."""
        t0 = time.monotonic()
        self._start_munged()
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._slurm_conf())
        for name, _ in self.nodes:
            (self.root / "spool" / name).mkdir(exist_ok=True)
        if self.hosts:
            conf = ["-f", str(self.conf)]
            self._start_on(self.hosts[0], ["slurmctld", "-D", *conf])
            for host in self.hosts:
                self._start_on(host, ["slurmd", "-D", "-N", host.hostname, *conf])
        else:
            for daemon in ("slurmctld", "slurmd"):
                proc = subprocess.run([daemon, "-f", str(self.conf)], capture_output=True, text=True, timeout=30)
                if proc.returncode != 0:
                    self.stop()
                    pytest.skip(f"{daemon} did not start: {proc.stderr.strip()} {self._logs()}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            if len(states) == len(self.nodes) and all(s in ("idle", "mixed") for s in states):
                self.started_s = time.monotonic() - t0
                return
            time.sleep(0.1)
        logs = self._logs()
        self.stop()
        pytest.skip(f"the SLURM nodes did not become idle within {timeout} s:\n{logs}")

    def _start_on(self, host: Node, argv: list[str]) -> None:
        """A daemon in the foreground in the host's network namespace, under its hostname.

        nsenter rather than `ip netns exec`: the latter mounts a fresh /sys, without the cgroup
        mounts that slurmd checks at start-up even with proctrack/linuxproc. The host's close()
        kills whatever runs in its namespace."""
        log = open(self.logs / f"{argv[0]}-{host.hostname}.out", "ab")
        self._daemons.append(
            subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{host.ns}",
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f'hostname {host.hostname} && exec "$@"',
                    "sh",
                    *argv,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()

    def _logs(self) -> str:
        return "\n".join(_tail(p) for p in sorted(self.logs.glob("slurm*.log")))

    def _start_munged(self) -> None:
        run_dir, private = self.munge_dir / "run", self.munge_dir / "private"
        run_dir.mkdir()
        private.mkdir()
        (private / "munge.key").write_bytes(os.urandom(1024))  # a fresh key: this cluster trusts only itself
        munge = pwd.getpwnam("munge")
        for path in (self.munge_dir, run_dir, private, private / "munge.key"):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        os.chmod(self.munge_dir, 0o755)
        os.chmod(run_dir, 0o755)
        os.chmod(private, 0o700)
        os.chmod(private / "munge.key", 0o600)
        self.munge_socket = run_dir / "munge.socket"
        proc = subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                f"--socket={self.munge_socket}",
                f"--key-file={private / 'munge.key'}",
                f"--log-file={private / 'munged.log'}",
                f"--pid-file={run_dir / 'munged.pid'}",
                f"--seed-file={private / 'munged.seed'}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            self.stop()
            pytest.skip(f"munged did not start: {proc.stderr.strip()}")

    def _slurm_conf(self) -> str:
        r = self.root
        cpus = max(1, (os.cpu_count() or 1) // len(self.nodes))
        # Memory each slurmd offers (jobs ask for --mem): a small share, below what the machine has.
        machine_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
        memory_mb = min(4096, machine_mb // (2 * len(self.nodes)))
        head, head_addr = self.nodes[0]
        return "\n".join(
            [
                "ClusterName=ddptest",
                f"SlurmctldHost={head}({head_addr})",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                # cred_expire (default 120 s) is also how long SLURM holds a requeued job back (BeginTime
                # = now + cred_expire + 1), so that no slurmd still holds the revoked credential: 10 s here.
                f"AuthInfo=socket={self.munge_socket},cred_expire={REQUEUE_DELAY_S - 1}",
                f"StateSaveLocation={r / 'state'}",
                f"SlurmdSpoolDir={r / 'spool' / '%n'}",  # %n: the node name, one folder per slurmd
                f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
                f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
                f"SlurmdLogFile={self.logs / 'slurmd-%n.log'}",
                # No cgroups here (and none needed): track processes by parentage, bind nothing.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/builtin",
                # A requeued job becomes eligible when its hold ends, which no event announces: the
                # periodic pass (default every 60 s) starts it. Once a second here.
                "SchedulerParameters=sched_interval=1",
                "JobRequeue=1",
                "KillWait=15",
                "MinJobAge=600",
                # Namespace hosts share this machine's CPUs: each gets its share, trusted over the hardware.
                *(["SlurmdParameters=config_overrides"] if self.hosts else []),
                *(
                    f"NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
                    for name, addr in self.nodes
                ),
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged by their pid files."""
        if self.conf.exists():
            self.run(["scancel", "--full", "--user=root"], check=False)
            time.sleep(0.5)
        pid_files = [self.root / f"slurmd-{name}.pid" for name, _ in self.nodes]
        for pid_file in (*pid_files, self.root / "slurmctld.pid", self.munge_dir / "run" / "munged.pid"):
            _stop_pid_file(pid_file)
        for proc in self._daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    # ---- jobs ---------------------------------------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose SLURM commands talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(
        self, cmd: list[str], *, check: bool = True, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A SLURM client command against this cluster."""
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(env))
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        fields: dict[str, str] = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job is in one of `states`; returns its fields."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.2)
        raise AssertionError(
            f"job {job_id} not in {states} after {timeout} s: {info}\n{_tail(self.logs / 'slurmctld.log')}"
        )


def _stop_pid_file(pid_file: Path, timeout: float = 15) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
