"""Transactional checkpoints: formats (formats/) and durable writes (durable), committing and policy
(checkpointer, policy), verification (manifest, verify), the folder's rules (store), config checks at
resume (compat) and the run folder's lease (lease). See docs/checkpoints.md."""

from ddptrain.checkpoint.checkpointer import Checkpointer, ResumePoint
from ddptrain.checkpoint.manifest import MANIFEST, Manifest, ManifestError, checkpoint_name
from ddptrain.checkpoint.policy import SavePolicy, SaveResult
from ddptrain.checkpoint.store import committed_checkpoints, newest_verified
from ddptrain.checkpoint.verify import VerifiedCheckpoint, verify_checkpoint

__all__ = [
    "MANIFEST",
    "Checkpointer",
    "Manifest",
    "ManifestError",
    "ResumePoint",
    "SavePolicy",
    "SaveResult",
    "VerifiedCheckpoint",
    "checkpoint_name",
    "committed_checkpoints",
    "newest_verified",
    "verify_checkpoint",
]
