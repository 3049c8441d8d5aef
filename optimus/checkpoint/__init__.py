"""Checkpoints: the committed-checkpoint layout (manifest, commit marker, verify, retention)."""

from optimus.checkpoint.manifest import (
    COMMIT_MARKER,
    FORMAT,
    MANIFEST,
    CheckpointError,
    apply_retention,
    clean_partial,
    commit,
    committed_steps,
    file_digests,
    is_committed,
    latest_committed,
    latest_loadable,
    read_manifest,
    retention,
    step_dir,
    step_of,
    verify,
)

__all__ = [
    "COMMIT_MARKER", "FORMAT", "MANIFEST", "CheckpointError", "apply_retention", "clean_partial",
    "commit", "committed_steps", "file_digests", "is_committed", "latest_committed",
    "latest_loadable", "read_manifest", "retention", "step_dir", "step_of", "verify",
]
