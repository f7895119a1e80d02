"""Placements: how one or a few full (Hugging Face) tensors are cut into a rank's pieces.

Every placement reduces to one idea: a rank's *piece* is a concatenation, along one axis, of
*segments* (contiguous slices) of full tensors. A column-parallel split is one segment; a fused
gate_up is two (gate's slice, then up's slice); attention under kv replication is a few head
ranges of q, k and v. Expert layers add two twists that stay in the same description: a piece
may stack several such concatenations (*slabs*, one per local expert) on a leading axis, and
may hold its segments transposed (NxD's expert weights are (in, out)). So each placement only has to list a rank's pieces (`pieces()`), and the
three questions of the design are answered once, for all placements, by the functions below:

1. `shard` builds a piece from full tensors; `gather` rebuilds full tensors from pieces
   (exact inverses: only slicing and concatenation, so a round trip is bit-exact);
2. a piece's `segments` are its source slices, which readers fetch lazily;
3. `Piece.shape` comes from the segments alone, with no data.

Resharding composes two plans through `SegmentIndex`, which says where each slice of a full
tensor is held in a set of pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

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
    """One tensor of a rank file.

    A piece is one *slab*, or several slabs stacked on a new leading axis (experts). A slab is
    its segments, each transposed first when `transposed` (expert layers store (in, out)),
    concatenated along `cat_dim`.
    """

    name: str
    slabs: tuple[tuple[Segment, ...], ...]
    shape: tuple[int, ...]
    stacked: bool = False
    transposed: bool = False
    expert: bool = False

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(s for slab in self.slabs for s in slab)

    @property
    def cat_dim(self) -> int:
        """The axis, in slab coordinates, along which a slab's segments are concatenated."""
        dim = self.slabs[0][0].dim
        return 1 - dim if self.transposed else dim

    def numel(self) -> int:
        return math.prod(self.shape)


def _merge_adjacent(segments: Sequence[Segment]) -> tuple[Segment, ...]:
    merged: list[Segment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if last and last.source == seg.source and last.dim == seg.dim and last.stop == seg.start:
            merged[-1] = Segment(seg.source, seg.dim, last.start, seg.stop)
        else:
            merged.append(seg)
    return tuple(merged)


def _slab_shape(slab: Sequence[Segment], full_shapes, transposed: bool) -> tuple[int, ...]:
    shape = list(full_shapes[slab[0].source])
    shape[slab[0].dim] = sum(s.length for s in slab)
    return tuple(reversed(shape)) if transposed else tuple(shape)


def make_piece(
    name: str, segments: Sequence[Segment], full_shapes: Mapping[str, tuple[int, ...]], transposed: bool = False
) -> Piece:
    """A one-slab piece with its shape computed from its segments (adjacent segments merged)."""
    slab = _merge_adjacent(segments)
    return Piece(name, (slab,), _slab_shape(slab, full_shapes, transposed), transposed=transposed)


def make_stacked(
    name: str, slabs: Sequence[Sequence[Segment]], full_shapes: Mapping[str, tuple[int, ...]], transposed: bool = False
) -> Piece:
    """Slabs stacked on a new leading axis (one per local expert)."""
    merged = tuple(_merge_adjacent(s) for s in slabs)
    shape = (len(merged), *_slab_shape(merged[0], full_shapes, transposed))
    return Piece(name, merged, shape, stacked=True, transposed=transposed, expert=True)


def whole(source: str, full_shapes: Mapping[str, tuple[int, ...]], dim: int = 0) -> Segment:
    return Segment(source, dim, 0, full_shapes[source][dim] if full_shapes[source] else 1)


def _split_range(size: int, parts: int, index: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise FormatError(f"{what}: size {size} does not split into {parts} equal parts")
    step = size // parts
    return index * step, (index + 1) * step


# ---- full shapes, declared by the placements ------------------------------------------------

Size = int | str | Callable[[ModelDims], int]
"""One dimension of a declared shape: a number, the name of a ModelDims field or property
(`"hidden_size"`, `"q_size"`), or a function of the dims."""

Shape = tuple[Size, ...]


def size_of(spec: Size, dims: ModelDims) -> int:
    if isinstance(spec, int):
        return spec
    if isinstance(spec, str):
        return int(getattr(dims, spec))
    return int(spec(dims))


def shape_of(spec: Shape, dims: ModelDims) -> tuple[int, ...]:
    return tuple(size_of(s, dims) for s in spec)


@dataclass(frozen=True)
class Block:
    """The `index`-th of `count` equal blocks, along the placement's axis, of the full tensor
    `source`: a part of a Hugging Face tensor that is stored already fused (Phi-3's
    `gate_up_proj` = [gate; up] is Block(name, 0, 2) and Block(name, 1, 2))."""

    source: str
    index: int
    count: int


# ---- the placements ------------------------------------------------------------------------


class Placement(Protocol):
    """What every placement answers: the full tensors it consumes (relative to the block prefix)
    with their full shapes, the axis each is cut along, and one rank's pieces. `expert`
    placements are split over ep (held by every ep rank); the others live once, on ep rank 0.

    A placement declares the shape of each source it consumes, in terms of ModelDims, so a family
    table names each tensor once (`Family.full_shapes` collects them)."""

    expert: ClassVar[bool]

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]: ...

    def sources(self, dims: ModelDims) -> list[str]: ...

    def split_dims(self, dims: ModelDims) -> dict[str, int]: ...

    def pieces(
        self,
        prefix: str,
        layout: Layout,
        dims: ModelDims,
        tp_rank: int,
        full_shapes: Mapping[str, tuple[int, ...]],
        ep_rank: int = 0,
    ) -> list[Piece]: ...


@dataclass(frozen=True)
class Replicated:
    """Every tp rank of the stage holds the whole tensor (norms, router, row-parallel biases)."""

    expert: ClassVar[bool] = False
    name: str
    shape: Shape
    when: Callable[[ModelDims], bool] | None = None
    out: str | None = None  # the name in rank files, when NxD renames it
    tied_to: str | None = None  # as Split's: the tensor whose values it takes when the config ties them

    def _active(self, dims: ModelDims) -> bool:
        return self.when is None or self.when(dims)

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        if not self._active(dims) or (self.tied_to and dims.tie_word_embeddings):
            return {}
        return {self.name: shape_of(self.shape, dims)}

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.shapes(dims))

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: 0 for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0) -> list[Piece]:
        if self.tied_to and dims.tie_word_embeddings and self._active(dims):
            return [
                make_piece(prefix + (self.out or self.name), [whole(prefix + self.tied_to, full_shapes)], full_shapes)
            ]
        return [
            make_piece(prefix + (self.out or n), [whole(prefix + n, full_shapes)], full_shapes)
            for n in self.sources(dims)
        ]


@dataclass(frozen=True)
class Split:
    """A contiguous equal split over tp along `dim` (0: column/vocab parallel, 1: row parallel).

    `tied_to` names the tensor whose values this one takes when the config ties them and the
    checkpoint omits it (lm_head <- embed_tokens).
    """

    expert: ClassVar[bool] = False
    name: str
    dim: int
    shape: Shape
    tied_to: str | None = None
    when: Callable[[ModelDims], bool] | None = None
    out: str | None = None  # the name in rank files, when NxD renames it

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        if self.when is not None and not self.when(dims):
            return {}
        if self.tied_to and dims.tie_word_embeddings:
            return {}
        return {self.name: shape_of(self.shape, dims)}

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.shapes(dims))

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: self.dim for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0) -> list[Piece]:
        if self.when is not None and not self.when(dims):
            return []
        source = prefix + (self.tied_to if (self.tied_to and dims.tie_word_embeddings) else self.name)
        start, stop = _split_range(full_shapes[source][self.dim], layout.tp, tp_rank, source)
        return [make_piece(prefix + (self.out or self.name), [Segment(source, self.dim, start, stop)], full_shapes)]


@dataclass(frozen=True)
class Fused:
    """Per rank, the rank's split of each of several parts, concatenated (gate_up).

    A part is a whole full tensor (Llama's gate_proj, up_proj) or a `Block` of one (Phi-3's
    gate_up_proj, stored fused by Hugging Face: merge writes it back fused). `shape` is the shape
    of one part."""

    expert: ClassVar[bool] = False
    name: str
    parts: tuple[str | Block, ...]
    dim: int
    shape: Shape
    when: Callable[[ModelDims], bool] | None = None

    def _active(self, dims: ModelDims) -> bool:
        return self.when is None or self.when(dims)

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        if not self._active(dims):
            return {}
        out: dict[str, tuple[int, ...]] = {}
        for part in self.parts:
            shape = list(shape_of(self.shape, dims))
            if isinstance(part, Block):
                shape[self.dim] *= part.count
                out[part.source] = tuple(shape)
            else:
                out[part] = tuple(shape)
        return out

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.shapes(dims))

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: self.dim for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0) -> list[Piece]:
        if not self._active(dims):
            return []
        segments = []
        for part in self.parts:
            name, index, count = (part.source, part.index, part.count) if isinstance(part, Block) else (part, 0, 1)
            source = prefix + name
            length = full_shapes[source][self.dim] // count
            start, stop = _split_range(length, layout.tp, tp_rank, source)
            segments.append(Segment(source, self.dim, index * length + start, index * length + stop))
        return [make_piece(prefix + self.name, segments, full_shapes)] if segments else []


# Names of the q/k/v pieces under each qkv style: (weight names, bias names); a single name
# means q, k and v are concatenated into one piece.
QKV_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "separate": (("q_proj.weight", "k_proj.weight", "v_proj.weight"), ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "gqa": (
        ("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v"),
        ("qkv_proj.bias_q", "qkv_proj.bias_k", "qkv_proj.bias_v"),
    ),
    "fused": (("qkv_proj.weight_qkv",), ("qkv_proj.bias_qkv",)),
    "coalesced": (("qkv_proj.weight",), ("qkv_proj.bias",)),
}


@dataclass(frozen=True)
class HeadGroups:
    """Attention: q/k/v column-parallel by heads, o row-parallel by the same q heads.

    K/V heads are replicated `kv_multiplier` times and split; each rank holds the q heads that its
    kv replicas serve (Layout.q_heads), so local heads attend to local kv heads and the sum over
    ranks of the row-parallel o_proj outputs is the full attention output.

    With `fused` (e.g. "qkv_proj"), Hugging Face stores q, k and v as one tensor `fused.weight`
    (rows [q; k; v], Phi-3's qkv_proj, DBRX's Wqkv): the head segments are then cut at offsets
    inside it, and merge writes it back fused. The rank-file names are the layout's qkv style's
    either way.
    """

    expert: ClassVar[bool] = False
    scope: str = "self_attn."
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv_bias: Callable[[ModelDims], bool] = lambda dims: dims.attention_bias
    o_bias: Callable[[ModelDims], bool] = lambda dims: dims.attention_bias
    fused: str | None = None
    o_out: str | None = None  # o's name in rank files, when NxD renames it (DBRX: o_proj)

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        H, q, kv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        kinds = ["weight"] + (["bias"] if self.qkv_bias(dims) else [])
        out: dict[str, tuple[int, ...]] = {}
        if self.fused:
            for kind in kinds:
                out[f"{self.scope}{self.fused}.{kind}"] = (q + 2 * kv, H) if kind == "weight" else (q + 2 * kv,)
            out[f"{self.scope}{self.o}.weight"] = (H, q)
        else:
            for proj, rows in ((self.q, q), (self.k, kv), (self.v, kv)):
                out[f"{self.scope}{proj}.weight"] = (rows, H)
            out[f"{self.scope}{self.o}.weight"] = (H, q)
            if self.qkv_bias(dims):
                for proj, rows in ((self.q, q), (self.k, kv), (self.v, kv)):
                    out[f"{self.scope}{proj}.bias"] = (rows,)
        if self.o_bias(dims):
            out[f"{self.scope}{self.o}.bias"] = (H,)
        return out

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.shapes(dims))

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        result = {n: 0 for n in self.sources(dims)}
        result[f"{self.scope}{self.o}.weight"] = 1
        return result

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0) -> list[Piece]:
        d = dims.head_dim
        out = prefix = prefix + self.scope
        q_rows, kv_rows = dims.num_heads * d, dims.num_kv_heads * d

        def head_segments(which: str, kind: str, heads: Iterable[int]) -> list[Segment]:
            if self.fused:
                source = f"{prefix}{self.fused}.{kind}"
                base = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[which]
            else:
                source = f"{prefix}{getattr(self, which)}.{kind}"
                base = 0
            return [Segment(source, 0, base + h * d, base + (h + 1) * d) for h in heads]

        q_heads = layout.q_heads(dims, tp_rank)
        kv_heads = [k for k, _ in layout.kv_entries(dims, tp_rank)]
        weight_names, bias_names = QKV_NAMES[layout.qkv]
        pieces: list[Piece] = []
        for kind, names, present in (("weight", weight_names, True), ("bias", bias_names, self.qkv_bias(dims))):
            if not present:
                continue
            per_proj = [
                head_segments("q", kind, q_heads),
                head_segments("k", kind, kv_heads),
                head_segments("v", kind, kv_heads),
            ]
            if len(names) == 1:
                pieces.append(make_piece(out + names[0], [s for segs in per_proj for s in segs], full_shapes))
            else:
                pieces.extend(make_piece(out + n, segs, full_shapes) for n, segs in zip(names, per_proj))
        o_weight, o_name = prefix + f"{self.o}.weight", f"{out}{self.o_out or self.o}"
        pieces.append(
            make_piece(o_name + ".weight", [Segment(o_weight, 1, h * d, (h + 1) * d) for h in q_heads], full_shapes)
        )
        if self.o_bias(dims):
            pieces.append(make_piece(o_name + ".bias", [whole(prefix + f"{self.o}.bias", full_shapes)], full_shapes))
        return pieces


# NxD's expert layers' stacked weights (ExpertFusedColumn/RowParallelLinear), per layer
EXPERT_GATE_UP = "mlp.expert_mlps.mlp_op.gate_up_proj.weight"
EXPERT_DOWN = "mlp.expert_mlps.mlp_op.down_proj.weight"


@dataclass(frozen=True)
class Experts:
    """Mixture-of-experts MLP as NxD's expert layers hold it: per-expert HF matrices stacked on a
    leading expert axis, that axis split over ep, each matrix transposed to (in, out) and split
    over tp: gate_up (E/ep, hidden, 2*I/tp) = [gate_r | up_r], down (E/ep, I/tp, hidden).

    `gate`, `up`, `down` are the per-expert HF names with `{e}` for the expert index."""

    gate: str
    up: str
    down: str
    gate_up_out: str = EXPERT_GATE_UP
    down_out: str = EXPERT_DOWN
    inter: Size = "intermediate_size"  # one expert's intermediate size
    expert: ClassVar[bool] = True

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        H, I = dims.hidden_size, size_of(self.inter, dims)
        out: dict[str, tuple[int, ...]] = {}
        for e in range(dims.num_experts):
            out.update({self.gate.format(e=e): (I, H), self.up.format(e=e): (I, H), self.down.format(e=e): (H, I)})
        return out

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.shapes(dims))

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        out = {}
        for e in range(dims.num_experts):
            out.update({self.gate.format(e=e): 0, self.up.format(e=e): 0, self.down.format(e=e): 1})
        return out

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0) -> list[Piece]:
        first, last = _split_range(dims.num_experts, layout.ep, ep_rank, "experts")
        gate_up, down = [], []
        for e in range(first, last):
            gate, up, dn = (prefix + t.format(e=e) for t in (self.gate, self.up, self.down))
            rows = _split_range(full_shapes[gate][0], layout.tp, tp_rank, gate)
            gate_up.append([Segment(gate, 0, *rows), Segment(up, 0, *rows)])
            down.append([Segment(dn, 1, *_split_range(full_shapes[dn][1], layout.tp, tp_rank, dn))])
        return [
            make_stacked(prefix + self.gate_up_out, gate_up, full_shapes, transposed=True),
            make_stacked(prefix + self.down_out, down, full_shapes, transposed=True),
        ]


@dataclass(frozen=True)
class FlatExperts:
    """Experts stored flat, one tensor per matrix for all experts of a layer (DBRX's `w1`, `v1`,
    `w2`, each (E * I, hidden): expert e is rows [e*I, (e+1)*I)), held as NxD's expert layers hold
    them: gate_up (E/ep, hidden, 2*I/tp) = [w1_e,r^T | v1_e,r^T] and down (E/ep, I/tp, hidden) =
    w2_e,r as stored (w2 is already (in, out)). Each expert's slice is a segment of the flat
    tensor, so shard, gather and reads stay generic."""

    gate: str
    up: str
    down: str
    gate_up_out: str = EXPERT_GATE_UP
    down_out: str = EXPERT_DOWN
    inter: Size = "intermediate_size"
    expert: ClassVar[bool] = True

    def shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        rows = dims.num_experts * size_of(self.inter, dims)
        return {n: (rows, dims.hidden_size) for n in (self.gate, self.up, self.down)}

    def sources(self, dims: ModelDims) -> list[str]:
        return list(self.shapes(dims))

    def split_dims(self, dims: ModelDims) -> dict[str, int]:
        return {n: 0 for n in self.sources(dims)}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0) -> list[Piece]:
        first, last = _split_range(dims.num_experts, layout.ep, ep_rank, "experts")
        inter = size_of(self.inter, dims)
        gate, up, down = (prefix + n for n in (self.gate, self.up, self.down))
        start, stop = _split_range(inter, layout.tp, tp_rank, gate)
        gate_up, down_slabs = [], []
        for e in range(first, last):
            rows = (e * inter + start, e * inter + stop)
            gate_up.append([Segment(gate, 0, *rows), Segment(up, 0, *rows)])
            down_slabs.append([Segment(down, 0, *rows)])
        return [
            make_stacked(prefix + self.gate_up_out, gate_up, full_shapes, transposed=True),
            make_stacked(prefix + self.down_out, down_slabs, full_shapes),
        ]


# ---- the generic operations -----------------------------------------------------------------


def read_segment(full: torch.Tensor, seg: Segment) -> torch.Tensor:
    return full.narrow(seg.dim, seg.start, seg.length)


def build_piece(piece: Piece, fetch: Callable[[Segment], torch.Tensor]) -> torch.Tensor:
    """Assemble a piece from its segments; `fetch` returns one segment of a full tensor."""
    slabs = []
    for slab in piece.slabs:
        parts = [fetch(s) for s in slab]
        if piece.transposed:
            parts = [p.t() for p in parts]
        slabs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=piece.cat_dim))
    out = (torch.stack(slabs) if piece.stacked else slabs[0]).contiguous()
    return out.clone() if out.untyped_storage().nbytes() != out.numel() * out.element_size() else out


def shard(piece: Piece, full_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Build one piece from full tensors."""
    return build_piece(piece, lambda s: read_segment(full_tensors[s.source], s))


@dataclass(frozen=True)
class Read:
    """Take [start, stop) along `dim` (None: from the first / to the last) of slab `slab` (None:
    unstacked) of piece `piece_name` in file `holder`; transpose it back when the piece stores
    the segment transposed."""

    holder: object
    piece_name: str
    slab: int | None
    dim: int
    start: int | None
    stop: int | None
    transposed: bool = False

    def take(self, piece_data: torch.Tensor) -> torch.Tensor:
        """Apply this read to a piece (or, for stacked pieces, to the already-selected slab)."""
        start = 0 if self.start is None else self.start
        stop = piece_data.shape[self.dim] if self.stop is None else self.stop
        t = piece_data.narrow(self.dim, start, stop - start)
        return t.t() if self.transposed else t


@dataclass(frozen=True)
class Holding:
    """Where the slice [start, stop) of a full tensor sits inside one piece of one file."""

    start: int
    stop: int
    holder: object
    piece_name: str
    offset: int  # along the piece's cat dim, inside its slab
    slab: int | None
    cat_dim: int
    transposed: bool

    def read(self, start: int | None = None, stop: int | None = None) -> Read:
        start = self.start if start is None else start
        stop = self.stop if stop is None else stop
        return Read(
            self.holder,
            self.piece_name,
            self.slab,
            self.cat_dim,
            self.offset + start - self.start,
            self.offset + stop - self.start,
            self.transposed,
        )


def gather(name: str, shape: Sequence[int], held: Iterable[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
    """Rebuild the full tensor `name` from pieces (any replicas; the first holder of a slice wins)."""
    index = SegmentIndex()
    data: dict[object, torch.Tensor] = {}  # by Read.holder: the position in `held`
    for key, (piece, tensor) in enumerate(held):
        index.add(key, piece)
        data[key] = tensor
    dim = index.dim_of(name)
    reads = index.locate(Segment(name, dim, 0, shape[dim] if shape else 1))
    parts = [r.take(data[r.holder] if r.slab is None else data[r.holder][r.slab]) for r in reads]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return out.reshape(shape).clone()


@dataclass
class SegmentIndex:
    """Where each slice of each full tensor is held, over a set of pieces in files."""

    _by_source: dict[str, list[Holding]] = field(default_factory=dict)
    _dims: dict[str, int] = field(default_factory=dict)

    def add(self, holder: object, piece: Piece) -> None:
        for k, slab in enumerate(piece.slabs):
            offset = 0
            for seg in slab:
                self._by_source.setdefault(seg.source, []).append(
                    Holding(
                        seg.start,
                        seg.stop,
                        holder,
                        piece.name,
                        offset,
                        k if piece.stacked else None,
                        piece.cat_dim,
                        piece.transposed,
                    )
                )
                self._dims.setdefault(seg.source, seg.dim)
                offset += seg.length

    def sources(self) -> list[str]:
        return list(self._by_source)

    def dim_of(self, source: str) -> int:
        return self._dims.get(source, 0)

    def holdings(self, source: str) -> list[Holding]:
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
            for h in entries:
                if h.start <= pos < h.stop:
                    score = (h.holder == prefer, h.stop)
                    if best is None or score > best[0]:
                        best = (score, h)
            if best is None:
                raise FormatError(
                    f"no shard holds rows {pos}..{seg.stop} of {seg.source}: a rank file is missing or truncated"
                )
            h = best[1]
            end = min(h.stop, seg.stop)
            reads.append(h.read(pos, end))
            prefer = h.holder
            pos = end
        return reads
