"""shardkit: move LLM weights between Hugging Face checkpoints and tensor/pipeline/expert-parallel
shards (neuronx-distributed conventions), exactly and with bounded memory.

The library API mirrors the CLI: `convert`, `merge`, `reshard`, `inspect`, `verify`, and the
training-checkpoint functions. This module is only the public face: nothing inside the package
imports it (the version lives in `shardkit.version`).
"""

from .api import Result, convert, export_checkpoint, inspect, merge, reshard, verify
from .checkpoint import latest, list_checkpoints, load_checkpoint, save_checkpoint
from .engine import VerifyReport
from .errors import (
    ConfigMismatchError,
    DestinationExistsError,
    FormatError,
    LayoutError,
    ShardkitError,
    UnsupportedModelError,
)
from .formats import Checkpoint, open_checkpoint
from .layout import FULL, Layout, ModelDims, make_layout
from .version import __version__

__all__ = [
    "__version__",
    "Layout",
    "ModelDims",
    "FULL",
    "Checkpoint",
    "open_checkpoint",
    "Result",
    "convert",
    "merge",
    "reshard",
    "make_layout",
    "inspect",
    "verify",
    "VerifyReport",
    "export_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "latest",
    "ShardkitError",
    "LayoutError",
    "FormatError",
    "ConfigMismatchError",
    "UnsupportedModelError",
    "DestinationExistsError",
]
