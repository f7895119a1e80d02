"""shardkit: move LLM weights between Hugging Face checkpoints and tensor/pipeline/expert-parallel
shards (neuronx-distributed conventions), exactly and with bounded memory.

The library API mirrors the CLI: `convert`, `merge`, `reshard`, `inspect`, `verify`, and the
training-checkpoint functions. This module is only the public face: nothing inside the package
imports it (the version lives in `shardkit.version`). Its names are imported on first use
(module `__getattr__`), so that `import shardkit.cli`, which every `shardkit` command starts
with, does not import torch: a Ctrl-C in the first second of a command then reaches the
command's own handler instead of printing a traceback from inside torch's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:  # what the names below are, for type checkers and editors
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

_MODULES = {  # each public name's module
    ".api": ("Result", "convert", "export_checkpoint", "inspect", "merge", "reshard", "verify"),
    ".checkpoint": ("latest", "list_checkpoints", "load_checkpoint", "save_checkpoint"),
    ".engine": ("VerifyReport",),
    ".errors": (
        "ConfigMismatchError",
        "DestinationExistsError",
        "FormatError",
        "LayoutError",
        "ShardkitError",
        "UnsupportedModelError",
    ),
    ".formats": ("Checkpoint", "open_checkpoint"),
    ".layout": ("FULL", "Layout", "ModelDims", "make_layout"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module the first time it is asked for."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
