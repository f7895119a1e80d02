"""Every reader and writer, the format registry, and the one view over any checkpoint."""

from .checkpoint import Checkpoint, is_plain_hf_dir, load_config, open_checkpoint
from .manifest import MANIFEST
from .reader import SourceReader
from .registry import FORMATS, Format, format_names, get_format

__all__ = [
    "Checkpoint",
    "FORMATS",
    "Format",
    "MANIFEST",
    "SourceReader",
    "format_names",
    "get_format",
    "is_plain_hf_dir",
    "load_config",
    "open_checkpoint",
]
