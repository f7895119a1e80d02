"""The private torch (and pickle) internals shardkit relies on, in one place.

shardkit writes torch.save's bytes itself (streamed rank files, pickles of tensors built from shapes
alone, xser reference files) and reads pickle metadata without tensor data, which needs internals
torch does not promise to keep. Every use goes through an accessor here, which checks that the
internal is still there with the shape shardkit uses it in. On a torch that moved or changed one,
the first use raises TorchInternalsError naming it, on one line, instead of an AttributeError or a
TypeError deep inside a write, or a file that is silently not what torch.save would write.

TESTED_TORCH is the range CI runs the format tests on (.ci/run); pyproject's floor matches it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch

from .errors import ShardkitError

TESTED_TORCH = ("2.9", "2.13")  # oldest and newest torch the format tests run on in CI


class TorchInternalsError(ShardkitError):
    """This torch (or Python) moved or changed a private internal shardkit relies on."""


def torch_version() -> str:
    """The running torch's major.minor, e.g. "2.13"."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def changed(name: str) -> TorchInternalsError:
    """The one-line error for an internal that is missing or no longer has the expected shape."""
    lo, hi = TESTED_TORCH
    return TorchInternalsError(
        f"torch {torch_version()} changed an internal shardkit relies on ({name}): "
        f"install torch {lo}–{hi} (tested) or report this"
    )


def _lookup(module: str, attr: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise changed(f"{module}.{attr}") from None


def _takes(fn: Callable, params: tuple[str, ...]) -> bool:
    """fn's signature starts with these positional parameters (True where it cannot be inspected)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True
    return tuple(names[: len(params)]) == params


_REBUILD_ARGS = ("storage", "storage_offset", "size", "stride", "requires_grad", "backward_hooks")


@functools.cache
def rebuild_tensor_v2() -> Callable:
    """torch._utils._rebuild_tensor_v2, the reducer torch.save pickles a tensor with."""
    fn = _lookup("torch._utils", "_rebuild_tensor_v2")
    if not callable(fn) or not _takes(fn, _REBUILD_ARGS):
        raise changed("torch._utils._rebuild_tensor_v2")
    return fn


@functools.cache
def rebuild_tensor_v3() -> Callable:
    """torch._utils._rebuild_tensor_v3, the reducer for dtypes without a typed storage (uint16, ...)."""
    fn = _lookup("torch._utils", "_rebuild_tensor_v3")
    if not callable(fn) or not _takes(fn, _REBUILD_ARGS + ("dtype",)):
        raise changed("torch._utils._rebuild_tensor_v3")
    return fn


@functools.cache
def new_dtypes() -> frozenset:
    """torch.storage._new_dtypes(): the dtypes torch.save pickles with an UntypedStorage and v3."""
    fn = _lookup("torch.storage", "_new_dtypes")
    try:
        dtypes = frozenset(fn())
    except TypeError:
        raise changed("torch.storage._new_dtypes") from None
    if not all(isinstance(d, torch.dtype) for d in dtypes):
        raise changed("torch.storage._new_dtypes")
    return dtypes


def storage_type(dtype: torch.dtype) -> type:
    """The legacy typed storage class torch.save names for dtype (torch.FloatStorage, ...)."""
    return _storage_types()[dtype]


def storage_types() -> dict[torch.dtype, type]:
    """Every dtype with a legacy typed storage class, and that class."""
    return dict(_storage_types())


@functools.cache
def _storage_types() -> dict:
    fn = _lookup("torch.storage", "_dtype_to_storage_type_map")
    try:
        names = dict(fn())
        return {dtype: getattr(torch, name) for dtype, name in names.items()}
    except (TypeError, ValueError, AttributeError):
        raise changed("torch.storage._dtype_to_storage_type_map") from None


def weights_only_unpickler(file, encoding: str) -> Any:
    """An instance of torch._weights_only_unpickler.Unpickler, whose persistent_load the caller sets."""
    cls = _lookup("torch._weights_only_unpickler", "Unpickler")
    try:
        unpickler = cls(file, encoding=encoding)
    except TypeError:
        raise changed("torch._weights_only_unpickler.Unpickler") from None
    if not callable(getattr(unpickler, "load", None)) or not hasattr(unpickler, "persistent_load"):
        raise changed("torch._weights_only_unpickler.Unpickler")
    return unpickler


@functools.cache
def weights_only_globals() -> dict[str, Any]:
    """What torch._weights_only_unpickler allows a pickle to name by default: full name -> object
    (torch's own `_get_allowed_globals()`); shardkit's plain reader allows a subset of it."""
    fn = _lookup("torch._weights_only_unpickler", "_get_allowed_globals")
    try:
        table = dict(fn())
    except (TypeError, ValueError):
        raise changed("torch._weights_only_unpickler._get_allowed_globals") from None
    if not all(isinstance(name, str) for name in table) or "torch._utils._rebuild_tensor_v2" not in table:
        raise changed("torch._weights_only_unpickler._get_allowed_globals")
    return table


@functools.cache
def pickle_renames() -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """The Python 2 module and (module, name) renames torch's weights-only unpickler applies to a
    GLOBAL before looking it up (torch._utils.IMPORT_MAPPING, NAME_MAPPING): their keys."""
    imports, names = _lookup("torch._utils", "IMPORT_MAPPING"), _lookup("torch._utils", "NAME_MAPPING")
    if not isinstance(imports, dict) or not isinstance(names, dict):
        raise changed("torch._utils.IMPORT_MAPPING/NAME_MAPPING")
    return frozenset(imports), frozenset(names)


def zip_options() -> tuple[bool, int]:
    """(crc32 on, storage alignment) as torch.save uses them (torch.serialization.get_crc32_options
    and _get_storage_alignment)."""
    crc32 = _lookup("torch.serialization", "get_crc32_options")
    alignment_of = _lookup("torch.serialization", "_get_storage_alignment")
    try:
        crc32, alignment = crc32(), alignment_of()
    except TypeError:
        raise changed("torch.serialization.get_crc32_options/_get_storage_alignment") from None
    if not isinstance(crc32, bool) or not isinstance(alignment, int):
        raise changed("torch.serialization.get_crc32_options/_get_storage_alignment")
    return crc32, alignment


def file_writer(out) -> tuple[Any, int]:
    """(torch._C.PyTorchFileWriter on the writable `out`, storage alignment), as torch.save opens it."""
    cls = _lookup("torch._C", "PyTorchFileWriter")
    crc32, alignment = zip_options()
    try:
        writer = cls(out, crc32, alignment)
    except TypeError:
        raise changed("torch._C.PyTorchFileWriter") from None
    if not all(callable(getattr(writer, m, None)) for m in ("write_record", "write_end_of_file")):
        raise changed("torch._C.PyTorchFileWriter")
    return writer, alignment


def _pure_pickler() -> type:
    """pickle._Pickler, the pure-Python pickler whose save_global a subclass can override (the C
    Pickler never calls it); where Python lost it, a class that raises when instantiated."""
    cls = getattr(pickle, "_Pickler", None)
    if isinstance(cls, type) and all(hasattr(cls, m) for m in ("save_global", "memoize", "dump")):
        return cls
    message = (
        f"Python {sys.version_info.major}.{sys.version_info.minor} changed an internal shardkit "
        f"relies on (pickle._Pickler): use an earlier Python or report this"
    )

    class MissingPickler:
        def __init__(self, *args, **kwargs):
            raise TorchInternalsError(message)

    return MissingPickler


PurePickler = _pure_pickler()


def clear_caches() -> None:
    """Forget the checked internals (for tests that swap them)."""
    for fn in (rebuild_tensor_v2, rebuild_tensor_v3, new_dtypes, _storage_types, weights_only_globals, pickle_renames):
        fn.cache_clear()
