"""Placements: how one or a few full (Hugging Face) tensors are cut into a rank's pieces.

Every placement reduces to one idea: a rank's *piece* is a concatenation, along one axis, of
*segments* (contiguous slices) of full tensors. A column-parallel split is one segment; a fused
gate_up is two (gate's slice, then up's slice); attention under kv replication is a few head
ranges of q, k and v. So each placement only has to list a rank's pieces (`pieces()`), and the
three questions of the design are answered once, for all placements, by the functions below:

1. `shard` builds a piece from full tensors; `gather` rebuilds full tensors from pieces
   (exact inverses: only slicing and concatenation, so a round trip is bit-exact);
2. a piece's `segments` are its source slices, which readers fetch lazily;
3. `Piece.shape` comes from the segments alone, with no data.

Resharding composes two plans through `SegmentIndex`, which says where each slice of a full
tensor is held in a set of pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from .errors import FormatError
from .layout import Layout, ModelDims


@dataclass(frozen=True)
class Segment:
    """The slice [start, stop) along `dim` of the full tensor `source`."""

    source: str
    dim: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """One tensor of a rank file: its segments concatenated along their (common) dim."""

    name: str
    segments: tuple[Segment, ...]
    shape: tuple[int, ...]

    @property
    def dim(self) -> int:
        return self.segments[0].dim

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def make_piece(name: str, segments: Sequence[Segment], full_shapes: Mapping[str, tuple[int, ...]]) -> Piece:
    """A piece with its shape computed from its segments (adjacent segments merged)."""
    merged: list[Segment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if last and last.source == seg.source and last.dim == seg.dim and last.stop == seg.start:
            merged[-1] = Segment(seg.source, seg.dim, last.start, seg.stop)
        else:
            merged.append(seg)
    dim = merged[0].dim
    shape = list(full_shapes[merged[0].source])
    shape[dim] = sum(s.length for s in merged)
    return Piece(name, tuple(merged), tuple(shape))


def whole(source: str, full_shapes: Mapping[str, tuple[int, ...]], dim: int = 0) -> Segment:
    return Segment(source, dim, 0, full_shapes[source][dim] if full_shapes[source] else 1)


def _split_range(size: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise FormatError(f"{what}: size {size} does not split into {parts} equal parts")
    step = size // parts
    return index * step, (index + 1) * step


# ---- the placements ------------------------------------------------------------------------
# Each has `sources(dims)` (the full tensors it consumes, relative to the block prefix) and
# `pieces(prefix, layout, dims, tp_rank, full_shapes)`.


@dataclass(frozen=True)
class Replicated:
    """Every tp rank of the stage holds the whole tensor (norms, router, row-parallel biases)."""

    name: str
    when: Callable[[ModelDims], bool] | None = None

    def sources(self, dims: ModelDims) -> list[str]:
        return [self.name] if self.when is None or self.when(dims) else []

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: 0 for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes) -> list[Piece]:
        return [make_piece(prefix + n, [whole(prefix + n, full_shapes)], full_shapes) for n in self.sources(dims)]


@dataclass(frozen=True)
class Split:
    """A contiguous equal split over tp along `dim` (0: column/vocab parallel, 1: row parallel).

    `tied_to` names the tensor whose values this one takes when the config ties them and the
    checkpoint omits it (lm_head <- embed_tokens).
    """

    name: str
    dim: int
    tied_to: str | None = None
    when: Callable[[ModelDims], bool] | None = None

    def sources(self, dims: ModelDims) -> list[str]:
        if self.when is not None and not self.when(dims):
            return []
        if self.tied_to and dims.tie_word_embeddings:
            return []
        return [self.name]

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: self.dim for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes) -> list[Piece]:
        if self.when is not None and not self.when(dims):
            return []
        source = prefix + (self.tied_to if (self.tied_to and dims.tie_word_embeddings) else self.name)
        start, stop = _split_range(full_shapes[source][self.dim], layout.tp, tp_rank, source)
        return [make_piece(prefix + self.name, [Segment(source, self.dim, start, stop)], full_shapes)]


@dataclass(frozen=True)
class Fused:
    """Per rank, the rank's split of each of several tensors, concatenated (gate_up)."""

    name: str
    parts: tuple[str, ...]
    dim: int = 0
    when: Callable[[ModelDims], bool] | None = None

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.parts) if self.when is None or self.when(dims) else []

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: self.dim for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes) -> list[Piece]:
        segments = []
        for part in self.sources(dims):
            source = prefix + part
            start, stop = _split_range(full_shapes[source][self.dim], layout.tp, tp_rank, source)
            segments.append(Segment(source, self.dim, start, stop))
        return [make_piece(prefix + self.name, segments, full_shapes)] if segments else []


# Names of the q/k/v pieces under each qkv style: (weight names, bias names); a single name
# means q, k and v are concatenated into one piece.
QKV_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "separate": (("q_proj.weight", "k_proj.weight", "v_proj.weight"), ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "gqa": (("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v"), ("qkv_proj.bias_q", "qkv_proj.bias_k", "qkv_proj.bias_v")),
    "fused": (("qkv_proj.weight_qkv",), ("qkv_proj.bias_qkv",)),
    "coalesced": (("qkv_proj.weight",), ("qkv_proj.bias",)),
}


@dataclass(frozen=True)
class HeadGroups:
    """Attention: q/k/v column-parallel by heads, o row-parallel by the same q heads.

    K/V heads are replicated `kv_multiplier` times and split; each rank holds the q heads that its
    kv replicas serve (Layout.q_heads), so local heads attend to local kv heads and the sum over
    ranks of the row-parallel o_proj outputs is the full attention output.
    """

    scope: str = "self_attn."
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv_bias: Callable[[ModelDims], bool] = lambda dims: dims.attention_bias
    o_bias: Callable[[ModelDims], bool] = lambda dims: dims.attention_bias

    def sources(self, dims: ModelDims) -> list[str]:
        names = [f"{p}.weight" for p in (self.q, self.k, self.v, self.o)]
        if self.qkv_bias(dims):
            names += [f"{p}.bias" for p in (self.q, self.k, self.v)]
        if self.o_bias(dims):
            names.append(f"{self.o}.bias")
        return [self.scope + n for n in names]

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        result = {n: 0 for n in self.sources(dims)}
        result[f"{self.scope}{self.o}.weight"] = 1
        return result

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes) -> list[Piece]:
        d = dims.head_dim
        prefix = prefix + self.scope

        def head_segments(source: str, heads: Iterable[int], dim: int) -> list[Segment]:
            return [Segment(prefix + source, dim, h * d, (h + 1) * d) for h in heads]

        q_heads = layout.q_heads(dims, tp_rank)
        kv_heads = [k for k, _ in layout.kv_entries(dims, tp_rank)]
        weight_names, bias_names = QKV_NAMES[layout.qkv]
        pieces: list[Piece] = []
        for kind, names, present in (("weight", weight_names, True), ("bias", bias_names, self.qkv_bias(dims))):
            if not present:
                continue
            per_proj = [
                head_segments(f"{self.q}.{kind}", q_heads, 0),
                head_segments(f"{self.k}.{kind}", kv_heads, 0),
                head_segments(f"{self.v}.{kind}", kv_heads, 0),
            ]
            if len(names) == 1:
                pieces.append(make_piece(prefix + names[0], [s for segs in per_proj for s in segs], full_shapes))
            else:
                pieces.extend(make_piece(prefix + n, segs, full_shapes) for n, segs in zip(names, per_proj))
        pieces.append(make_piece(prefix + f"{self.o}.weight", head_segments(f"{self.o}.weight", q_heads, 1), full_shapes))
        if self.o_bias(dims):
            pieces.append(make_piece(prefix + f"{self.o}.bias", [whole(prefix + f"{self.o}.bias", full_shapes)], full_shapes))
        return pieces


# ---- the generic operations -----------------------------------------------------------------


def read_segment(full: torch.Tensor, seg: Segment) -> torch.Tensor:
    return full.narrow(seg.dim, seg.start, seg.length)


def shard(piece: Piece, full_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Build one piece from full tensors."""
    parts = [read_segment(full_tensors[s.source], s) for s in piece.segments]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=piece.dim)


def gather(name: str, shape: Sequence[int], held: Iterable[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
    """Rebuild the full tensor `name` from pieces (any replicas; the first holder of a slice wins)."""
    index = SegmentIndex()
    data = {}
    for key, (piece, tensor) in enumerate(held):
        index.add(key, piece)
        data[key] = tensor
    reads = index.locate(Segment(name, index.dim_of(name), 0, shape[index.dim_of(name)] if shape else 1))
    parts = [data[r.holder].narrow(r.dim, r.start, r.stop - r.start) for r in reads]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=reads[0].dim)
    return out.reshape(shape).clone()


@dataclass(frozen=True)
class Read:
    """Read [start, stop) along dim of piece `piece_name` held by `holder` (a file key)."""

    holder: object
    piece_name: str
    dim: int
    start: int
    stop: int


@dataclass
class SegmentIndex:
    """Where each slice of each full tensor is held, over a set of pieces in files."""

    _by_source: dict[str, list[tuple[int, int, object, str, int]]] = field(default_factory=dict)
    _dims: dict[str, int] = field(default_factory=dict)

    def add(self, holder: object, piece: Piece) -> None:
        offset = 0
        for seg in piece.segments:
            self._by_source.setdefault(seg.source, []).append((seg.start, seg.stop, holder, piece.name, offset))
            self._dims.setdefault(seg.source, seg.dim)
            offset += seg.length

    def sources(self) -> list[str]:
        return list(self._by_source)

    def dim_of(self, source: str) -> int:
        return self._dims.get(source, 0)

    def holders(self, source: str) -> list[tuple[int, int, object, str, int]]:
        return self._by_source.get(source, [])

    def locate(self, seg: Segment, prefer: object = None) -> list[Read]:
        """The reads that together give `seg`, in order. Raises FormatError on a gap."""
        entries = self._by_source.get(seg.source)
        if not entries:
            raise FormatError(f"no shard holds tensor {seg.source}: a rank file is missing or the layout is wrong")
        if self._dims[seg.source] != seg.dim:
            raise FormatError(f"{seg.source} is held split along dim {self._dims[seg.source]}, not {seg.dim}")
        reads: list[Read] = []
        pos = seg.start
        while pos < seg.stop:
            best = None
            for start, stop, holder, name, offset in entries:
                if start <= pos < stop:
                    score = (holder == prefer, stop)
                    if best is None or score > best[0]:
                        best = (score, start, stop, holder, name, offset)
            if best is None:
                raise FormatError(
                    f"no shard holds rows {pos}..{seg.stop} of {seg.source}: a rank file is missing or truncated"
                )
            _, start, stop, holder, name, offset = best
            end = min(stop, seg.stop)
            reads.append(Read(holder, name, seg.dim, offset + pos - start, offset + end - start))
            prefer = holder
            pos = end
        return reads
