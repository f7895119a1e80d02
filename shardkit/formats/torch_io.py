"""torch.save files (NxD's own format): safe loading, lazy reads through mmap, hashed writes.

Loading never runs arbitrary pickle: `torch.load(weights_only=True)`, with the one foreign class
the formats need (torch-xla's `TensorReference`, which xser files reference) allowed under its
real name. A file that asks for anything else is refused with a clear error.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import FormatError
from .base import FileRecord, HashingFile, TensorSpec, check_specs, compact, narrow

XSER_REFERENCE = "torch_xla.utils.serialization.TensorReference"


class TensorReference:
    """Stand-in for torch_xla.utils.serialization.TensorReference: one int field `tid`."""

    def __init__(self, tid: int | None = None):
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid})"


def safe_load(path: Path, mmap: bool = True) -> Any:
    """torch.load with weights_only=True; TensorReference allowed; clear errors for bad files."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path} does not exist")
    try:
        with torch.serialization.safe_globals([(TensorReference, XSER_REFERENCE)]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if mmap and "mmap" in str(e):  # legacy (pre-zip) files cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0] if "GLOBAL" not in str(e) else _refused_global(str(e))
        raise FormatError(
            f"refusing to load {path}: it holds Python objects other than tensors ({reason}); "
            "shardkit never runs arbitrary pickle: re-save it as a plain state dict"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise FormatError(f"{path} is truncated or corrupt ({str(e).splitlines()[0][:120]}): re-create it") from None


def _refused_global(message: str) -> str:
    for line in message.splitlines():
        if "GLOBAL" in line:
            return line.strip()[:160]
    return "unsupported global"


def state_dict_of(obj: Any, path: Path) -> dict[str, Any]:
    """The flat name -> tensor dict inside a loaded file (training checkpoints wrap it in 'model')."""
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise FormatError(f"{path} does not hold a state dict (name -> tensor)")
    return obj


class TorchFile:
    """Lazy reader of a torch.save state dict (memory-mapped: only read slices are paged in)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._sd = state_dict_of(safe_load(self.path), self.path)
        for name, value in self._sd.items():
            if not isinstance(value, torch.Tensor):
                raise FormatError(f"{self.path}: entry {name} is a {type(value).__name__}, not a tensor")

    def keys(self) -> list[str]:
        return list(self._sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._sd[name].dtype

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        try:
            return compact(narrow(self._sd[name], dim, start, stop))
        except RuntimeError as e:
            raise FormatError(f"cannot read {name} from {self.path} ({e}): the file may be truncated") from None

    def close(self) -> None:
        self._sd = {}


class TorchWriter:
    """Collects one rank file's tensors and torch.saves them (each with its own storage, as NxD)."""

    def __init__(self, path: Path, root: Path, specs: Sequence[TensorSpec]):
        check_specs(specs)
        self.path, self.root = Path(path), Path(root)
        self._specs = list(specs)
        self._data: dict[str, torch.Tensor] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._data[name] = compact(tensor)

    def close(self, fsync: bool = False) -> list[FileRecord]:
        missing = [s.name for s in self._specs if s.name not in self._data]
        if missing:
            raise RuntimeError(f"{self.path}: tensors not written: {missing[:3]}")
        out = HashingFile(self.path, self.root)
        torch.save({s.name: self._data[s.name] for s in self._specs}, out)
        self._data = {}
        return [out.close(fsync)]
