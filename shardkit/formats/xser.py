"""xser, torch-xla's serialization, read and written without torch-xla.

`xser.save(obj, path)` writes `path` as a torch.save of `obj` in which every device tensor is
replaced by a `torch_xla.utils.serialization.TensorReference(tid)`, and each tensor as its own
torch.save at `path + ".tensors/tensor_{tid}.pt"`. NxD's trainer adds `path + ".info.pt"`
(`tid -> {dtype, shape, expert_model_parallel}`). Files may also hold plain tensors inline.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import torch_compat
from ..errors import FormatError
from .base import FileRecord, HashingFile, TensorSpec, check_specs, compact, narrow
from .torch_io import TensorReference, TorchFile, safe_load, state_dict_of


def tensors_dir(path: Path) -> Path:
    return Path(str(path) + ".tensors")


def tensor_path(path: Path, tid: int) -> Path:
    return tensors_dir(path) / f"tensor_{tid}.pt"


def info_path(path: Path) -> Path:
    return Path(str(path) + ".info.pt")


def resolve(obj: Any, path: Path) -> Any:
    """Replace every TensorReference in a loaded structure by its tensor, as torch-xla's xser.load."""
    if isinstance(obj, TensorReference):
        return safe_load(tensor_path(path, obj.tid))
    if isinstance(obj, dict):
        return type(obj)((k, resolve(v, path)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(resolve(v, path) for v in obj)
    return obj


def load(path: Path) -> Any:
    """Load a whole xser file (references resolved), like torch_xla.utils.serialization.load."""
    return resolve(safe_load(Path(path)), Path(path))


class XserFile:
    """Lazy reader of one xser rank file: each referenced tensor is mapped only when read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._sd = state_dict_of(safe_load(self.path), self.path)
        self._info = safe_load(info_path(self.path), mmap=False) if info_path(self.path).is_file() else {}
        self._files: dict[int, TorchFile] = {}
        for name, value in self._sd.items():
            if isinstance(value, TensorReference):
                if not tensor_path(self.path, value.tid).is_file():
                    raise FormatError(f"{self.path}: tensor file of {name} ({tensor_path(self.path, value.tid).name}) is missing")
            elif not isinstance(value, torch.Tensor):
                raise FormatError(f"{self.path}: entry {name} is a {type(value).__name__}, not a tensor")

    def keys(self) -> list[str]:
        return list(self._sd)

    def _file(self, tid: int) -> TorchFile:
        """The reader of one referenced tensor file (metadata only until a slice is read)."""
        if tid not in self._files:
            self._files[tid] = TorchFile(tensor_path(self.path, tid), single_tensor=True)
        return self._files[tid]

    def _tensor(self, name: str):
        value = self._sd[name]
        return value if isinstance(value, torch.Tensor) else self._file(value.tid)

    def shape(self, name: str) -> tuple[int, ...]:
        value = self._sd[name]
        if isinstance(value, TensorReference) and value.tid in self._info:
            return tuple(self._info[value.tid]["shape"])
        tensor = self._tensor(name)
        return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor.shape(TorchFile.SINGLE)

    def dtype(self, name: str) -> torch.dtype:
        value = self._sd[name]
        if isinstance(value, TensorReference) and value.tid in self._info:
            return self._info[value.tid]["dtype"]
        tensor = self._tensor(name)
        return tensor.dtype if isinstance(tensor, torch.Tensor) else tensor.dtype(TorchFile.SINGLE)

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor = self._tensor(name)
        if isinstance(tensor, torch.Tensor):
            return compact(narrow(tensor, dim, start, stop))
        return tensor.read(TorchFile.SINGLE, dim, start, stop)

    def close(self) -> None:
        for reader in self._files.values():
            reader.close()
        self._files = {}
        self._sd = {}


class _ReferencePickler(torch_compat.PurePickler):
    """Writes TensorReference under torch-xla's module name (which need not be importable)."""

    def save_global(self, obj, name=None):
        if obj is TensorReference:
            self.write(pickle.GLOBAL + b"torch_xla.utils.serialization\nTensorReference\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


_PICKLE_MODULE = types.ModuleType("shardkit_xser_pickle")
_PICKLE_MODULE.Pickler = _ReferencePickler
_PICKLE_MODULE.Unpickler = pickle.Unpickler
_PICKLE_MODULE.load = pickle.load


class XserWriter:
    """Writes each tensor to its own file as it arrives; the reference file and .info.pt last."""

    def __init__(self, path: Path, root: Path, specs: Sequence[TensorSpec], expert_parallel: Sequence[str] = ()):
        check_specs(specs)
        self.path, self.root = Path(path), Path(root)
        self._specs = list(specs)
        self._tids = {s.name: i for i, s in enumerate(self._specs)}
        self._expert = set(expert_parallel)
        self._records: list[FileRecord] = []
        self._fsync = False

    def write(self, name: str, tensor: torch.Tensor) -> None:
        out = HashingFile(tensor_path(self.path, self._tids[name]), self.root)
        torch.save(compact(tensor), out)
        self._records.append(out.close())

    def close(self, fsync: bool = False) -> list[FileRecord]:
        if len(self._records) != len(self._specs):
            raise RuntimeError(f"{self.path}: {len(self._specs) - len(self._records)} tensors were not written")
        main = HashingFile(self.path, self.root)
        refs = {s.name: TensorReference(self._tids[s.name]) for s in self._specs}
        torch.save(refs, main, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
        info = HashingFile(info_path(self.path), self.root)
        torch.save({self._tids[s.name]: {"dtype": s.dtype, "shape": torch.Size(s.shape),
                                         "expert_model_parallel": s.name in self._expert} for s in self._specs}, info)
        return [main.close(fsync), info.close(fsync)] + self._records
