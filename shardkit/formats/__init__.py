"""Every reader and writer, the format registry, and the one view over any checkpoint."""

from .manifest import MANIFEST
from .reader import SourceReader
from .registry import FORMATS, Format, format_names, get_format
from .source import Checkpoint, is_plain_hf_dir, load_config, open_checkpoint

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
