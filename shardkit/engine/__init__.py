"""The engine: output-file planning, the streaming executor, staging + atomic commit, and the
operations built on them (reshard, merge, inspect, verify) over opened checkpoints. It never
imports the Hub or the CLI: those sit above it (`api.py` resolves sources, then calls here)."""

from .check import TensorDiff, VerifyReport, inspect_checkpoint, verify_checkpoints
from .executor import no_full_collections
from .operations import Result, merge_checkpoint, resave_changes, reshard_checkpoint
from .options import ProgressCallback, WriteArgs, WriteOptions

__all__ = [
    "ProgressCallback",
    "Result",
    "TensorDiff",
    "VerifyReport",
    "inspect_checkpoint",
    "merge_checkpoint",
    "no_full_collections",
    "resave_changes",
    "reshard_checkpoint",
    "verify_checkpoints",
    "WriteArgs",
    "WriteOptions",
]
