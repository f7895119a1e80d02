"""Exceptions whose messages tell the user what is wrong and what to do next.

Every error shardkit raises on bad input is a ShardkitError; the CLI prints its message on one
line and exits with code 2.
"""


class ShardkitError(Exception):
    """Base class: bad input or an impossible request (CLI exit code 2)."""


class LayoutError(ShardkitError):
    """The parallel layout cannot hold this model (e.g. heads not divisible by tp)."""


class FormatError(ShardkitError):
    """A file or directory is missing, truncated, unsafe or not in a known format."""


class ConfigMismatchError(ShardkitError):
    """The model config does not describe the tensors found."""


class UnsupportedModelError(ShardkitError):
    """No model family knows this model_type."""


class DestinationExistsError(ShardkitError):
    """The destination exists and is not empty (use overwrite)."""
