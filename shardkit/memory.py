"""Memory plans: what one rank of a parallel layout holds for training, computed without weights.

Everything comes from the layout algebra: a rank's parameter count is the sum of `Piece.numel()`
over `Family.rank_pieces(layout, dims, tp_rank, pp_rank, full_shapes)`. Replicated tensors (norms)
therefore count on every rank that holds them and kv heads count once per replica
(kv-multiplier): that is memory the devices really spend. The one exception: a piece made of
exactly the same slices as another piece of the same rank is the same parameter (an lm_head tied
to the embedding when both sit on one stage) and counts once; on different stages it is a copy
and counts on both.

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

`plan_memory` reports one layout (each pipeline stage: the largest of its tp ranks; ranks of a
stage can differ, e.g. the vocab-parallel embedding only lives on stage 0 and lm_head on the
last). `suggest_layouts` lists the valid (tp, pp, kv-multiplier) layouts that fit a device,
smallest tp first (the usual rule: the smallest tp that fits, as tp costs communication in every
layer), then smallest pp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import FormatError, LayoutError, ShardkitError
from .families import Family, family_for, layer_of
from .formats import load_config
from .formats.base import parse_dtype
from .layout import Layout, ModelDims
from .placements import Piece
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
    try:
        torch_dtype = parse_dtype(str(dtype).lower())
    except FormatError:
        torch_dtype = None
    name = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(torch_dtype))
    if name is None:
        raise ShardkitError(f"dtype {dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    return name


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
    stages: tuple[StagePlan, ...]
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


def _report(
    family: Family,
    dims: ModelDims,
    shapes: Mapping[str, tuple[int, ...]],
    layout: Layout,
    stage_rank_params: Sequence[Sequence[int]],
    dtype: str,
    zero1: bool,
    dp: int,
    device_memory: int | None,
    reserve_bytes: int | None,
) -> PlanReport:
    """Bytes from per-stage, per-tp-rank parameter counts."""
    weight, optim = weight_bytes_per_param(dtype), optimizer_bytes_per_param(dtype)
    stages = []
    for s, (layers, per_rank) in enumerate(zip(layout.stage_layers(dims.num_layers), stage_rank_params)):
        params = max(per_rank)
        optim_params = math.ceil(params / dp) if zero1 else params
        stages.append(
            StagePlan(
                stage=s,
                layers=(layers[0], layers[-1]),
                params=params,
                tp_rank=list(per_rank).index(params),
                param_bytes=params * weight,
                grad_bytes=params * weight,
                optimizer_bytes=optim_params * optim,
            )
        )
    return PlanReport(
        family=family.name,
        model_type=dims.model_type,
        parameters=sum(math.prod(s) for s in shapes.values()),
        held_parameters=sum(sum(r) for r in stage_rank_params),
        layout=layout,
        dtype=dtype,
        zero1=zero1,
        dp=dp,
        stages=tuple(stages),
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
    shapes = family.full_shapes(dims)
    stage_rank_params = [
        [rank_params(family.rank_pieces(layout, dims, r, s, shapes)) for r in range(layout.tp)]
        for s in range(layout.pp)
    ]
    return _report(family, dims, shapes, layout, stage_rank_params, dtype, zero1, dp, memory, reserve_bytes)


# ---- suggestions ------------------------------------------------------------------------------


@dataclass
class _RankTable:
    """Per tp rank of one (tp, kv-multiplier): parameters of each decoder layer, of the first
    stage's extra block (embedding), of the last stage's (final norm, lm_head) and of both on a
    single stage, all taken from rank_pieces once, so that every pp is a sum of these."""

    first: list[int]
    final: list[int]
    single: list[int]  # first + final blocks on one stage (pp 1): tied tensors counted once
    layer_prefix: list[list[int]]  # per rank, cumulative sums over layers (length num_layers + 1)

    @classmethod
    def build(cls, family: Family, dims: ModelDims, shapes, tp: int, kv_multiplier: int) -> _RankTable:
        key = (family, dims, tp, kv_multiplier)
        if key not in _TABLES:
            if len(_TABLES) >= 64:
                _TABLES.clear()
            _TABLES[key] = cls._build(family, dims, shapes, tp, kv_multiplier)
        return _TABLES[key]

    @classmethod
    def _build(cls, family: Family, dims: ModelDims, shapes, tp: int, kv_multiplier: int) -> _RankTable:
        L = dims.num_layers
        whole = Layout(tp=tp, pp=1, kv_multiplier=kv_multiplier)
        # one layer per stage: stage 0 is the first block + layer 0, the last stage layer L-1 + the final block
        per_layer = Layout(tp=tp, pp=L, kv_multiplier=kv_multiplier)

        def blocks(layout: Layout, r: int, s: int) -> int:
            return rank_params([p for p in family.rank_pieces(layout, dims, r, s, shapes) if layer_of(p.name) is None])

        first, final, single, prefixes = [], [], [], []
        for r in range(tp):
            layers, edge = [0] * L, []
            for piece in _unique(family.rank_pieces(whole, dims, r, 0, shapes)):
                i = layer_of(piece.name)
                if i is None:
                    edge.append(piece)
                else:
                    layers[i] += piece.numel()
            single.append(rank_params(edge))
            first.append(blocks(per_layer, r, 0) if L > 1 else 0)
            final.append(blocks(per_layer, r, L - 1) if L > 1 else 0)
            prefix = [0]
            for n in layers:
                prefix.append(prefix[-1] + n)
            prefixes.append(prefix)
        return cls(first, final, single, prefixes)

    def stage_rank_params(self, layout: Layout, num_layers: int) -> list[list[int]]:
        out = []
        for s, layers in enumerate(layout.stage_layers(num_layers)):
            row = []
            for r, prefix in enumerate(self.layer_prefix):
                n = sum(prefix[i + 1] - prefix[i] for i in layers)
                if layout.pp == 1:
                    n += self.single[r]
                else:
                    n += self.first[r] if s == 0 else self.final[r] if s == layout.pp - 1 else 0
                row.append(n)
            out.append(row)
        return out


_TABLES: dict[tuple, _RankTable] = {}


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "layouts": [r.to_dict() for r in self.layouts],
            "considered": self.considered,
            "impossible": self.impossible,
            "closest": self.closest.to_dict() if self.closest else None,
        }


def _multipliers(
    family: Family, dims: ModelDims, tp: int, pinned: int | None, every: bool
) -> tuple[list[int], str | None]:
    """The kv-multipliers that make tp valid (smallest only unless `every`), or the reason none does."""
    candidates = [pinned] if pinned else list(range(1, dims.num_heads // dims.num_kv_heads + 1))
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
    when not given (and ZeRO-1 shards over that dp).
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
    tps = [tp] if tp is not None else [t for t in range(1, dims.num_heads + 1) if dims.num_heads % t == 0]
    pps = [pp] if pp is not None else list(range(1, min(dims.num_layers, max_pp or dims.num_layers) + 1))
    shapes = family.full_shapes(dims)

    fitting: list[PlanReport] = []
    impossible: list[dict[str, Any]] = []
    closest: PlanReport | None = None
    considered = 0
    for t in tps:
        multipliers, reason = _multipliers(family, dims, t, kv_multiplier, all_kv_multipliers)
        if not multipliers:
            impossible.append({"tp": t, "reason": reason})
            continue
        for m in multipliers:
            table = None  # built on first use: a world size may rule out every pp of this tp
            for p in pps:
                if world_size is not None:
                    if world_size % (t * p) or (dp is not None and t * p * dp != world_size):
                        continue
                    layout_dp = world_size // (t * p)
                else:
                    layout_dp = dp or 1
                layout = Layout(tp=t, pp=p, kv_multiplier=m)
                table = table or _RankTable.build(family, dims, shapes, t, m)
                report = _report(
                    family,
                    dims,
                    shapes,
                    layout,
                    table.stage_rank_params(layout, dims.num_layers),
                    dtype,
                    zero1,
                    layout_dp,
                    memory,
                    reserve_bytes,
                )
                considered += 1
                if report.fits:
                    fitting.append(report)
                elif not fitting and (closest is None or report.peak_bytes < closest.peak_bytes):
                    closest = report
    fitting.sort(key=lambda r: (r.layout.tp, r.layout.pp, r.layout.kv_multiplier))
    return Suggestions(fitting, considered, impossible, None if fitting else closest)
