"""Saving objects as NxD saves them: `torch.save` of a path (the archive named after the file)
or xser (a reference file, `.info.pt` and one file per tensor), byte for byte.

`save_object` saves an object held in memory. An object whose tensors are `Deferred` (a shape
and dtype now, the values when their turn comes) is written a tensor at a time by the format's
object writer (`formats.registry.Format.objects`): its data.pkl from stand-ins before any tensor
(`torch_io.object_pickle`: the same bytes torch's pickler writes), or for xser its reference
object and `.info.pt` (`object_body`). The engine writes such objects whose tensors say their
source piece (`ckpt reshard`'s optimizer files); `save_together` writes several in lockstep from
tensors made by the caller (`save_checkpoint`'s optimizer files).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch

from ..engine.outputs import FileBody, Leaf
from ..formats import get_format, xser
from ..formats.base import TensorFileWriter, TensorSpec
from ..formats.torch_io import object_pickle, save_file, stub_tensor
from ..formats.torch_metadata import TensorReference
from ..formats.torch_zip import ARCHIVE, read_archive
from ..io.data.digest import FileRecord, Recording
from ..io.safety.sinks import NO_SINK, Sink
from ..paths import ensure_free_space
from ..placements import Piece

KEEP = object()


def map_leaves(obj: Any, leaf: Any, same_tuples: bool = False) -> Any:
    """`obj` rebuilt with `leaf(x)` in place of each value it maps (`KEEP`: walk on), keeping
    shared dicts and lists shared (NxD's param groups share one betas list). With `same_tuples`,
    a tuple none of whose items changed is kept itself (torch.save's pickle refers back to a
    tuple met before, so a copy would change its bytes)."""
    memo: dict[int, Any] = {}

    def walk(x: Any) -> Any:
        mapped = leaf(x)
        if mapped is not KEEP:
            return mapped
        if id(x) in memo:
            return memo[id(x)]
        if isinstance(x, dict):
            out = memo[id(x)] = type(x)()
            for k, v in x.items():
                out[k] = walk(v)
            return out
        if isinstance(x, list):
            out_l: list = []
            memo[id(x)] = out_l
            out_l.extend(walk(v) for v in x)
            return out_l
        if isinstance(x, tuple):
            items = tuple(walk(v) for v in x)
            if same_tuples and all(a is b for a, b in zip(items, x)):
                return x
            return items
        return x

    return walk(obj)


def _reference_walk(obj: Any, tensors: list[Any]) -> Any:
    """obj with every tensor replaced by TensorReference(tid), tid in depth-first insertion order
    (torch-xla's ToXlaTensorArena). Sharing of plain objects (e.g. a betas list) is kept."""

    def leaf(x: Any) -> Any:
        if isinstance(x, (torch.Tensor, Deferred)):
            tensors.append(x)
            return TensorReference(len(tensors) - 1)
        return KEEP

    return map_leaves(obj, leaf)


def _stored_bytes(obj: Any) -> int:
    """The bytes of the tensor storages `obj` holds (each storage once)."""
    seen: dict[int, int] = {}

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
            return x
        return KEEP

    map_leaves(obj, leaf)
    return sum(seen.values())


def torch_save_file(
    obj: Any, path: Path, archive: str | None = None, root: Path | None = None, sink: Sink = NO_SINK, **kwargs: Any
) -> Path | FileRecord:
    """torch.save(obj, path), as NxD does (the archive named after the file), with a full disk
    refused before writing (the size is known to within the zip's overhead) and any failure of
    torch's writer (its "enforce fail at inline_container.cc") turned into a one-line error.
    With `archive` ARCHIVE: the records under "archive/", as torch.save into a stream names them
    (shardkit's save_checkpoint, the trainer), written through the I/O core: its record (relative
    to `root`, default the file's folder) is returned instead of the path, and the file handed to
    `sink` once closed (torch's own writer's path is left to the caller, who reads it back first)."""
    stored = _stored_bytes(obj)
    ensure_free_space(path.parent, stored + (64 << 10))
    saved = save_file(obj, path, root or path.parent, archive, sink=sink, stored=stored, **kwargs)
    return saved.close() if archive is not None else path  # torch's writer of the path: the caller reads it back


@dataclass(frozen=True)
class Deferred:
    """A tensor of an object to save, known by its shape and dtype; `make()` gives its values (a
    compact tensor nobody else changes) when its turn to be written comes (`save_together`). One
    that says where it comes from (`piece`, a source piece, then made by `then`) can also be
    written by the engine (`object_body`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]
    piece: Piece | None = None
    then: Callable[[torch.Tensor], torch.Tensor] | None = None

    def after(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> Deferred:
        """This tensor made into another by `fn` (a new tensor of `shape` and `dtype`)."""
        then = self.then
        return Deferred(
            shape, dtype, lambda: fn(self.make()), self.piece, fn if then is None else (lambda t: fn(then(t)))
        )


def object_body(obj: Any, use_xser: bool, expert: bool | Collection[str] = False) -> FileBody:
    """`obj` as the engine writes it (`engine.outputs.FileBody`): its tensors as leaves, each a
    `Deferred` that says its source piece or a tensor held, in the order torch.save (or xser, by
    depth-first tids) writes them; torch.save's data.pkl of it, or xser's reference object and
    `.info.pt` (`expert`: see `save_object`)."""
    body, tensors = _object_parts(obj, use_xser, expert)
    if any(isinstance(t, Deferred) and t.piece is None for t in tensors):
        raise ValueError("the engine writes Deferred tensors that say their source piece")
    return body


def _object_parts(
    obj: Any, use_xser: bool, expert: bool | Collection[str]
) -> tuple[FileBody, list[Deferred | torch.Tensor]]:
    """`object_body` and its tensors in the order they are written."""
    tensors: list[Any] = []
    if use_xser:
        refs = _reference_walk(obj, tensors)
        body = FileBody(
            tuple(_leaf(k, t) for k, t in enumerate(tensors)), refs=refs, info=_xser_info(obj, tensors, expert)
        )
        return body, tensors
    pkl, tensors = _stubbed(obj)
    return FileBody(tuple(_leaf(k, t) for k, t in enumerate(tensors)), data_pkl=pkl), tensors


def _leaf(k: int, t: Deferred | torch.Tensor) -> Leaf:
    spec = TensorSpec(str(k), tuple(t.shape), t.dtype)
    if isinstance(t, torch.Tensor):
        return Leaf(spec, value=t)
    return Leaf(spec, piece=t.piece, then=t.then)


def archive_of(path: Path) -> str | None:
    """How the torch file at `path` names its zip records' folder: ARCHIVE ("archive/": torch.save
    into a stream, as shardkit's save_checkpoint and the trainer write) or None (after the file
    itself: torch.save of a path, as NxD writes; also what is no zip archive). A rewrite of the
    file keeps it (`save_together`, `save_object`: `archive=`), so that a round trip gives back
    its bytes."""
    found = read_archive(Path(path))
    return ARCHIVE if found is not None and found.prefix == ARCHIVE else None


def archive_of_files(paths: Iterable[Path]) -> str | None:
    """`archive_of` the first `.pt` file of `paths` (a source's model or its optimizer files, which
    one writer wrote alike); None when there is none."""
    first = next((Path(p) for p in paths if Path(p).suffix == ".pt"), None)
    return archive_of(first) if first is not None else None


def save_together(
    paths: Sequence[Path],
    objs: Sequence[Any],
    use_xser: bool,
    expert: bool | Collection[str] = False,
    root: Path | None = None,
    fsync: bool = False,
    archive: str | None = None,
    sink: Sink = NO_SINK,
) -> list[FileRecord]:
    """Save objects of the same structure whose tensors are `Deferred` (or compact tensors) as
    `save_object` would, byte for byte, but a tensor at a time: the k-th tensor of every file,
    then the next, so that one `make()` result serves all files while it is the last made, and
    memory holds one tensor per file, never an object. Written by the format's object writer (the
    engine's: `formats.registry.Format.objects`). `archive`: None names each file's zip records'
    folder after the file (torch.save of a path, NxD's), ARCHIVE "archive/" (`archive_of`).
    Returns the records of the files written (relative to `root`, default each file's folder),
    each handed to `sink`, the output's, as it closes; with `fsync`, durable."""
    fmt = get_format("xser" if use_xser else "torch")
    assert fmt.objects is not None
    parts = [_object_parts(obj, use_xser, expert) for obj in objs]
    writers: list[TensorFileWriter] = []
    try:
        for path, (body, _) in zip(paths, parts):
            path = Path(path)
            specs = [leaf.spec for leaf in body.leaves]
            args = (body.data_pkl, body.refs, body.info, Recording.FAST, False, sink, archive)
            writers.append(fmt.objects(path, root or path.parent, specs, *args))
        for k in range(len(parts[0][1]) if parts else 0):
            for writer, (_, leaves) in zip(writers, parts):
                writer.write(str(k), _made(leaves[k]), owned=True)
        written: list[FileRecord] = []
        for writer in writers:
            written += writer.close(fsync)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    return written


def _made(leaf: Deferred | torch.Tensor) -> torch.Tensor:
    tensor = leaf.make() if isinstance(leaf, Deferred) else leaf
    if tuple(tensor.shape) != tuple(leaf.shape) or tensor.dtype != leaf.dtype:
        raise RuntimeError(f"made {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(leaf.shape)} {leaf.dtype}")
    return tensor


def _stubbed(obj: Any) -> tuple[bytes, list[Deferred | torch.Tensor]]:
    """torch.save's data.pkl of `obj` and its tensors in the order torch.save writes them."""
    leaves: dict[int, Deferred | torch.Tensor] = {}

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not _compact(x):
            raise ValueError("save_together takes compact tensors only (each its own whole storage)")
        if isinstance(x, (Deferred, torch.Tensor)):
            stub = stub_tensor(tuple(x.shape), x.dtype)
            leaves[id(stub)] = x
            return stub
        return KEEP

    pkl, stubs = object_pickle(map_leaves(obj, leaf, same_tuples=True))
    return pkl, [leaves[id(stub)] for stub in stubs]


def _compact(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


def _xser_info(obj: Any, tensors: Sequence[Any], expert: bool | Collection[str]) -> dict[int, dict[str, Any]]:
    """xser's `.info.pt`: each tensor's dtype, shape and `expert_model_parallel` flag."""
    if isinstance(expert, bool):
        flags = [expert] * len(tensors)
    else:  # a flat dict's tensors are referenced in its key order
        flags = [k in expert for k, v in obj.items() if isinstance(v, (torch.Tensor, Deferred))]
    return {
        tid: {"dtype": t.dtype, "shape": torch.Size(t.shape), "expert_model_parallel": flag}
        for tid, (t, flag) in enumerate(zip(tensors, flags))
    }


@overload
def save_object(
    path: Path, obj: Any, use_xser: bool, expert: bool | Collection[str] = ..., data: bool = ..., archive: None = ...
) -> list[Path]: ...


@overload
def save_object(
    path: Path,
    obj: Any,
    use_xser: bool,
    expert: bool | Collection[str] = ...,
    data: bool = ...,
    *,
    archive: str | None,
    root: Path | None = ...,
    sink: Sink = ...,
) -> list[Path | FileRecord]: ...


def save_object(
    path: Path,
    obj: Any,
    use_xser: bool,
    expert: bool | Collection[str] = False,
    data: bool = True,
    archive: str | None = None,
    root: Path | None = None,
    sink: Sink = NO_SINK,
) -> list[Path] | list[Path | FileRecord]:
    """torch.save `obj` to `path` exactly as NxD does (the archive is named after the file; with
    `archive` ARCHIVE under "archive/", see `archive_of`), or as xser (reference file,
    `.info.pt`, one file per tensor). `expert`: xser's `expert_model_parallel` flag of every
    tensor, or the keys of a flat dict `obj` whose tensors get it. Without `data`, the xser tensor
    files are left out, as NxD's `avoid_saving_lower_precision_weights` saves a model (`obj`'s
    tensors may then be on the meta device: only their shapes and dtypes are written). Returns
    the files written (with `archive`, the records of those written through the I/O core,
    relative to `root`, each handed to `sink` as it closes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not use_xser:
        return [torch_save_file(obj, path, archive, root, sink)]
    tensors: list[torch.Tensor] = []
    refs = _reference_walk(obj, tensors)
    written = []
    if data:
        xser.tensors_dir(path).mkdir(exist_ok=True)
    for tid, tensor in enumerate(tensors if data else []):
        written.append(torch_save_file(tensor, xser.tensor_path(path, tid), archive, root, sink))
    main = torch_save_file(refs, path, archive, root, sink, pickle_module=xser._PICKLE_MODULE, pickle_protocol=2)
    info = torch_save_file(_xser_info(obj, tensors, expert), xser.info_path(path), archive, root, sink)
    return [main, info, *written]  # Paths alone without `archive`
