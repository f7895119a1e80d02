"""Memory plans: what one rank of a parallel layout holds for training, computed without weights.

Everything comes from the layout algebra: a rank's parameter count is the sum of `Piece.numel()`
over the pieces `Family.rank_pieces(layout, dims, tp_rank, pp_rank, full_shapes)` gives it.
Replicated tensors (norms) therefore count on every rank that holds them and kv heads count once
per replica (kv-multiplier): that is memory the devices really spend. The one exception: a piece
made of exactly the same slices as another piece of the same rank is the same parameter (an
lm_head tied to the embedding when both sit on one stage) and counts once; on different stages
it is a copy and counts on both.

Bytes per parameter, per rank:

* weights: the training dtype (bf16 and fp16: 2 B, fp32: 4 B);
* gradients: the same dtype as the weights (2 B or 4 B). Setups that accumulate gradients in
  fp32 need 2 B more per parameter: add it to the reserve;
* optimizer (Adam/AdamW): with bf16/fp16 weights, an fp32 master copy + exp_avg + exp_avg_sq =
  12 B; with fp32 weights the weights are the master copy, so exp_avg + exp_avg_sq = 8 B.
  With ZeRO-1 the optimizer state (and only it) is sharded over the dp data-parallel ranks:
  each holds ceil(parameters / dp) parameters' worth.

Activations, the compiler's and runtime's scratch memory and communication buffers are NOT
estimated: a *reserve* of the device memory (10% by default) is set aside for them, and a layout
fits when the largest rank's weights + gradients + optimizer state fit in what remains. Real
activation memory depends on batch size, sequence length and activation checkpointing and can
need more than 10%: raise the reserve accordingly.

Pricing is by blocks, not by layer, so that its work never grows with the layer count (a config
edited to 4096 layers answers as fast as the real one): every decoder layer of a family is cut
from the same layer table (its index changes names only), so a rank's stage is (the first block,
on stage 0) + (its number of layers) x (one layer) + (the final block, on the last stage). Each
block is priced once per (tp, kv-multiplier) with `Family.block_pieces` on a one-layer stand-in
of the model, at tp rank 0 only when the family's placements give every rank the same share, and
a layout's peak is found among the few stages that can be the largest. `tests/unit/memory/test_plan.py`
checks this against pricing every piece of every layer of every rank, byte for byte. What is left
is bounded: a plan or search estimated at more than MAX_WORK (a few seconds) is refused, to be
narrowed.

`plan_memory` reports one layout (each pipeline stage: the largest of its tp ranks; ranks of a
stage can differ, e.g. the vocab-parallel embedding only lives on stage 0 and lm_head on the
last). `suggest_layouts` lists the valid (tp, pp, kv-multiplier) layouts that fit a device,
smallest tp first (the usual rule: the smallest tp that fits, as tp costs communication in every
layer), then smallest pp.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, overload

from .errors import FormatError, LayoutError, ShardkitError
from .families import Family, family_for, layer_of
from .formats import load_config
from .formats.base import parse_dtype
from .layout import Layout, ModelDims
from .placements import Experts, FlatExperts, Fused, HeadGroups, Piece, Replicated, Split
from .sizes import format_bytes, parse_size

DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_RESERVE = 0.10
"""Share of the device memory kept for activations, runtime and compiler scratch (not estimated)."""


def weight_bytes_per_param(dtype: str) -> int:
    """Bytes of one weight (and one gradient) in the training dtype."""
    return 4 if _dtype(dtype) == "fp32" else 2


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam state per parameter: fp32 master + exp_avg + exp_avg_sq (12 B) for bf16/fp16 weights,
    exp_avg + exp_avg_sq (8 B) for fp32 weights (they are their own master copy)."""
    return 8 if _dtype(dtype) == "fp32" else 12


def _dtype(dtype: str) -> str:
    name = _dtype_name(str(dtype).lower())
    if name is None:
        raise ShardkitError(f"dtype {dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    return name


@lru_cache(maxsize=32)
def _dtype_name(dtype: str) -> str | None:
    """bf16, fp16 or fp32 for a dtype's name, None when it is none of them (cached: a --suggest
    asks once per layout it keeps)."""
    try:
        torch_dtype = parse_dtype(dtype)
    except FormatError:
        return None
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(torch_dtype))


# ---- sizes ------------------------------------------------------------------------------------


def parse_reserve(reserve: str | float | int, device_memory: int) -> int:
    """Bytes kept back from `device_memory`: a percentage ("10%"), a fraction below 1 (0.1) or a
    size ("2GiB", or an int of bytes)."""
    if isinstance(reserve, float) or (isinstance(reserve, str) and reserve.strip().endswith("%")):
        try:
            fraction = float(reserve.strip()[:-1]) / 100 if isinstance(reserve, str) else reserve
        except ValueError:
            raise ShardkitError(f"reserve {reserve!r} is not understood: write e.g. 10%, 0.1 or 2GiB") from None
        if not 0 <= fraction < 1:
            raise ShardkitError(f"reserve {reserve!r} must be at least 0% and below 100% of the device memory")
        return int(device_memory * fraction)
    if isinstance(reserve, str):
        try:
            value = float(reserve)
        except ValueError:
            value = None
        if value is not None and value < 1:
            return parse_reserve(value, device_memory)
    nbytes = parse_size(reserve, what="reserve")
    if nbytes >= device_memory:
        raise ShardkitError(
            f"reserve {format_bytes(nbytes)} leaves nothing of the {format_bytes(device_memory)} device memory: "
            "give a smaller --reserve"
        )
    return nbytes


# ---- reports ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the largest of its tp ranks (a stage's ranks can differ)."""

    stage: int
    layers: tuple[int, int]
    """First and last decoder layer of the stage (inclusive)."""
    params: int
    """Parameters held by the stage's largest tp rank."""
    tp_rank: int
    """Which tp rank that is (the first one when several tie)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "layers": list(self.layers),
            "params": self.params,
            "tp_rank": self.tp_rank,
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class PlanReport:
    """Per-rank training memory of one layout (weights, gradients, Adam state; no activations)."""

    family: str
    model_type: str
    parameters: int
    """Parameters of the full model (the Hugging Face checkpoint)."""
    held_parameters: int
    """Parameters held by all tp x pp ranks of one data-parallel replica: more than `parameters`
    because norms are replicated on every tp rank and kv heads kv-multiplier times."""
    layout: Layout
    dtype: str
    zero1: bool
    dp: int
    stages: Sequence[StagePlan]
    """Each pipeline stage (a `StageList` from `plan_memory`/`suggest_layouts`: built on demand)."""
    device_memory: int | None = None
    reserve_bytes: int | None = None

    @property
    def weight_bytes_per_param(self) -> int:
        return weight_bytes_per_param(self.dtype)

    @property
    def optimizer_bytes_per_param(self) -> int:
        return optimizer_bytes_per_param(self.dtype)

    @property
    def world_size(self) -> int:
        return self.layout.tp * self.layout.pp * self.dp

    @property
    def peak(self) -> StagePlan:
        """The stage whose largest rank needs the most memory (the first on ties)."""
        if isinstance(self.stages, StageList):
            return self.stages.peak
        return max(self.stages, key=lambda s: (s.total_bytes, -s.stage))

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def usable_bytes(self) -> int | None:
        """Device memory minus the reserve, or None without a device memory."""
        return None if self.device_memory is None else self.device_memory - (self.reserve_bytes or 0)

    @property
    def fits(self) -> bool | None:
        """Whether every rank fits the usable device memory (None without a device memory)."""
        return None if self.usable_bytes is None else self.peak_bytes <= self.usable_bytes

    @property
    def spare_bytes(self) -> int | None:
        return None if self.usable_bytes is None else self.usable_bytes - self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "model_type": self.model_type,
            "parameters": self.parameters,
            "held_parameters": self.held_parameters,
            "layout": self.layout.to_dict(),
            "dtype": self.dtype,
            "zero1": self.zero1,
            "dp": self.dp,
            "world_size": self.world_size,
            "bytes_per_param": {
                "weights": self.weight_bytes_per_param,
                "grads": self.weight_bytes_per_param,
                "optimizer": self.optimizer_bytes_per_param,
            },
            "stages": [s.to_dict() for s in self.stages],
            "peak": {"stage": self.peak.stage, "params": self.peak.params, "total_bytes": self.peak_bytes},
            "device_memory": self.device_memory,
            "reserve_bytes": self.reserve_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "spare_bytes": self.spare_bytes,
            "activations_estimated": False,
        }


def _model(config: Mapping[str, Any] | str | Path) -> tuple[dict[str, Any], Family, ModelDims]:
    where = "config.json"  # a dict: the name it stands for
    if isinstance(config, (str, Path)):
        path = Path(config)
        where = str(path / "config.json" if path.is_dir() else path)
        config = load_config(path)
    config = dict(config)
    return config, family_for(config), ModelDims.from_config(config, where)


def _unique(pieces: Sequence[Piece]) -> list[Piece]:
    """Pieces of one rank, each slice held once: a piece made of exactly the same slices as an
    earlier one is the same parameter (lm_head tied to the embedding, on the same stage)."""
    seen, out = set(), []
    for piece in pieces:
        if piece.slabs not in seen:
            seen.add(piece.slabs)
            out.append(piece)
    return out


def rank_params(pieces: Sequence[Piece]) -> int:
    """Parameters one rank holds: the sum of its pieces' sizes, tied duplicates counted once."""
    return sum(p.numel() for p in _unique(pieces))


def _check_layout(family: Family, layout: Layout, dims: ModelDims) -> None:
    if layout.ep != 1:
        raise LayoutError("plan does not estimate expert parallelism yet: use ep 1")
    family.validate(layout, dims)


# ---- pricing by blocks --------------------------------------------------------------------------


@dataclass(frozen=True)
class _RankClass:
    """tp ranks whose blocks hold the same numbers of parameters (usually every rank: the
    placements cut equal parts), represented by the first of them."""

    rank: int
    """The first tp rank of the class (a stage reports the first of its largest ranks)."""
    count: int
    """How many tp ranks the class has."""
    first: int
    """The first block (embedding), held by stage 0."""
    final: int
    """The final block (final norm, lm_head), held by the last stage."""
    single: int
    """Both blocks on one stage (pp 1): an lm_head tied to the embedding counts once."""
    layer: int
    """One decoder layer."""

    def stage(self, layers: int, first: bool, last: bool) -> int:
        edge = self.single if first and last else self.first if first else self.final if last else 0
        return edge + layers * self.layer


@dataclass(frozen=True)
class _Pricing:
    """Per-rank parameters of a model's blocks under one tp, kv-multiplier, qkv style and replica
    order: every stage of every pp is a sum of these, so each is priced once."""

    classes: tuple[_RankClass, ...]
    edge_parameters: int
    """Parameters of the full model's first and final blocks (the Hugging Face checkpoint's)."""
    layer_parameters: int
    """Parameters of one full decoder layer."""

    def parameters(self, num_layers: int) -> int:
        """Parameters of the full model."""
        return self.edge_parameters + num_layers * self.layer_parameters

    def stage(self, layers: int, first: bool, last: bool) -> tuple[int, int]:
        """(parameters, tp rank) of the largest rank of a stage holding `layers` decoder layers (the
        first rank on ties)."""
        if len(self.classes) == 1:  # every rank alike: the usual case
            return self.classes[0].stage(layers, first, last), self.classes[0].rank
        best, rank = -1, 0
        for c in self.classes:  # in rank order: a later class must hold more to win
            n = c.stage(layers, first, last)
            if n > best:
                best, rank = n, c.rank
        return best, rank

    def peak(self, num_layers: int, pp: int) -> tuple[int, int]:
        """(stage, parameters) of the first stage holding the most parameters, pp stages of one
        chunk each: stage 0, the last one, and the first middle stage of each size are the only
        candidates (the remainder of the even split goes to the LAST stages)."""
        base, extra = divmod(num_layers, pp)
        cut = pp - extra  # stages from here on hold one more layer
        candidates = [0]
        if pp > 2:
            candidates.append(1)
        if extra >= 2 and cut > 1:  # then 1 < cut <= pp - 2: the first middle stage with one more layer
            candidates.append(cut)
        if pp > 1:
            candidates.append(pp - 1)
        best, most = 0, -1
        for s in candidates:
            n = self.stage(base + (s >= cut), s == 0, s == pp - 1)[0]
            if n > most:
                best, most = s, n
        return best, most

    def held(self, num_layers: int, pp: int) -> int:
        """Parameters held by all tp x pp ranks of one replica: every layer once per tp rank, the
        blocks on their stages (tied tensors counted once when both blocks share a stage)."""
        single, apart, layer = self._sums
        return (single if pp == 1 else apart) + num_layers * layer

    @cached_property
    def _sums(self) -> tuple[int, int, int]:
        """Over all tp ranks: both blocks on one stage, the blocks apart, one layer."""
        return (
            sum(c.count * c.single for c in self.classes),
            sum(c.count * (c.first + c.final) for c in self.classes),
            sum(c.count * c.layer for c in self.classes),
        )


_PRICINGS: dict[tuple, _Pricing] = {}

_EQUAL_RANKS = (Replicated, Split, Fused, HeadGroups, Experts, FlatExperts)
"""Placements that give every tp rank as many parameters as every other: whole tensors, equal
splits (`_split_range` refuses an uneven one) and head groups (kv heads x multiplier / tp kv
entries per rank, each serving as many q heads: `Layout.validate` refuses anything else). A tied
tensor is the same slice on every rank. A family made of these alone is priced at tp rank 0; any
other placement, at every rank (the tests price every rank of every fixture both ways)."""

MAX_WORK = 3_000_000
"""What one plan or suggestion may cost, in rough units of a microsecond (`_pricing_work`,
`LAYOUT_WORK`): seconds at most. A search beyond it is refused, to be narrowed."""

LAYOUT_WORK = 20
"""Work units of trying one layout once its (tp, kv-multiplier) is priced."""


def _equal_ranks(family: Family) -> bool:
    return all(type(rule) in _EQUAL_RANKS for rule in family.first + family.layer + family.final)


def _pricing_work(family: Family, dims: ModelDims, layout: Layout) -> int:
    """Work units of pricing `layout`'s blocks, estimated before doing it: per rank priced, one
    unit per q head and kv entry cut for each of q, k, v and o, a dozen per expert and a few
    dozen per tensor (measured on the families' placements; no layer count in it)."""
    ranks = 1 if _equal_ranks(family) else layout.tp
    heads = 2 * (dims.num_heads + dims.num_kv_heads * layout.kv_multiplier) // layout.tp
    tensors = len(family.first) + len(family.layer) + len(family.final)
    return ranks * (heads + 12 * dims.num_experts + 30 * tensors)


def _too_much(work: int, what: str, hint: str) -> None:
    """Refuse, with what to do instead, a plan or search estimated at more than MAX_WORK."""
    if work > MAX_WORK:
        raise ShardkitError(f"{what} would be {work / MAX_WORK:.1f}x the work plan allows: {hint}")


def _pricing(family: Family, dims: ModelDims, layout: Layout) -> _Pricing:
    """The blocks' prices for `layout`, cached: pp and vpp only decide which blocks a stage holds,
    and the layer count how many layers (the cache serves a model at any layer count)."""
    key = (family, dataclasses.replace(dims, num_layers=1), dataclasses.replace(layout, pp=1, vpp=1))
    if key not in _PRICINGS:
        if len(_PRICINGS) >= 256:
            _PRICINGS.clear()
        _PRICINGS[key] = _price_blocks(*key)
    return _PRICINGS[key]


def _price_blocks(family: Family, small: ModelDims, layout: Layout) -> _Pricing:
    """Each tp rank's blocks (`Family.block_pieces`: first block, one decoder layer, final block),
    cut from the shapes of `small`, a one-layer stand-in of the model: more layers only repeat
    the layer."""
    shapes, edges, per_layer = _stand_in(family, small)
    family.check_layout(layout, small)
    equal = _equal_ranks(family)
    rows: dict[tuple[int, int, int, int], list[int]] = {}
    for r in range(1 if equal else layout.tp):
        first = family.block_pieces("first", layout, small, r, shapes)
        final = family.block_pieces("final", layout, small, r, shapes)
        layer = rank_params(family.block_pieces("layer", layout, small, r, shapes))
        row = (rank_params(first), rank_params(final), rank_params(first + final), layer)
        rows.setdefault(row, [r, 0])[1] += layout.tp if equal else 1
    classes = tuple(_RankClass(rank, count, *row) for row, (rank, count) in rows.items())
    return _Pricing(classes, edges, per_layer)


@lru_cache(maxsize=16)
def _stand_in(family: Family, small: ModelDims) -> tuple[dict[str, tuple[int, ...]], int, int]:
    """The full shapes of a one-layer stand-in of the model, shared by every tp and kv-multiplier
    tried, and the full parameters of its blocks and of its layer."""
    shapes = family.full_shapes(small)
    edges = layer = 0
    for name, shape in shapes.items():
        if layer_of(name) is None:
            edges += math.prod(shape)
        else:
            layer += math.prod(shape)
    return shapes, edges, layer


class StageList(Sequence[StagePlan]):
    """The stages of one layout, each built when asked for: a layout of thousands of stages
    costs nothing until printed, and its peak is found among the few stages that can be the
    largest (stage 0, the last, the first middle stage of each size)."""

    def __init__(
        self,
        pricing: _Pricing,
        layout: Layout,
        num_layers: int,
        weight: int,
        optim: int,
        optim_dp: int,
        peak_stage: int | None = None,
    ) -> None:
        """`weight` and `optim`: bytes per parameter; `optim_dp`: ranks sharing the optimizer state;
        `peak_stage`: the peak's stage when the caller has found it already."""
        self._pricing, self._layout, self._num_layers = pricing, layout, num_layers
        self._weight, self._optim, self._dp = weight, optim, optim_dp
        self._peak_stage = peak_stage
        self._spans: list[tuple[int, int, int]] | None = None
        if layout.vpp > 1:  # a stage's chunks are not one run of layers: list them (one layout only)
            chunks = layout.chunk_layers(num_layers)
            mine = [[chunks[c] for c in layout.rank_chunks(s)] for s in range(layout.pp)]
            self._spans = [(c[0].start, c[-1].stop - 1, sum(len(r) for r in c)) for c in mine]

    def __len__(self) -> int:
        return self._layout.pp

    def __iter__(self) -> Iterator[StagePlan]:
        return (self._plan(s) for s in range(len(self)))

    @overload
    def __getitem__(self, index: int) -> StagePlan: ...

    @overload
    def __getitem__(self, index: slice) -> list[StagePlan]: ...

    def __getitem__(self, index: int | slice) -> StagePlan | list[StagePlan]:
        if isinstance(index, slice):
            return [self._plan(s) for s in range(len(self))[index]]
        if not -len(self) <= index < len(self):
            raise IndexError(f"stage {index} out of range")
        return self._plan(index % len(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"StageList({self._layout.describe()}, {self._num_layers} layers)"

    def _span(self, s: int) -> tuple[int, int, int]:
        """First layer, last layer and layer count of stage s (NxD's rule: the remainder of the
        even split goes to the LAST stages)."""
        if self._spans is not None:
            return self._spans[s]
        base, extra = divmod(self._num_layers, self._layout.pp)
        cut = self._layout.pp - extra  # stages from here on hold one more layer
        start = s * base + max(0, s - cut)
        count = base + (s >= cut)
        return start, start + count - 1, count

    def _params(self, s: int) -> tuple[int, int]:
        return self._pricing.stage(self._span(s)[2], s == 0, s == self._layout.pp - 1)

    def _plan(self, s: int) -> StagePlan:
        first, last, _ = self._span(s)
        params, rank = self._params(s)
        return StagePlan(
            stage=s,
            layers=(first, last),
            params=params,
            tp_rank=rank,
            param_bytes=params * self._weight,
            grad_bytes=params * self._weight,
            optimizer_bytes=math.ceil(params / self._dp) * self._optim,
        )

    @cached_property
    def peak(self) -> StagePlan:
        """The stage whose largest rank needs the most memory (the first on ties)."""
        # bytes grow with parameters: the first stage holding the most parameters is the peak
        if self._peak_stage is not None:
            return self._plan(self._peak_stage)
        if self._spans is None:
            return self._plan(self._pricing.peak(self._num_layers, self._layout.pp)[0])
        return self._plan(max(range(len(self)), key=lambda s: (self._params(s)[0], -s)))


def _report(
    family: Family,
    dims: ModelDims,
    layout: Layout,
    pricing: _Pricing,
    dtype: str,
    zero1: bool,
    dp: int,
    device_memory: int | None,
    reserve_bytes: int | None,
    peak_stage: int | None = None,
) -> PlanReport:
    """One layout's report from its blocks' prices: nothing here grows with the layer count."""
    return PlanReport(
        family=family.name,
        model_type=dims.model_type,
        parameters=pricing.parameters(dims.num_layers),
        held_parameters=pricing.held(dims.num_layers, layout.pp),
        layout=layout,
        dtype=dtype,
        zero1=zero1,
        dp=dp,
        stages=StageList(
            pricing,
            layout,
            dims.num_layers,
            weight_bytes_per_param(dtype),
            optimizer_bytes_per_param(dtype),
            dp if zero1 else 1,
            peak_stage if layout.vpp == 1 else None,
        ),
        device_memory=device_memory,
        reserve_bytes=reserve_bytes,
    )


def _memory(device_memory: str | int | None, reserve: str | float | int) -> tuple[int | None, int | None]:
    if device_memory is None:
        return None, None
    total = parse_size(device_memory, what="device memory", require_unit=True)
    if total <= 0:
        raise ShardkitError("device memory must be more than 0 bytes")
    return total, parse_reserve(reserve, total)


def _dp(dp: int) -> int:
    if not isinstance(dp, int) or dp < 1:
        raise ShardkitError(f"dp must be a positive whole number, got {dp!r}")
    return dp


def plan_memory(
    config: Mapping[str, Any] | str | Path,
    layout: Layout,
    *,
    dtype: str = "bf16",
    zero1: bool = False,
    dp: int = 1,
    device_memory: str | int | None = None,
    reserve: str | float | int = DEFAULT_RESERVE,
) -> PlanReport:
    """Per-rank training memory of `layout` for the model of `config` (a config.json dict, file or folder).

    Raises LayoutError (with the reason) when the layout cannot hold the model. `device_memory`
    (bytes or a size such as "16GiB") and `reserve` (fraction, "10%" or a size) decide `fits`.
    """
    _, family, dims = _model(config)
    dtype, dp = _dtype(dtype), _dp(dp)
    _check_layout(family, layout, dims)
    memory, reserve_bytes = _memory(device_memory, reserve)
    family.check_dims(dims)
    _too_much(_pricing_work(family, dims, layout) + LAYOUT_WORK, f"pricing tp {layout.tp}", "use a smaller tp")
    return _report(family, dims, layout, _pricing(family, dims, layout), dtype, zero1, dp, memory, reserve_bytes)


# ---- suggestions ------------------------------------------------------------------------------


@dataclass
class Suggestions:
    """What `suggest_layouts` found."""

    layouts: list[PlanReport]
    """Valid layouts that fit, smallest tp first, then smallest pp, then smallest kv-multiplier."""
    considered: int
    """Valid layouts whose memory was computed (fitting or not)."""
    impossible: list[dict[str, Any]] = field(default_factory=list)
    """tp values that divide the q heads but cannot hold the model, each with the reason."""
    closest: PlanReport | None = None
    """When nothing fits: the valid layout needing the least memory per rank."""

    def distinct(self) -> list[PlanReport]:
        """The layouts that add something, in order: a layout is left out when one with the same tp
        and kv-multiplier and fewer pipeline stages needs no more memory per rank (more stages,
        no saving: e.g. pp 4 of a 5-layer model holds as many layers per rank as pp 3)."""
        kept: list[PlanReport] = []
        best: dict[tuple[int, int], int] = {}
        for r in sorted(self.layouts, key=lambda r: (r.layout.tp, r.layout.kv_multiplier, r.layout.pp)):
            key = (r.layout.tp, r.layout.kv_multiplier)
            if key in best and best[key] <= r.peak_bytes:
                continue
            best[key] = min(best.get(key, r.peak_bytes), r.peak_bytes)
            kept.append(r)
        order = {id(r): i for i, r in enumerate(self.layouts)}
        return sorted(kept, key=lambda r: order[id(r)])

    def to_dict(self, layouts: Sequence[PlanReport] | None = None) -> dict[str, Any]:
        """As JSON data; `layouts` lists only those (e.g. the distinct ones: every layout of a
        model with thousands of layers, each with its stages, is a lot of JSON)."""
        return {
            "layouts": [r.to_dict() for r in (self.layouts if layouts is None else layouts)],
            "considered": self.considered,
            "impossible": self.impossible,
            "closest": self.closest.to_dict() if self.closest else None,
        }


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _multipliers(
    family: Family, dims: ModelDims, tp: int, pinned: int | None, every: bool
) -> tuple[list[int], str | None]:
    """The kv-multipliers that make tp valid (smallest only unless `every`), or the reason none does.
    A valid multiplier divides q heads / kv heads (each replica serves whole q heads): only those
    are tried."""
    candidates = [pinned] if pinned else _divisors(dims.num_heads // dims.num_kv_heads)
    valid, reason = [], None
    for m in candidates:
        try:
            family.validate(Layout(tp=tp, kv_multiplier=m), dims)
        except LayoutError as e:
            reason = reason or str(e)
            continue
        valid.append(m)
        if not every:
            break
    if not valid and not pinned:
        try:  # the reason as the user would meet it, with the default multiplier
            family.validate(Layout(tp=tp), dims)
        except LayoutError as e:
            reason = str(e)
    return valid, reason


_Group = tuple[int, int, Sequence[tuple[int, int]]]
"""(tp, kv-multiplier, the (pp, dp) pairs to try with them)."""


def _search(
    family: Family,
    dims: ModelDims,
    tps: Sequence[int],
    pps: Sequence[int],
    kv_multiplier: int | None,
    every: bool,
    world_size: int | None,
    dp: int | None,
) -> tuple[list[_Group], list[dict[str, Any]]]:
    """The layouts to try, grouped by (tp, kv-multiplier), and the tps that cannot hold the model
    (with the reason). Refuses, before pricing any, a search of more than MAX_WORK."""
    groups: list[_Group] = []
    impossible: list[dict[str, Any]] = []
    for t in tps:
        multipliers, reason = _multipliers(family, dims, t, kv_multiplier, every)
        if not multipliers:
            impossible.append({"tp": t, "reason": reason})
            continue
        if world_size is None:
            pairs: Sequence[tuple[int, int]] = [(p, dp or 1) for p in pps]
        else:
            pairs = [
                (p, world_size // (t * p))
                for p in pps
                if not world_size % (t * p) and (dp is None or t * p * dp == world_size)
            ]
        groups.extend((t, m, pairs) for m in multipliers)
    work = sum(
        _pricing_work(family, dims, Layout(tp=t, kv_multiplier=m)) + LAYOUT_WORK * len(pairs)
        for t, m, pairs in groups
        if pairs
    )
    _too_much(
        work,
        f"pricing {len(groups):,} tp and kv-multiplier pairs and trying "
        f"{sum(len(pairs) for _, _, pairs in groups):,} layouts (up to {len(pps):,} pp each)",
        "narrow the search with --tp, --kv-multiplier, --max-pp or --world-size",
    )
    return groups, impossible


def suggest_layouts(
    config: Mapping[str, Any] | str | Path,
    device_memory: str | int,
    *,
    dtype: str = "bf16",
    zero1: bool = False,
    dp: int | None = None,
    world_size: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    max_pp: int | None = None,
    kv_multiplier: int | None = None,
    all_kv_multipliers: bool = False,
    reserve: str | float | int = DEFAULT_RESERVE,
) -> Suggestions:
    """The valid layouts whose every rank fits `device_memory` (after `reserve`), smallest tp first.

    Candidates: tp among the divisors of the q-head count that pass the family's validate, each with
    its smallest valid kv-multiplier (all valid ones with `all_kv_multipliers`; only
    `kv_multiplier` when given); pp from 1 to the layer count (or `max_pp`; only `pp` when given).
    With `world_size`, only layouts with tp x pp x dp == world_size; dp is then derived per layout
    when not given (and ZeRO-1 shards over that dp). Each (tp, kv-multiplier)'s blocks are priced
    once and every pp is a sum of them; a search of more than MAX_WORK is refused, to be narrowed.
    """
    _, family, dims = _model(config)
    dtype = _dtype(dtype)
    if dp is not None:
        _dp(dp)
    memory, reserve_bytes = _memory(device_memory, reserve)
    if memory is None:
        raise ShardkitError("suggesting layouts needs the device memory (e.g. 16GiB)")
    if pp is not None and max_pp is not None and pp > max_pp:
        raise ShardkitError(f"pp {pp} is above max pp {max_pp}: give one of them")
    # a pinned part of the layout must be possible on its own: say why not
    if pp is not None:
        _check_layout(family, Layout(pp=pp), dims)
    if tp is not None:
        Layout(tp=tp)  # a positive whole number
        valid, reason = _multipliers(family, dims, tp, kv_multiplier, False)
        if not valid:
            raise LayoutError(reason)
    elif kv_multiplier is not None:
        Layout(kv_multiplier=kv_multiplier)
    tps = [tp] if tp is not None else _divisors(dims.num_heads)
    pps = [pp] if pp is not None else list(range(1, min(dims.num_layers, max_pp or dims.num_layers) + 1))
    family.check_dims(dims)
    groups, impossible = _search(family, dims, tps, pps, kv_multiplier, all_kv_multipliers, world_size, dp)

    weight, optim = weight_bytes_per_param(dtype), optimizer_bytes_per_param(dtype)
    usable = memory - (reserve_bytes or 0)
    fitting: list[PlanReport] = []
    closest: PlanReport | None = None
    least = 0  # the closest's bytes per rank
    considered = 0
    for t, m, pairs in groups:
        if not pairs:  # a world size rules out every pp of this tp: nothing to price
            continue
        pricing = _pricing(family, dims, Layout(tp=t, kv_multiplier=m))
        for p, layout_dp in pairs:
            considered += 1
            stage, params = pricing.peak(dims.num_layers, p)  # the report only for a layout kept
            need = 2 * weight * params + optim * (math.ceil(params / layout_dp) if zero1 else params)
            if need > usable and (fitting or (closest is not None and need >= least)):
                continue
            layout = Layout(tp=t, pp=p, kv_multiplier=m)
            report = _report(family, dims, layout, pricing, dtype, zero1, layout_dp, memory, reserve_bytes, stage)
            if need <= usable:
                fitting.append(report)
            else:
                closest, least = report, need
    fitting.sort(key=lambda r: (r.layout.tp, r.layout.pp, r.layout.kv_multiplier))
    return Suggestions(fitting, considered, impossible, None if fitting else closest)
