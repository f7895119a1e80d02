"""Training checkpoints in NxD's directory tree: save, resume into any layout, async, retention.

A training job checkpoints every N steps; a crash, a preemption or a new cluster shape must
never lose more than the last interval, and saving must barely pause training.

    from shardkit.checkpoint import save_checkpoint, load_checkpoint

    save_checkpoint(ckpt_dir, f"step_{step}", model_pieces, optimizer_state, scheduler,
                    {"step": step}, layout=layout, config=hf_config, async_save=True, num_kept=3)
    ...
    loaded = load_checkpoint(ckpt_dir, "latest_if_exists", target_layout=new_layout)
    if loaded is not None:
        model_pieces, optimizer_state = loaded.model, loaded.optimizer

One concern per module: `base` (the protocol, ranks, configuration, errors), `tree` (markers,
listing, ordering, retention and deletion), `state` (what a rank saves, checked against the
layout), `save` (the save protocol and the Checkpointer), `async_save` (host copies and the
background writer), `load` (resolving tags, checking, resharding reads). Exporting a tag to a Hugging Face directory
is `shardkit.api.export_checkpoint` (it resolves sources the way every api function does, then merges with the engine).
"""

from .base import (
    FORMATS,
    CheckpointerConfig,
    CheckpointError,
    CheckpointLockedError,
    CheckpointWriteError,
    IncompleteCheckpointError,
    LoadedCheckpoint,
    NoCheckpointError,
    OptimizerState,
    Rank,
    StateMismatchError,
    UnsafeTagError,
    optimizer_state_from_torch,
)
from .load import LATEST_IF_EXISTS, load_checkpoint, resolve_tag
from .s3_tags import has_checkpoint_at as has_checkpoint  # a local folder or s3://bucket/prefix
from .s3_tags import latest_at as latest
from .s3_tags import list_checkpoints_at as list_checkpoints
from .s3_tags import prune_checkpoints_at as prune_checkpoints
from .save import Checkpointer, default_checkpointer, finalize_checkpoint, save_checkpoint
from .state import model_file, optim_file
from .tree import CheckpointInfo, RetentionPlan, plan_retention, remove_tag

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "has_checkpoint",
    "list_checkpoints",
    "latest",
    "prune_checkpoints",
    "finalize_checkpoint",
    "Checkpointer",
    "CheckpointerConfig",
    "default_checkpointer",
    "LoadedCheckpoint",
    "OptimizerState",
    "optimizer_state_from_torch",
    "Rank",
    "CheckpointInfo",
    "RetentionPlan",
    "plan_retention",
    "remove_tag",
    "resolve_tag",
    "model_file",
    "optim_file",
    "LATEST_IF_EXISTS",
    "FORMATS",
    "CheckpointError",
    "NoCheckpointError",
    "IncompleteCheckpointError",
    "CheckpointWriteError",
    "StateMismatchError",
    "CheckpointLockedError",
    "UnsafeTagError",
]
