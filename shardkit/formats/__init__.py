"""Readers and writers for every on-disk form: Hugging Face directories, NxD torch, xser,
safetensors. `open_checkpoint` is the one entry point for reading."""

from .source import MANIFEST, Checkpoint, load_config, open_checkpoint

__all__ = ["MANIFEST", "Checkpoint", "load_config", "open_checkpoint"]
