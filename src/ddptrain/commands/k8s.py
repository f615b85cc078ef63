"""`ddptrain k8s`: print (or write) the Kubeflow PyTorchJob manifest for a config (ddptrain/launch/k8s.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain.checks import output_file
from ddptrain.cli_options import option
from ddptrain.launch.k8s import K8sJob, render_manifest
from ddptrain.safe_files import write_text_replace


@dataclass(frozen=True)
class K8sOptions(K8sJob):
    """The job, and where its manifest goes."""

    out: str | None = option(None, "manifest file (default: standard output)")


def k8s(options: K8sOptions) -> int:
    """Print (or write) the PyTorchJob manifest for a config."""
    cfg = options.load_config()
    if options.out:
        output_file("--out", Path(options.out))
    text = render_manifest(cfg, options)
    if options.out:
        write_text_replace(Path(options.out), text)  # a link planted at --out is replaced, never written through
        print(f"wrote {options.out}")
    else:
        print(text, end="")
    return 0
