"""xser, torch-xla's serialization, read and written without torch-xla.

`xser.save(obj, path)` writes `path` as a torch.save of `obj` in which every device tensor is
replaced by a `torch_xla.utils.serialization.TensorReference(tid)`, and each tensor as its own
torch.save at `path + ".tensors/tensor_{tid}.pt"`. NxD's trainer adds `path + ".info.pt"`
(`tid -> {dtype, shape, expert_model_parallel}`). Files may also hold plain tensors inline.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import torch_compat
from ..errors import FormatError
from ..io.data.copy import FileRange
from ..io.data.digest import FileRecord, Recording
from ..io.data.hashing import HashingFile
from ..io.data.taps import ReadTap
from ..io.safety.durable import fsync_path
from ..io.safety.sinks import NO_SINK, Sink
from ..io.store import Store
from ..paths import NoSpaceError, ensure_free_space, no_space_error
from .base import DiscardOnFailure, RowBlocks, TensorSpec, check_specs, compact, narrow
from .torch_io import (
    SavedByPath,
    TorchFile,
    TorchWriter,
    _zip_size_bound,
    archive_folder,
    load_small,
    regular,
    safe_load,
    save_file,
    state_dict_of,
    tensor_pickle,
    written_natively,
)
from .torch_metadata import TensorReference, parsed_once
from .torch_zip import ARCHIVE


def tensors_dir(path: Path) -> Path:
    return Path(str(path) + ".tensors")


def tensor_path(path: Path, tid: object) -> Path:
    """`<path>.tensors/tensor_<tid>.pt`; `tid` (read from the file) must be a non-negative int,
    anything else (a string such as "../../x") is refused before it becomes part of a path."""
    if type(tid) is not int or tid < 0:
        raise FormatError(
            f"{path} references a tensor by an invalid id {tid!r} (expected a non-negative integer): "
            "the file is corrupt or was crafted; re-create it"
        )
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


def _valid_info(path: Path, store: Store | None = None) -> dict:
    """The `.info.pt` beside an xser file (`tid -> {dtype, shape, ...}`), checked: entries that
    would be used as shapes and dtypes must be exactly that."""
    info = load_small(path, "xser info file", store=store)
    if not isinstance(info, dict):
        raise FormatError(f"{path} is not an xser info file (expected tid -> {{dtype, shape}}): re-create it")
    for tid, entry in info.items():
        entry = entry if isinstance(entry, dict) else {}
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if (
            type(tid) is not int
            or not isinstance(dtype, torch.dtype)
            or not isinstance(shape, (tuple, list))
            or not all(type(n) is int and n >= 0 for n in shape)
        ):
            raise FormatError(
                f"{path}: entry {tid!r} is not {{dtype, shape}} of a tensor: the file is corrupt; re-create it"
            )
    return info


def _valid_references(path: Path, store: Store | None = None) -> dict[str, Any]:
    """An xser rank file's state dict (name -> tensor or TensorReference), once every referenced
    tensor file is there and a regular file (a file saved without tensor data: see `holds_data`;
    read through `store`)."""
    sd = state_dict_of(safe_load(path, store=store), path)
    bare = not holds_data(path)
    for name, value in sd.items():
        if isinstance(value, TensorReference) and bare:
            tensor_path(path, value.tid)  # a valid id, though nothing is read by it
        elif isinstance(value, TensorReference):
            file = tensor_path(path, value.tid)
            if not file.exists():
                raise FormatError(f"{path}: tensor file of {name} ({file.name}) is missing")
            regular(file, f"tensor file of {name}")
        elif not isinstance(value, torch.Tensor):
            raise FormatError(f"{path}: entry {name} is a {type(value).__name__}, not a tensor")
    return sd


def holds_data(path: Path) -> bool:
    """False for an xser file NxD saved without tensor data (`save_checkpoint(...,
    avoid_saving_lower_precision_weights=True)`): its reference file and `.info.pt` (every
    tensor's dtype and shape) are written, its tensor files are not, whether or not an (empty)
    `.tensors/` folder is (NxD leaves one at pp > 1); the weights are then the optimizer's master
    weights. A folder holding some of the tensor files holds data (the others are missing)."""
    if not info_path(path).is_file():
        return True
    try:
        with os.scandir(tensors_dir(path)) as entries:
            return any(entry.name.startswith("tensor_") for entry in entries)
    except OSError:  # no `.tensors/` folder (or not a folder): no tensor files
        return False


class XserFile:
    """Lazy reader of one xser rank file: each referenced tensor is mapped only when read.
    `holds_data` is False for a file saved without its tensors (see `holds_data`): names, shapes
    and dtypes come from its `.info.pt`, and reading a tensor is refused."""

    def __init__(self, path: Path, store: Store | None = None):
        """`store`: what its files are read through (default: a local folder)."""
        self.path = regular(Path(path), "xser file")
        self.store = store if store is not None else Store(self.path.parent)
        # parsed and checked once per operation: its readers open each rank file several times
        self._sd = parsed_once(self.path, "xser", lambda p: _valid_references(p, self.store))
        info = info_path(self.path)
        self._info = parsed_once(info, "xser-info", lambda p: _valid_info(p, self.store)) if info.exists() else {}
        self.holds_data = holds_data(self.path)
        if not self.holds_data:
            missing = [n for n, v in self._sd.items() if isinstance(v, TensorReference) and v.tid not in self._info]
            if missing:
                raise FormatError(
                    f"{self.path} holds no tensor data and its .info.pt does not describe {missing[0]}: "
                    "the file is corrupt; re-create it"
                )
        self._files: dict[int, TorchFile] = {}
        self._taps: Callable[[Path], ReadTap | None] | None = None

    def keys(self) -> list[str]:
        return list(self._sd)

    def _file(self, tid: int) -> TorchFile:
        """The reader of one referenced tensor file (metadata only until a slice is read), once it
        holds what the info file says of it."""
        if tid not in self._files:
            reader = TorchFile(tensor_path(self.path, tid), single_tensor=True, store=self.store)
            try:
                self._check_info(tid, reader)
            except FormatError:
                reader.close()
                raise
            self._files[tid] = reader
            if self._taps is not None:
                reader.tap(self._taps)
        return self._files[tid]

    def _check_info(self, tid: int, reader: TorchFile) -> None:
        """A tensor file must hold the dtype and shape its entry in the info file gives: `shape` and
        `dtype` answer from the info file (without opening the tensor files), and every reader of
        the checkpoint planned its reads and outputs with them."""
        entry = self._info.get(tid)
        if entry is None:
            return
        dtype, shape = reader.dtype(TorchFile.SINGLE), reader.shape(TorchFile.SINGLE)
        if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
            said = f"{str(entry['dtype']).replace('torch.', '')} {tuple(entry['shape'])}"
            held = f"{str(dtype).replace('torch.', '')} {shape}"
            raise FormatError(
                f"{reader.path} holds a {held} tensor but {info_path(self.path).name} says {said}: "
                "the files are corrupt or mixed from different checkpoints; re-create them"
            )

    def tap(self, taps: Callable[[Path], ReadTap | None]) -> None:
        """Pass the byte ranges read from the tensor files to `taps(path)` (see `DescriptorReader.tap`)."""
        self._taps = taps
        for file in self._files.values():
            file.tap(taps)

    def _tensor(self, name: str):
        value = self._sd[name]
        if isinstance(value, torch.Tensor):
            return value
        if not self.holds_data:
            raise FormatError(
                f"{self.path}: {name} holds no data (NxD saved the model without its tensors, "
                "avoid_saving_lower_precision_weights): its weights are the optimizer's master weights; "
                "read the training checkpoint (shardkit ckpt export / ckpt reshard)"
            )
        return self._file(value.tid)

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

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        tensor = self._tensor(name)
        return not isinstance(tensor, torch.Tensor) and tensor.read_into(TorchFile.SINGLE, start, stop, out)

    def byte_range(
        self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None
    ) -> FileRange | None:
        """The bytes of a slice in its tensor file, when the kernel can copy them as they are."""
        tensor = self._tensor(name)
        return None if isinstance(tensor, torch.Tensor) else tensor.byte_range(TorchFile.SINGLE, dim, start, stop)

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


_PICKLE_MODULE = types.ModuleType("shardkit_xser_pickle")  # the pickle_module torch.save and torch.load use
vars(_PICKLE_MODULE).update(Pickler=_ReferencePickler, Unpickler=pickle.Unpickler, load=pickle.load)


_PICKLE_BOUND = 1024  # bytes: the data.pkl of one tensor's file, or per entry of the reference and info files


def _file_bound(nbytes: int) -> int:
    """An upper bound of the size of a torch.save file holding one tensor of nbytes."""
    from torch.serialization import _get_storage_alignment

    return _zip_size_bound(
        [
            ("data.pkl", _PICKLE_BOUND),
            (".format_version", 1),
            (".storage_alignment", 8),
            ("byteorder", 8),
            ("data/0", nbytes),
        ],
        _get_storage_alignment(),
    )


CLOSING_BEHIND = 2
"""Tensor files a writer leaves to finish behind it: each is closed (its last writes and copies
waited for, its zip directory written, its digests done) only once this many newer ones are
under way, so that the worker prepares the next tensors while the write-behind threads write.
Closing each before the next began left the worker waiting for every file's writes, nearly a
third of a convert to xser. Each open file holds one descriptor."""


class XserWriter(DiscardOnFailure):
    """Writes each tensor to its own file as it arrives (CLOSING_BEHIND of them finishing behind
    the newest); the reference file and .info.pt last. Like TorchWriter, a tensor's file may be
    copied from source byte ranges by the kernel (`write_copy`) or streamed as blocks of rows
    (`begin_rows`) when shardkit writes its archive itself.

    Any failure aborts the writer: the files it wrote are deleted (see TorchWriter); so does a
    writer dropped without `close`, when it is collected."""

    def __init__(
        self,
        path: Path,
        root: Path,
        specs: Sequence[TensorSpec],
        expert_parallel: Sequence[str] = (),
        digests: Recording = Recording.FAST,
        direct: bool = False,
        sink: Sink = NO_SINK,
        archive: str | None = ARCHIVE,
        refs: Any = None,
        info: Any = None,
    ):
        """`refs` and `info`: the reference file's object and `.info.pt` of a file holding an
        object, not a state dict (its tensors' TensorReference tids are their places in `specs`);
        by default those of a state dict of `specs`."""
        check_specs(specs)
        self.path, self.root = Path(path), Path(root)
        self._refs, self._info = refs, info
        self._archive = archive  # each file's records' folder: "archive/", or None: after the file (NxD's)
        self._digests = digests
        self._direct = direct
        self._sink = sink  # each file goes to it as it closes: the tensor files one by one
        self._specs = list(specs)
        self._tids = {s.name: i for i, s in enumerate(self._specs)}
        self._expert = set(expert_parallel)
        self._records: list[FileRecord] = []
        self._files: list[
            HashingFile | SavedByPath | TorchWriter
        ] = []  # every file this writer created, to delete on abort
        self._closing: deque[TorchWriter] = deque()  # tensor files written, not closed yet
        self._started: set[int] = set()  # tensors whose file was begun
        self._written = 0  # tensors written (their files may still be closing)
        self._open = True
        # whether every tensor's file is written by shardkit's own zip writer (see TorchWriter)
        self._pickles = [tensor_pickle(spec) for spec in self._specs]  # each tensor file's data.pkl
        self._native = all(
            written_natively([spec], data, archive_folder(tensor_path(self.path, tid), archive))
            for tid, (spec, data) in enumerate(zip(self._specs, self._pickles))
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        ensure_free_space(self.path.parent, self._remaining_bound())

    def _remaining_bound(self) -> int:
        """An upper bound of the bytes this rank still needs: its unwritten tensors' files, the
        reference file and .info.pt."""
        left = self._specs[self._written :]
        return sum(_file_bound(s.nbytes) for s in left) + 2 * _file_bound(_PICKLE_BOUND * len(self._specs))

    def _save(self, obj: Any, path: Path, **kwargs) -> HashingFile | SavedByPath:
        with self._space():
            out = save_file(obj, path, self.root, self._archive, self._digests, self._direct, self._sink, **kwargs)
        self._files.append(out)
        return out

    def can_copy(self) -> bool:
        """Whether `write_copy` may be used (every tensor's file is written by shardkit's zip writer)."""
        return self._native

    def can_stream_rows(self) -> bool:
        """Whether `begin_rows` may be used (as `can_copy`)."""
        return self._native

    def write(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """Each tensor is a file of its own: torch.save's bytes of the bare tensor, written by a
        TorchWriter (shardkit's zip writer, with zlib-ng's CRC32)."""
        with self._discarding(), self._space():
            writer = self._tensor_file(name)
            writer.write(name, tensor, owned)
            self._written_file(writer)

    def write_copy(self, name: str, ranges: Iterable[FileRange]) -> None:
        """The next tensor's file, its bytes copied from source `ranges` by the kernel (see
        `TorchWriter.write_copy`)."""
        with self._discarding(), self._space():
            writer = self._tensor_file(name)
            writer.write_copy(name, ranges)
            self._written_file(writer)

    def begin_rows(self, name: str) -> RowBlocks:
        """The next tensor's file, written as blocks of its rows (see `TorchWriter.begin_rows`);
        other files may be written before its `end()`."""
        with self._discarding(), self._space():
            writer = self._tensor_file(name)
            rows = writer.begin_rows(name)

        def add(data: memoryview, owner: torch.Tensor) -> None:
            with self._space():
                rows.add(owner)

        def done() -> None:
            with self._space():
                rows.end()
                self._written_file(writer)

        return RowBlocks(self, self._specs[self._tids[name]], add, done)

    def _tensor_file(self, name: str) -> TorchWriter:
        """A new file for tensor `name`, not yet written."""
        if not self._open:
            raise RuntimeError(f"{self.path}: the writer is closed or was aborted")
        self.check_no_rows()
        tid = self._tids.get(name)
        if tid is None:
            raise RuntimeError(f"{self.path}: {name} is not one of this rank's tensors")
        if tid in self._started:
            raise RuntimeError(f"{self.path}: {name} was written already")
        self._started.add(tid)
        spec = self._specs[tid]
        writer = TorchWriter(
            tensor_path(self.path, tid),
            self.root,
            [spec],
            self._digests,
            self._direct,
            self._pickles[tid],
            self._archive,
            sink=self._sink,
        )
        self._files.append(writer)
        return writer

    def _written_file(self, writer: TorchWriter) -> None:
        """A tensor's file has all its bytes queued: it closes once CLOSING_BEHIND newer ones have."""
        self._written += 1
        self._closing.append(writer)
        while len(self._closing) > CLOSING_BEHIND:
            self._records.extend(self._closing.popleft().close())

    @contextlib.contextmanager
    def _space(self) -> Iterator[None]:
        """A full disk is reported with what this rank file still needs."""
        try:
            yield
        except NoSpaceError:
            raise no_space_error(self.path.parent, self._remaining_bound()) from None

    def close(self, fsync: bool = False) -> list[FileRecord]:
        """Finish the rank file: its tensor files, then the reference file and `.info.pt`; with
        `fsync`, every file it wrote and the tensor folder are durable (not the folder it is in)."""
        with self._discarding():
            if not self._open:
                raise RuntimeError(f"{self.path}: the writer is closed or was aborted")
            self.check_no_rows()
            if self._written != len(self._specs):
                raise RuntimeError(f"{self.path}: {len(self._specs) - self._written} tensors were not written")
            with self._space():
                while self._closing:
                    self._records.extend(self._closing.popleft().close())
            if fsync:  # the tensor files (closed behind the writes), then their folder
                for record in self._records:
                    fsync_path(self.root / record.path)
                if tensors_dir(self.path).is_dir():
                    fsync_path(tensors_dir(self.path))
            refs = self._refs
            if refs is None:
                refs = {s.name: TensorReference(self._tids[s.name]) for s in self._specs}
            main = self._save(refs, self.path, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
            about = self._info
            if about is None:
                about = {
                    self._tids[s.name]: {
                        "dtype": s.dtype,
                        "shape": torch.Size(s.shape),
                        "expert_model_parallel": s.name in self._expert,
                    }
                    for s in self._specs
                }
            info = self._save(about, info_path(self.path))
            records = [main.close(fsync), info.close(fsync)] + self._records
        self._open = False
        return records

    def abort(self) -> None:
        """Give up this rank file: delete every file written so far. Safe to call more than once."""
        self._open = False
        self._rows = None
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.clear()
        files, self._files = getattr(self, "_files", []), []
        for out in files:
            out.abort()
        try:
            tensors_dir(self.path).rmdir()  # only if empty: never anything we did not write
        except OSError:
            pass

    def _unfinished(self) -> bool:
        return bool(getattr(self, "_open", False))
