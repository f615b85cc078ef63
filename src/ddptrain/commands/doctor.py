"""`ddptrain doctor`: bring-up checks and an all-reduce bandwidth sweep, alone or as every rank under torchrun."""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain.checks import number_in
from ddptrain.cli_options import option
from ddptrain.config import MAX_TIMEOUT_S
from ddptrain.errors import ConfigError
from ddptrain.etcd_endpoints import parse_endpoints
from ddptrain.review.doctor import BACKENDS, MAX_MB, TIMEOUT_S
from ddptrain.review.doctor import doctor as run_checks


@dataclass(frozen=True)
class DoctorOptions:
    """What `ddptrain doctor` reads from its command line."""

    backend: str = option(BACKENDS[0], None, choices=BACKENDS)
    timeout: float = option(TIMEOUT_S, "seconds every rank may take to join (default {default:g})")
    max_mb: float = option(MAX_MB, "largest all-reduce message in MiB (default {default:g})")
    endpoint: str | None = option(None, "also check that this rendezvous HOST:PORT accepts connections from here")
    etcd: str | None = option(
        None,
        "also check these etcd members HOST[:PORT],... (healthy, v2 API on); under `ddptrain launch "
        "--rdzv-backend etcd-v2` its endpoints are checked without this",
    )
    params: float | None = option(
        None, "a model's parameter count (e.g. 3.2e6): advise from the sweep how to synchronize it over this link"
    )
    step_s: float | None = option(None, "with --params: that model's compute seconds per step (e.g. a one-node run's)")


def doctor(options: DoctorOptions) -> int:
    """Run the checks; non-zero when one fails."""
    number_in("--timeout", options.timeout, 0, MAX_TIMEOUT_S, low_open=True)
    number_in("--max-mb", options.max_mb, 0, 2**16, low_open=True)
    endpoint = options.endpoint
    if endpoint is not None:
        host, sep, port = endpoint.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"--endpoint {endpoint!r} must look like HOST:PORT (e.g. 10.0.0.1:29500)")
    if options.etcd is not None:
        parse_endpoints("--etcd", options.etcd)
    if options.params is not None:
        number_in("--params", options.params, 0, 1e15, low_open=True)
    if options.step_s is not None:
        if options.params is None:
            raise ConfigError("--step-s needs --params (the model whose step it is)")
        number_in("--step-s", options.step_s, 0, MAX_TIMEOUT_S, low_open=True)
    return run_checks(
        options.backend,
        options.timeout,
        int(options.max_mb * 2**20),
        endpoint,
        options.etcd,
        options.params,
        options.step_s,
    )
