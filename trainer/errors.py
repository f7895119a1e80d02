"""The trainer's user-facing errors: ShardkitError subclasses, so one convention holds for the
whole project (the message says what is wrong and what to do; printed as one line; exit 2)."""

from shardkit.errors import ShardkitError


class TrainerError(ShardkitError):
    """Bad training input: options, world size, data, checkpoints."""


class DataError(TrainerError):
    """The token file is missing, malformed or does not fit the model."""
