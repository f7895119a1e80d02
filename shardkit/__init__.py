"""shardkit: move LLM weights between Hugging Face checkpoints and tensor/pipeline/expert-parallel
shards (neuronx-distributed conventions), exactly and with bounded memory.

The library API mirrors the CLI: `convert`, `merge`, `reshard`, `inspect`, `verify`.
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    ConfigMismatchError,
    DestinationExistsError,
    FormatError,
    LayoutError,
    ShardkitError,
    UnsupportedModelError,
)
from .layout import FULL, Layout, ModelDims  # noqa: E402
from .formats import Checkpoint, open_checkpoint  # noqa: E402
from .convert import Result, convert, make_layout, merge, reshard  # noqa: E402
from .check import VerifyReport, inspect, verify  # noqa: E402
from .checkpoint import latest, list_checkpoints, load_checkpoint, save_checkpoint  # noqa: E402

__all__ = [
    "__version__", "Layout", "ModelDims", "FULL", "Checkpoint", "open_checkpoint", "Result",
    "convert", "merge", "reshard", "make_layout", "inspect", "verify", "VerifyReport",
    "save_checkpoint", "load_checkpoint", "list_checkpoints", "latest",
    "ShardkitError", "LayoutError", "FormatError", "ConfigMismatchError", "UnsupportedModelError",
    "DestinationExistsError",
]
