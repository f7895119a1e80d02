"""PyTorch Distributed Checkpoint (DCP) as a format of models: read as pieces, written by rank.

The folder itself (metadata, chunks, data files) is `dcp_files.py`. A DCP folder's layout is
whatever sharding it holds: each chunk becomes a segment of its full (Hugging Face) tensor
(`describe_model`), so the engine reads exactly the chunks each output needs; tensors whose chunks
cut along another axis than the model family's split are read through one reader that assembles
any slice from the chunks it meets (`DcpTensors`). Names follow a convention (`conventions.py`):
Hugging Face's, or torchtitan's with its q/k row order. Written, a model is a data file per rank
of a layout, holding the rank's segments of the full tensors as chunks (`plan_outputs`,
`DcpWriter`), and `.metadata` (`dcp_files.finish_folder`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..conventions import Convention, find, get_convention, to_hf, to_native
from ..errors import FormatError, ShardkitError
from ..families import Family
from ..io.data.copy import FileRange
from ..io.data.digest import FileRecord, Recording
from ..io.data.strided import (
    advise_stored,
    byte_span,
    read_block,
    read_rows_into,
    stored_range,
)
from ..io.safety.sinks import NO_SINK, Sink
from ..io.store import Store
from ..layout import Layout, ModelDims
from ..paths import inside
from ..placements import Piece, Segment, make_piece
from .base import TensorSpec, check_specs, compact
from .dcp_files import (
    METADATA,
    Chunk,
    ChunkFile,
    DcpFileWriter,
    DcpFolder,
    Entry,
    data_file,
    from_ranges,
    read_folder,
    read_global,
)
from .torch_io import tensor_pickle, written_natively

log = logging.getLogger(__name__)

COMPOSITE = METADATA
"""The holder key of tensors read through `DcpTensors` (chunks cut along another axis)."""
SEP = "::"
"""A moment of a tensor is addressed as `f"{moment}{SEP}{name}"` (as `checkpoint.zero1` does)."""


# ---- reading chunks --------------------------------------------------------------------------


def _heads(
    read: Callable[[int, int | None, int | None], torch.Tensor],
    rows: int,
    dim: int,
    start: int | None,
    stop: int | None,
    head_dim: int | None,
) -> torch.Tensor:
    """A slice of a tensor stored with each head's rotary halves interleaved, in Hugging Face's
    row order: whole heads are read (`read(dim, start, stop)`), put back in order, then cut."""
    if head_dim is None:
        return read(dim, start, stop)
    if dim != 0:
        return to_hf(read(dim, start, stop), head_dim)
    start, stop = start or 0, rows if stop is None else stop
    first, last = start // head_dim * head_dim, -(-stop // head_dim) * head_dim
    whole = to_hf(read(0, first, last), head_dim)
    return whole if (first, last) == (start, stop) else compact(whole[start - first : stop - first])


class DcpFile(ChunkFile):
    """A TensorFile of one data file's chunks, named `fqn@offsets` (`Chunk.name`), each in the
    Hugging Face row order when `head_dims` names it (a convention's permuted q/k)."""

    def __init__(
        self,
        path: Path,
        chunks: Iterable[Chunk] | None = None,
        head_dims: Mapping[str, int] | None = None,
        store: Store | None = None,
    ):
        super().__init__(path, store)
        if chunks is None:
            folder = read_folder(self.path.parent)
            chunks = [c for e in folder.tensors.values() for c in e.chunks if c.file == self.path.name]
        self._chunks = {c.name: c for c in chunks}
        self._heads = dict(head_dims or {})

    def keys(self) -> list[str]:
        return list(self._chunks)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._chunks[name].sizes

    def dtype(self, name: str) -> torch.dtype:
        chunk = self._chunks[name]
        return chunk.dtype or self.stored(chunk).dtype

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        chunk = self._chunks[name]
        rows = chunk.sizes[0] if chunk.sizes else 1
        return _heads(lambda d, a, b: self.read_chunk(chunk, d, a, b), rows, dim, start, stop, self._heads.get(name))

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        if name in self._heads:
            return False
        return read_rows_into(self._open_file, self.stored(self._chunks[name]), start, stop, out, str(self.path))

    def read_block(self, name: str, first: int, last: int, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [first, last), columns [start, stop) of a chunk into `out` (see `io.data.strided.read_block`)."""
        if name in self._heads:
            return False
        chunk = self.stored(self._chunks[name])
        return read_block(self._open_file, chunk, first, last, start, stop, out, str(self.path))

    def byte_range(
        self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None
    ) -> FileRange | None:
        if name in self._heads:
            return None
        return stored_range(self._open_file, self.stored(self._chunks[name]), dim, start, stop, str(self.path))

    def span(self, name: str) -> tuple[int, int, int] | None:
        return None if name in self._heads else byte_span(self.stored(self._chunks[name]))

    def advise(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> None:
        advise_stored(
            self._open_file.fd,
            self.stored(self._chunks[name]),
            dim,
            0 if name in self._heads else start,
            None if name in self._heads else stop,
        )


Rows = list[tuple[int, int]]
"""Row ranges of a tensor that, one after another, are another tensor's rows (a fused parameter's part)."""


class DcpTensors:
    """A TensorFile of whole tensors of a DCP folder under Hugging Face names (`names`: HF name ->
    fqn), each slice assembled from its chunks (`read_global`); a name in `parts` is the rows
    `parts[name]` of its fqn, one range after another (a part of a fused parameter)."""

    def __init__(
        self,
        folder: DcpFolder,
        names: Mapping[str, str],
        head_dims: Mapping[str, int] | None = None,
        parts: Mapping[str, Rows] | None = None,
    ):
        self.path = folder.root / METADATA
        self._folder, self._names, self._heads = folder, dict(names), dict(head_dims or {})
        self._parts = {k: v for k, v in (parts or {}).items() if k in self._names}
        self._files: dict[str, ChunkFile] = {}

    def keys(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._folder.tensors[self._names[name]].shape
        if name in self._parts:
            return (sum(b - a for a, b in self._parts[name]), *shape[1:])
        return shape

    def dtype(self, name: str) -> torch.dtype:
        return self._folder.tensors[self._names[name]].dtype

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        fqn, rows = self._names[name], self._parts.get(name)

        def native(d: int, a: int | None, b: int | None) -> torch.Tensor:
            if rows is None:
                return read_global(self._folder, self._files, fqn, d, a, b)
            return self._read_rows(fqn, rows, d, a, b)

        return _heads(native, self.shape(name)[0] if self.shape(name) else 1, dim, start, stop, self._heads.get(name))

    def _read_rows(self, fqn: str, rows: Rows, dim: int, start: int | None, stop: int | None) -> torch.Tensor:
        """The slice [start, stop) along `dim` of the tensor that is `rows` of `fqn`."""
        if dim != 0:
            blocks = [read_global(self._folder, self._files, fqn, 0, a, b) for a, b in rows]
            whole = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            return compact(whole.narrow(dim, start or 0, (whole.shape[dim] if stop is None else stop) - (start or 0)))
        total = sum(b - a for a, b in rows)
        start, stop = start or 0, total if stop is None else stop
        blocks, at = [], 0
        for a, b in rows:
            lo, hi = max(start, at), min(stop, at + b - a)
            if lo < hi:
                blocks.append(read_global(self._folder, self._files, fqn, 0, a + lo - at, a + hi - at))
            at += b - a
        return torch.cat(blocks) if len(blocks) > 1 else blocks[0]

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


# ---- a model in a DCP folder -------------------------------------------------------------------


@dataclass
class DcpModel:
    """What a DCP folder holds of a model, in shardkit's terms: per data file the chunks that are
    segments of full (Hugging Face) tensors along the family's split axis, and the rest under the
    composite key (`COMPOSITE`). `convention` names the tensors; `prefix` is the state-dict key the
    model sits under ("" at the top, as torchtitan saves it)."""

    folder: DcpFolder
    convention: Convention
    prefix: str
    names: dict[str, str]  # HF name -> fqn
    files: dict[str, Path] = field(default_factory=dict)
    holdings: dict[str, list[Piece]] = field(default_factory=dict)
    head_dims: dict[str, int] = field(default_factory=dict)  # piece or HF name -> head size (permuted rows)
    chunks: dict[str, list[Chunk]] = field(default_factory=dict)
    parts: dict[str, Rows] = field(default_factory=dict)  # source -> its rows in a fused parameter
    params: dict[str, str] = field(default_factory=dict)
    """HF name -> the parameter (fqn, without the prefix) the optimizer keys its state by (fused or not)."""

    def open(self, key: str, store: Store | None = None) -> Any:
        """The reader of `key`'s data file (read through `store`), or of the composite tensors."""
        if key == COMPOSITE:
            names = {p.name: self.names[p.name] for p in self.holdings[key]}
            return DcpTensors(self.folder, names, self.head_dims, self.parts)
        return DcpFile(self.files[key], self.chunks[key], self.head_dims, store)


def model_names(
    folder: DcpFolder,
    family: Family,
    dims: ModelDims,
    convention: str | None = None,
    prefixes: Sequence[str] = ("", "model."),
) -> tuple[Convention, str, dict[str, str]]:
    """The convention and key prefix under which `folder` holds every tensor of the model, and the
    HF name -> fqn map; a one-line error naming what is missing otherwise."""
    wanted = list(family.full_shapes(dims))
    best: tuple[int, str] | None = None
    for prefix in prefixes:
        present = [k[len(prefix) :] for k in folder.tensors if k.startswith(prefix)]
        if convention is not None:
            chosen = get_convention(convention)
            missing = [h for h in wanted if _native_or_none(chosen, h) not in set(present)]
        else:
            chosen, missing = find(present, wanted)
        if not missing:
            return chosen, prefix, {h: prefix + chosen.native(h) for h in wanted}
        if best is None or len(missing) < best[0]:
            best = (
                len(missing),
                f"{missing[0]} (as {_native_or_none(chosen, missing[0]) or '-'}, {chosen.name} names)",
            )
    assert best is not None
    raise FormatError(
        f"{folder.root} is a DCP checkpoint without {best[1]} and {best[0] - 1} more of the model's tensors: "
        "the config does not match it, or it holds no model (pass --config, or --convention)"
    )


def _native_or_none(convention: Convention, hf: str) -> str | None:
    try:
        return convention.native(hf)
    except ShardkitError:
        return None


def describe_model(
    root: Path, family: Family, dims: ModelDims, convention: str | None = None, prefixes: Sequence[str] = ("",)
) -> DcpModel:
    """The model a DCP folder holds, as pieces per data file (see `DcpModel`), its shapes checked.
    A prefix "exp_avg::" (`SEP`) takes instead the state of that name kept as
    "optimizer.state.<fqn>.exp_avg" (as torchtitan saves AdamW's moments): pieces of the full
    tensors "exp_avg::<HF name>", cut and permuted like their parameters; the state of a part of a
    parameter the trainer held fused (`Convention.fusions`, found in the folder) is its rows of
    the fused parameter's state (`DcpModel.parts`)."""
    folder = read_folder(root)
    chosen, at, names = model_names(folder, family, dims, convention)
    model = DcpModel(folder, chosen, at, names)
    split, full = family.split_dims(dims), family.full_shapes(dims)
    if any(prefixes):
        model.params = optimizer_params(folder, chosen, at, names, dims)
    sources: dict[str, tuple[str, str]] = {}
    for prefix in prefixes:
        moment = prefix.partition(SEP)[0]
        for hf, fqn in names.items():
            sources[prefix + hf] = (f"{at}optimizer.state.{model.params[hf]}.{moment}" if prefix else fqn, hf)
    shapes = {source: full[hf] for source, (_, hf) in sources.items()}
    for source, (fqn, hf) in sources.items():
        fused = source != hf and model.params[hf] != names[hf][len(at) :]
        want = chosen.fused_shape(hf, dims) if fused else tuple(shapes[source])
        entry = folder.tensors.get(fqn)
        if entry is None or entry.shape != want:
            found = "is missing" if entry is None else f"is {list(entry.shape)}"
            if entry is None and source != hf and chosen.fusion(hf):
                found += f" (and so is the fused {chosen.fused_rows(hf, dims)[0]}'s)"
            made = f"{hf} {list(shapes[source])}" if not fused else f"it {list(want)} (q, k and v of {hf})"
            raise FormatError(
                f"{root}: {fqn} {found}, the config makes {made}: the config does not match the checkpoint "
                "(pass the right --config)"
            )
        if fused:
            model.parts[source] = chosen.fused_rows(hf, dims)[1]
            _composite(model, root, source, split[hf], chosen.head_dim(hf, dims), shapes)
        else:
            _describe(model, root, entry, source, split[hf], chosen.head_dim(hf, dims), shapes)
    model.names = {source: fqn for source, (fqn, _) in sources.items()}
    return model


def optimizer_params(
    folder: DcpFolder, convention: Convention, at: str, names: Mapping[str, str], dims: ModelDims
) -> dict[str, str]:
    """HF name -> the parameter under which the folder holds the tensor's optimizer state: its own
    name, or the fused parameter it is part of where the folder holds that one's state."""
    state = f"{at}optimizer.state."
    held = {k[len(state) :].rpartition(".")[0] for k in folder.tensors if k.startswith(state)}
    out = {}
    for hf, fqn in names.items():
        own = fqn[len(at) :]
        fused = convention.fused_rows(hf, dims)[0] if convention.fusion(hf) else None
        if fused is not None and fused in held and own in held:
            raise FormatError(
                f"{folder.root} holds the optimizer state of {own} both apart and fused ({fused}): the checkpoint "
                "mixes two saves (re-create it)"
            )
        out[hf] = fused if fused is not None and fused in held else own
    return out


def _describe(
    model: DcpModel,
    root: Path,
    entry: Entry,
    source: str,
    dim: int,
    head_dim: int | None,
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """One tensor's chunks as pieces of their data files, or the whole tensor under COMPOSITE."""
    if not all(_segment_of(c, entry.shape, dim, head_dim) for c in entry.chunks):
        _composite(model, root, source, dim, head_dim, shapes)
        return
    for c in entry.chunks:
        if not math.prod(c.sizes):
            continue
        start = c.offsets[dim] if entry.shape else 0
        length = c.sizes[dim] if entry.shape else 1
        model.files.setdefault(c.file, inside(root, c.file, "DCP data file"))
        model.holdings.setdefault(c.file, []).append(
            make_piece(c.name, [Segment(source, dim, start, start + length)], shapes)
        )
        model.chunks.setdefault(c.file, []).append(c)
        if head_dim:
            model.head_dims[c.name] = head_dim


def _composite(
    model: DcpModel, root: Path, source: str, dim: int, head_dim: int | None, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """The whole tensor `source` held under COMPOSITE, read by `DcpTensors`."""
    model.files[COMPOSITE] = root / METADATA
    model.holdings.setdefault(COMPOSITE, []).append(
        make_piece(source, [Segment(source, dim, 0, _len(shapes[source], dim))], shapes)
    )
    if head_dim:
        model.head_dims[source] = head_dim


def _len(shape: tuple[int, ...], dim: int) -> int:
    return shape[dim] if shape else 1


def _segment_of(chunk: Chunk, shape: tuple[int, ...], dim: int, head_dim: int | None) -> bool:
    """Whether a chunk is a segment of its tensor along `dim` (whole along every other axis), of
    whole heads when its rows are permuted per head."""
    if not shape:
        return True
    if any(o != 0 or s != n for k, (o, s, n) in enumerate(zip(chunk.offsets, chunk.sizes, shape)) if k != dim):
        return False
    if head_dim and (dim != 0 or chunk.offsets[0] % head_dim or chunk.sizes[0] % head_dim):
        return False
    return True


# ---- writing -------------------------------------------------------------------------------


def _whole_heads(blocks: Iterable[torch.Tensor], head_dim: int) -> Iterator[torch.Tensor]:
    """Blocks of rows regrouped into whole heads and put in the permuted convention's order."""
    held: list[torch.Tensor] = []
    rows = 0
    for block in blocks:
        held.append(block)
        rows += block.shape[0]
        if rows % head_dim == 0:
            yield to_native(torch.cat(held) if len(held) > 1 else held[0], head_dim)
            held, rows = [], 0
    if held:
        raise RuntimeError(f"blocks of {rows} rows do not end on a head of {head_dim}")


def chunk_name(fqn: str, offsets: Sequence[int], shape: Sequence[int], head_dim: int | None) -> str:
    """The name of a chunk piece in a planned DCP output (`plan_outputs`): what `DcpWriter` needs to
    write it, its global shape and whether its heads are permuted, in the name itself."""
    return f"{fqn}@{','.join(map(str, offsets))}/{','.join(map(str, shape))}~{head_dim or 0}"


def parse_chunk_name(name: str) -> tuple[str, list[int] | None, list[int] | None, int | None]:
    """(fqn, offsets, global shape, head size) of a `chunk_name`; a plain name is a whole tensor."""
    if "~" not in name:
        return name, None, None, None
    head, _, hd = name.rpartition("~")
    rest, _, shape = head.rpartition("/")
    fqn, _, offsets = rest.rpartition("@")
    numbers = lambda text: [int(v) for v in text.split(",") if v != ""]  # noqa: E731
    return fqn, numbers(offsets), numbers(shape), int(hd) or None


class DcpWriter(DcpFileWriter):
    """The engine's writer of one planned DCP data file (`plan_outputs`): each spec is a chunk
    (`chunk_name`), written in the convention's row order."""

    def __init__(
        self,
        path: Path,
        root: Path,
        specs: Sequence[TensorSpec],
        digests: Recording = Recording.FAST,
        direct: bool = False,
        sink: Sink = NO_SINK,
    ):
        check_specs(specs)
        super().__init__(path, root, digests, direct, sink)
        self._specs, self._next = list(specs), 0
        self._native = all(written_natively([spec], tensor_pickle(spec)) for spec in self._specs)

    def _expect(self, name: str) -> TensorSpec:
        spec = self._specs[self._next] if self._next < len(self._specs) else None
        if spec is None or spec.name != name:
            self.abort()
            raise RuntimeError(f"{self.path}: expected {spec}, got {name}")
        return spec

    def write(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """The next chunk, whole."""
        spec = self._expect(name)
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            self.abort()
            raise RuntimeError(f"{self.path}: expected {spec}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self.write_chunks(name, [tensor], owned)

    def can_copy(self) -> bool:
        """Whether `write_copy` may be used (shardkit's zip writer writes every chunk's archive)."""
        return self._native

    def write_copy(self, name: str, ranges: Iterable[FileRange]) -> None:
        """The next chunk, its bytes `ranges` of source files one after another: copied by the
        kernel; read and put in the convention's row order where it permutes them."""
        spec = self._expect(name)
        fqn, offsets, shape, head_dim = parse_chunk_name(name)
        if head_dim:
            self.write_chunks(name, [from_ranges(ranges, spec)], owned=True)
            return
        self.add_rows(TensorSpec(fqn, spec.shape, spec.dtype), (), offsets=offsets, shape=shape, ranges=ranges)
        self._next += 1

    def write_chunks(self, name: str, chunks: Iterable[torch.Tensor], owned: bool = False) -> None:
        """The next chunk as consecutive blocks of its rows (the format's `chunked_writes`): memory
        holds a block (of whole heads where the convention permutes them), never the chunk."""
        spec = self._expect(name)
        fqn, offsets, shape, head_dim = parse_chunk_name(name)
        blocks = _whole_heads(chunks, head_dim) if head_dim else chunks
        self.add_rows(
            TensorSpec(fqn, spec.shape, spec.dtype), blocks, offsets=offsets, shape=shape, owned=owned or bool(head_dim)
        )
        self._next += 1

    def close(self, fsync: bool = False) -> list[FileRecord]:
        if self._next != len(self._specs):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self._specs) - self._next} chunks were not written")
        return super().close(fsync)


# ---- planning a model written as DCP -------------------------------------------------------


def plan_outputs(
    family: Family, dims: ModelDims, layout: Layout, convention: str | None = None
) -> list[tuple[str, list[Piece], tuple[int, int, int]]]:
    """The data files of a model written as DCP for `layout`: one per (ep, tp, pp) rank, holding that
    rank's segments of the full tensors as chunks (a chunk another rank already holds is left out,
    as DCP saves replicated data once), named in `convention`'s names (default: Hugging Face's)."""
    chosen = get_convention(convention)
    chosen.check(family.name, dims)
    layout.validate(dims)
    shapes = family.full_shapes(dims)
    covered: dict[str, list[tuple[int, int]]] = {}
    outputs = []
    for rank, (ep, tp, pp) in enumerate(layout.ranks()):
        pieces: list[Piece] = []
        for piece in family.rank_pieces(layout, dims, tp, pp, shapes, ep):
            for seg in piece.segments:
                if seg.source not in shapes:
                    continue
                full, head_dim = shapes[seg.source], chosen.head_dim(seg.source, dims)
                for part in _uncovered(covered.setdefault(seg.source, []), seg.start, seg.stop):
                    for start, stop in _bounded(part, full, seg.dim, head_dim or 1):
                        offsets = [0] * len(full)
                        if full:
                            offsets[seg.dim] = start
                        name = chunk_name(chosen.native(seg.source), offsets, full, head_dim)
                        pieces.append(make_piece(name, [Segment(seg.source, seg.dim, start, stop)], shapes))
        outputs.append((data_file(rank), pieces, (ep, tp, pp)))
    return outputs


CHUNK_BYTES = 64 << 20
"""The most bytes (at 4 per element) of one chunk in a DCP shardkit writes: a larger slice is
saved as several chunks (DCP allows any), so that writing and reading one holds at most that."""


def _bounded(part: tuple[int, int], shape: Sequence[int], dim: int, unit: int) -> list[tuple[int, int]]:
    """`part` of `dim` cut into ranges of at most CHUNK_BYTES (whole `unit`s of it: heads)."""
    start, stop = part
    across = 4 * math.prod(n for k, n in enumerate(shape) if k != dim) if shape else 4
    step = max(unit, CHUNK_BYTES // max(1, across) // unit * unit)
    return [(a, min(stop, a + step)) for a in range(start, stop, step)]


def _uncovered(covered: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of [start, stop) not in `covered` (which then covers them too)."""
    parts, pos = [], start
    for a, b in sorted(covered):
        if b <= pos or a >= stop:
            continue
        if a > pos:
            parts.append((pos, a))
        pos = max(pos, b)
    if pos < stop:
        parts.append((pos, stop))
    covered.extend(parts)
    return parts
