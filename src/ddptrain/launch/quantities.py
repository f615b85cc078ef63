"""Resource amounts as schedulers write them, checked when a job is generated rather than after queueing.

Kubernetes quantities (`500m`, `4`, `16Gi`, `1e3`) and SLURM sizes (`64G`, `4096`, `2T`).
"""

from __future__ import annotations

import re

from ddptrain.errors import ConfigError

_K8S = re.compile(r"^(?P<num>\d+(\.\d*)?|\.\d+)(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE]\d+)?$")
_K8S_FACTORS = {
    None: 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
    "Ei": 2.0**60,
}
_SLURM_MEM = re.compile(r"^(?P<num>\d+)(?P<unit>[KMGT])?$")
_SLURM_MB = {"K": 1 / 1024, None: 1, "M": 1, "G": 1024, "T": 1024**2}


def k8s_quantity(text: str, what: str) -> float:
    """The value of a Kubernetes quantity (cores for CPU, bytes for memory); exit 2 if it is not one."""
    m = _K8S.match(str(text).strip())
    if not m:
        raise ConfigError(f"{what} {text!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    suffix = m.group("suffix")
    factor = 10.0 ** int(suffix[1:]) if suffix and suffix[0] in "eE" else _K8S_FACTORS[suffix]
    value = float(m.group("num")) * factor
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be positive")
    return value


def slurm_mem_mb(text: str, what: str = "--mem") -> float:
    """Megabytes of a SLURM memory size (`--mem` units: K, M (default), G, T); exit 2 if it is not one."""
    m = _SLURM_MEM.match(str(text).strip().upper())
    if not m or int(m.group("num")) == 0:
        raise ConfigError(
            f"{what} {text!r} is not a SLURM memory size (a positive integer with K, M, G or T, e.g. 64G)"
        )
    return int(m.group("num")) * _SLURM_MB[m.group("unit")]
