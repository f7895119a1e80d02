"""The data.pkl of a torch.save file, read as torch's weights-only unpickler reads it, without it.

`load_plain` reads the pickle of a plain state dict (dicts and lists of tensors, numbers and
strings) in one pass of its opcodes, about 4x faster than torch's unpickler, which also builds
meta tensors: it builds `StoredTensor`s, which say where each tensor's bytes are. It accepts a
subset of what torch's `torch._weights_only_unpickler` accepts, opcode by opcode, with the same
meaning: a pickle using anything more raises `NotPlain`, and torch's own unpickler then reads it
or refuses it (`torch_metadata.load_metadata`).

Nothing outlives a load but what it returns: every object a pickle can change (BUILD, SETITEM(S),
APPEND(S)) is one this load created (a dict, an OrderedDict, a list), and what a pickle can name
(GLOBAL) is immutable: a dtype, a `StorageKind`, a reducer marker or the OrderedDict class. So one
file cannot change how another is read.
"""

from __future__ import annotations

import functools
import struct
import types
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from pickle import decode_long
from typing import Any

import torch

from .. import torch_compat
from ..errors import FormatError
from ..io.data.strided import StoredTensor

INT64 = 1 << 63


class NotPlain(Exception):
    """The pickle holds more than a plain state dict: torch's weights-only unpickler reads it."""


class _Frozen:
    """A stand-in no pickle (and no code) can change once made."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")


class StorageKind(_Frozen):
    """What a storage class (torch.BFloat16Storage, torch.storage.UntypedStorage...) stands for in
    a pickle: the dtype of its elements. Not callable: a pickle that calls it is not plain."""

    __slots__ = ("dtype",)
    dtype: torch.dtype

    def __init__(self, dtype: torch.dtype):
        object.__setattr__(self, "dtype", dtype)


class _Reducer(_Frozen):
    """Stands for one of torch's tensor reducers (torch._utils._rebuild_tensor_v2...)."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)


REBUILD_V2 = _Reducer("_rebuild_tensor_v2")
REBUILD_V3 = _Reducer("_rebuild_tensor_v3")
REBUILD_PARAMETER = _Reducer("_rebuild_parameter")


class Storage:
    """A storage one load read (persistent id): its dtype, bytes, and its record's data offset.
    Made by that load only, never shared with another."""

    __slots__ = ("dtype", "nbytes", "offset")

    def __init__(self, dtype: torch.dtype, nbytes: int, offset: int):
        self.dtype, self.nbytes, self.offset = dtype, nbytes, offset


def readable(dtype: Any) -> bool:
    """Whether shardkit reads tensors of this dtype as plain bytes: a dtype torch.save writes
    (with a typed storage, or untyped), neither quantized nor bits nor sub-byte."""
    return isinstance(dtype, torch.dtype) and dtype in _readable_dtypes()


@functools.cache
def _readable_dtypes() -> frozenset[torch.dtype]:
    saved = set(torch_compat.storage_types()) | set(torch_compat.new_dtypes())
    return frozenset(d for d in saved if not str(d).startswith(("torch.q", "torch.bits")))


@functools.cache
def _globals() -> Mapping[str, Any]:
    """Each global a plain state dict's pickle may name, by the full name torch's weights-only
    unpickler looks it up by, with its immutable stand-in: only names torch allows, and of those
    the containers, dtypes, storage classes and tensor reducers a state dict needs."""
    reducers = {f"torch._utils.{r.name}": r for r in (REBUILD_V2, REBUILD_V3, REBUILD_PARAMETER)}
    table: dict[str, Any] = {}
    for name, value in torch_compat.weights_only_globals().items():
        if name in reducers:
            table[name] = reducers[name]
        elif name == "collections.OrderedDict" and value is OrderedDict:
            table[name] = OrderedDict
        elif isinstance(value, torch.dtype) and readable(value):
            table[name] = value
        elif value is torch.UntypedStorage:
            table[name] = StorageKind(torch.uint8)
        elif type(value).__name__ == "StorageType" and readable(getattr(value, "dtype", None)):
            table[name] = StorageKind(value.dtype)
    return types.MappingProxyType(table)


def record_offset(path: Path, records: Mapping[str, tuple[int, int]], name: str, nbytes: int) -> int:
    """The data offset of record `name`, which torch reads as a storage of `nbytes`: it must exist
    and hold exactly that many bytes (torch refuses any other size)."""
    offset, size = records.get(name, (None, 0))
    if offset is None or size < nbytes:
        raise FormatError(f"{path}: the data of a tensor is missing or cut short: the file is truncated")
    if size != nbytes:
        raise FormatError(
            f"{path}: record {name} holds {size} bytes, its storage {nbytes}: the file is corrupt; re-create it"
        )
    return offset


def check_tensor(path: Path, dtype: Any, shape: Any, stride: Any, offset: Any, nbytes: int) -> None:
    """A tensor torch would build on a storage of `nbytes`, in a form shardkit reads: a readable
    dtype, int64 sizes, strides and offset, none negative, and every element inside the storage
    (an empty tensor's offset may lie anywhere, as in torch)."""
    if not readable(dtype):
        raise FormatError(f"{path}: a tensor of dtype {dtype} is not one shardkit reads")
    if len(shape) != len(stride) or type(offset) is not int or not 0 <= offset < INT64:
        raise FormatError(f"{path}: a tensor has negative or impossible sizes: the file is corrupt; re-create it")
    last, count, empty = offset, 1, False
    for n, step in zip(shape, stride):
        if type(n) is not int or type(step) is not int or not (0 <= n < INT64 and 0 <= step < INT64):
            raise FormatError(f"{path}: a tensor has negative or impossible sizes: the file is corrupt; re-create it")
        if n:
            count *= n
            last += (n - 1) * step
        else:
            empty = True
    if count >= INT64:
        raise FormatError(f"{path}: a tensor has more elements than torch can count: re-create the file")
    if not empty and (last + 1) * dtype.itemsize > nbytes:
        raise FormatError(f"{path}: the data of a tensor is missing or cut short: the file is truncated")


class _Load:
    """One load: the archive's records and the storages read so far (by key, the first wins, as
    in torch.load)."""

    __slots__ = ("path", "records", "prefix", "storages")

    def __init__(self, path: Path, records: Mapping[str, tuple[int, int]], prefix: str):
        self.path, self.records, self.prefix = path, records, prefix
        self.storages: dict[str, Storage] = {}

    def storage(self, pid: Any) -> Storage:
        """A persistent id: ("storage", storage class, key, location, elements)."""
        if type(pid) is not tuple or len(pid) != 5 or type(pid[0]) is not str or pid[0] != "storage":
            raise NotPlain("an unexpected persistent id")
        _, kind, key, location, numel = pid
        if type(kind) is not StorageKind or type(key) is not str or type(location) is not str:
            raise NotPlain("an unexpected storage")
        if key in self.storages:
            return self.storages[key]
        if type(numel) is not int or not 0 <= numel < INT64:
            raise NotPlain("a storage of an unexpected size")
        nbytes = numel * kind.dtype.itemsize
        offset = record_offset(self.path, self.records, f"{self.prefix}data/{key}", nbytes)
        storage = self.storages[key] = Storage(kind.dtype, nbytes, offset)
        return storage

    def reduce(self, func: Any, args: Any) -> Any:
        """REDUCE: only OrderedDict() and the tensor reducers, with the arguments torch.save gives."""
        if type(args) is not tuple:
            raise NotPlain("a call with unexpected arguments")
        if func is REBUILD_V2 and len(args) in (6, 7):
            storage, offset, size, stride, requires_grad, _, *metadata = args
            return self.tensor(storage, offset, size, stride, requires_grad, metadata, None)
        if func is OrderedDict and not args:
            return OrderedDict()
        if func is REBUILD_V3 and len(args) in (7, 8):
            storage, offset, size, stride, requires_grad, _, dtype, *metadata = args
            return self.tensor(storage, offset, size, stride, requires_grad, metadata, dtype)
        if func is REBUILD_PARAMETER and len(args) == 3:
            data, requires_grad, _ = args  # torch sets any backward hooks, used by nothing here
            if type(data) is not StoredTensor or type(requires_grad) is not bool:
                raise NotPlain("a parameter of something other than a tensor")
            if requires_grad and not (data.dtype.is_floating_point or data.dtype.is_complex):
                raise NotPlain("a parameter of integers that requires grad")
            return data
        raise NotPlain("a call of something other than a tensor reducer")

    def tensor(
        self, storage: Any, offset: Any, size: Any, stride: Any, grad: Any, meta: list, dtype: Any
    ) -> StoredTensor:
        """`_rebuild_tensor_v2` (dtype None: the storage's) or `_v3`: a tensor not requiring grad,
        without metadata (conjugate or negative bits), its elements inside its storage."""
        if type(storage) is not Storage or grad is not False or (meta and meta[0]):
            raise NotPlain("a tensor that is not a plain view of a storage")
        if type(size) is not tuple or type(stride) is not tuple:
            raise NotPlain("a tensor with unexpected sizes")
        if dtype is None:
            dtype = storage.dtype
        elif not readable(dtype):
            raise NotPlain("a tensor of an unexpected dtype")
        check_tensor(self.path, dtype, size, stride, offset, storage.nbytes)
        return StoredTensor(dtype, size, storage.offset, offset, stride)


# opcodes torch's weights-only unpickler reads, as ints
_BINPUT, _LONG_BINPUT, _BINGET, _LONG_BINGET = 0x71, 0x72, 0x68, 0x6A
_BINUNICODE, _SHORT_BINSTRING, _BININT, _BININT1, _BININT2, _LONG1, _BINFLOAT = 0x58, 0x55, 0x4A, 0x4B, 0x4D, 0x8A, 0x47
_MARK, _TUPLE, _TUPLE1, _TUPLE2, _TUPLE3, _EMPTY_TUPLE = 0x28, 0x74, 0x85, 0x86, 0x87, 0x29
_EMPTY_DICT, _EMPTY_LIST, _SETITEM, _SETITEMS, _APPEND, _APPENDS = 0x7D, 0x5D, 0x73, 0x75, 0x61, 0x65
_NONE, _NEWTRUE, _NEWFALSE = 0x4E, 0x88, 0x89
_GLOBAL, _REDUCE, _BUILD, _BINPERSID, _PROTO, _STOP = 0x63, 0x52, 0x62, 0x51, 0x80, 0x2E
_I4, _U2, _U4, _F8 = struct.Struct("<i"), struct.Struct("<H"), struct.Struct("<I"), struct.Struct(">d")


def load_plain(raw: bytes, path: Path, records: Mapping[str, tuple[int, int]], prefix: str) -> Any:
    """The object a plain state dict's pickle `raw` holds, its tensors as StoredTensors (records:
    full record name -> (data offset, size); prefix: the archive's folder). NotPlain for anything
    this reader does not read (torch's unpickler then reads it or refuses it); FormatError for a
    tensor torch would refuse too (missing or cut-short data)."""
    value = _run(raw, _Load(path, records, prefix))
    _plain(value, set(), set())
    return value


def _run(raw: bytes, load: _Load) -> Any:
    """The opcode loop, as torch._weights_only_unpickler.Unpickler.load for the opcodes and
    objects of a plain state dict (any other raises NotPlain). Errors of a malformed pickle
    (IndexError, KeyError...) are left to the caller: torch's unpickler then says what is wrong."""
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    globals_ = _globals()
    pos = 0
    while True:
        op = raw[pos]
        pos += 1
        # the opcodes a state dict's pickle is made of, in order of how often torch.save uses them
        if op == _LONG_BINPUT:
            memo[_U4.unpack_from(raw, pos)[0]] = stack[-1]
            pos += 4
        elif op == _BINGET:
            stack.append(memo[raw[pos]])
            pos += 1
        elif op == _BINPUT:
            memo[raw[pos]] = stack[-1]
            pos += 1
        elif op == _LONG_BINGET:
            stack.append(memo[_U4.unpack_from(raw, pos)[0]])
            pos += 4
        elif op == _BININT2:
            stack.append(_U2.unpack_from(raw, pos)[0])
            pos += 2
        elif op == _BININT1:
            stack.append(raw[pos])
            pos += 1
        elif op == _BINUNICODE:
            (n,) = _U4.unpack_from(raw, pos)
            if pos + 4 + n > len(raw):
                raise NotPlain("a string past the end")
            stack.append(str(raw[pos + 4 : pos + 4 + n], "utf-8", "surrogatepass"))
            pos += 4 + n
        elif op == _MARK:
            metastack.append(stack)
            stack = []
        elif op == _TUPLE:
            items, stack = stack, metastack.pop()
            stack.append(tuple(items))
        elif op == _REDUCE:
            args = stack.pop()
            stack[-1] = load.reduce(stack[-1], args)
        elif op == _TUPLE2:
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == _BINPERSID:
            stack.append(load.storage(stack.pop()))
        elif op == _NEWFALSE:
            stack.append(False)
        elif op == _EMPTY_TUPLE:
            stack.append(())
        elif op == _BININT:
            stack.append(_I4.unpack_from(raw, pos)[0])
            pos += 4
        elif op == _TUPLE1:
            stack[-1] = (stack[-1],)
        elif op == _TUPLE3:
            stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
        elif op == _GLOBAL:
            pos = _global(raw, pos, stack, globals_)
        elif op == _SETITEMS:
            items, stack = stack, metastack.pop()
            target = _mapping(stack[-1])
            for i in range(0, len(items), 2):
                target[items[i]] = items[i + 1]
        elif op == _STOP:
            return stack.pop()
        else:
            pos, stack = _rare(op, raw, pos, stack, metastack)


def _rare(op: int, raw: bytes, pos: int, stack: list[Any], metastack: list[list[Any]]) -> tuple[int, list[Any]]:
    """The other opcodes torch's weights-only unpickler reads, as it reads them: the position
    after the opcode and the stack (a new one after a MARK's items are taken)."""
    if op == _EMPTY_DICT:
        stack.append({})
    elif op == _NONE:
        stack.append(None)
    elif op == _NEWTRUE:
        stack.append(True)
    elif op == _BINFLOAT:
        stack.append(_F8.unpack_from(raw, pos)[0])
        pos += 8
    elif op == _EMPTY_LIST:
        stack.append([])
    elif op == _SETITEM:
        value, key = stack.pop(), stack.pop()
        _mapping(stack[-1])[key] = value
    elif op == _APPEND:
        item = stack.pop()
        _list(stack[-1]).append(item)
    elif op == _APPENDS:
        items, stack = stack, metastack.pop()
        _list(stack[-1]).extend(items)
    elif op == _BUILD:
        state = stack.pop()
        if type(stack[-1]) is not OrderedDict:  # torch's BUILD of a tensor or parameter changes it
            raise NotPlain("a BUILD of something other than an OrderedDict")
        stack[-1].__dict__.update(state)  # as torch: attributes (a state dict's _metadata)
    elif op == _SHORT_BINSTRING or op == _LONG1:
        n = raw[pos]
        if pos + 1 + n > len(raw):
            raise NotPlain("a string or number past the end")
        data = raw[pos + 1 : pos + 1 + n]  # a string decoded as torch.load's encoding, utf-8
        stack.append(data.decode("utf-8", "strict") if op == _SHORT_BINSTRING else decode_long(data))
        pos += 1 + n
    elif op == _PROTO:
        if raw[pos] != 2:  # torch reads other protocols with a warning: its unpickler does
            raise NotPlain("a pickle protocol other than 2")
        pos += 1
    else:
        raise NotPlain(f"opcode {op:#04x}")
    return pos, stack


def _global(raw: bytes, pos: int, stack: list[Any], globals_: Mapping[str, Any]) -> int:
    """GLOBAL: two lines, module and name, looked up by "module.name" as torch does (after its
    Python 2 renames, which a plain pickle never needs: those go to torch's unpickler)."""
    end = raw.index(b"\n", pos)
    stop = raw.index(b"\n", end + 1)
    module, name = raw[pos:end].decode("utf-8"), raw[end + 1 : stop].decode("utf-8")
    imports, names = torch_compat.pickle_renames()
    if module in imports or (module, name) in names:
        raise NotPlain(f"a renamed global {module}.{name}")
    found = globals_.get(f"{module}.{name}")
    if found is None:
        raise NotPlain(f"{module}.{name}")
    stack.append(found)
    return stop + 1


def _mapping(target: Any) -> dict:
    if type(target) is not dict and type(target) is not OrderedDict:
        raise NotPlain("SETITEM on something other than a dict")
    return target


def _list(target: Any) -> list:
    if type(target) is not list:
        raise NotPlain("APPEND to something other than a list")
    return target


_LEAVES = frozenset({str, int, float, bool, type(None), torch.dtype})


def _plain(value: Any, done: set[int], busy: set[int]) -> None:
    """NotPlain unless `value` is made of dicts, OrderedDicts, lists and tuples of numbers,
    strings, dtypes and StoredTensors (dict keys: no tensors, whose hash torch takes by identity).
    Each container is looked at once however often the pickle repeats it (memo); one that
    contains itself is not plain (torch's unpickler reads it, `torch_io._located` refuses it)."""
    kind = type(value)
    if kind in _LEAVES or kind is StoredTensor:
        return
    if kind not in (dict, OrderedDict, list, tuple):
        raise NotPlain(f"a {kind.__name__}")
    ident = id(value)
    if ident in done:
        return
    if ident in busy:
        raise NotPlain("a container that contains itself")
    busy.add(ident)
    if kind is dict or kind is OrderedDict:
        for key in value:
            _key(key)
        value = value.values()
    for item in value:
        _plain(item, done, busy)
    busy.discard(ident)
    done.add(ident)


def _key(key: Any) -> None:
    if type(key) is tuple:
        for item in key:
            _key(item)
    elif type(key) not in _LEAVES:
        raise NotPlain(f"a dict key that is a {type(key).__name__}")
