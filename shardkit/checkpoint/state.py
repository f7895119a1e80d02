"""What one rank saves: its model pieces and optimizer state, checked against the layout.

`model_state` is a rank's pieces, `{piece name -> tensor}` with exactly the names and shapes of
`family.rank_pieces(layout, dims, tp, pp, shapes, ep)` (NxD's names). The optimizer state is
keyed by the same piece names (`exp_avg`, `exp_avg_sq`, `step`, optional fp32 `master`) and is
written as NxD's ZeRO-1 optimizer file (zero1.build_optim): with `zero1` each dp rank gives its
own dp shard of every moment (`zero1.dp_shard`) and writes its own file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..families import Family
from ..formats import nxd
from ..layout import Layout, ModelDims
from ..placements import Piece
from .base import (
    CheckpointError,
    OptimizerState,
    Rank,
    StateMismatchError,
    optimizer_state_from_torch,
)
from .zero1 import MASTER, MOMENTS, dp_shard, optim_name, shard_rows


def model_file(rank: Rank, layout: Layout, fmt: str) -> str:
    """`model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt` (v3 names with ep_rank when ep > 1)."""
    return nxd.rank_file_name(rank.ep, rank.tp, rank.pp, layout, fmt)


def optim_file(rank: Rank, layout: Layout, fmt: str = "torch") -> str:
    """NxD's optimizer file of a rank: `optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt` (always .pt)."""
    return optim_name(rank.dp, rank.tp, rank.pp, rank.ep if layout.ep > 1 else None)


@dataclass
class RankState:
    """A rank's tensors in file order, ready for the writers."""

    rank: Rank
    model: list[tuple[str, torch.Tensor]]
    optim: dict[str, dict[str, Any]] | None = None  # piece -> {exp_avg, exp_avg_sq, step[, master]}
    expert: set[str] = field(default_factory=set)  # expert-parallel names (xser's .info.pt)
    groups: list[int] = field(default_factory=list)  # per model piece: its param group
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # hyper-parameters
    master: bool = False
    dp_size: int = 1  # ZeRO-1: the optimizer tensors are this rank's shards of dp_size
    write_model: bool = True  # dp rank 0 writes the model file

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = list(self.model) if self.write_model else []
        for name, entry in (self.optim or {}).items():
            out += [(f"{k}:{name}", v) for k, v in entry.items() if isinstance(v, torch.Tensor)]
        return out


def is_rank_mapping(model_state: Mapping) -> bool:
    """True when model_state maps ranks ((tp, pp), (ep, tp, pp) or Rank) to their pieces."""
    return bool(model_state) and all(isinstance(k, (tuple, Rank)) for k in model_state)


def normalize_optimizer(optimizer_state: Any, param_names: Sequence[str] | None) -> OptimizerState | None:
    """An OptimizerState from what a trainer has: an OptimizerState, `{piece -> {moment -> T,
    "step": s}}`, or a torch.optim state_dict / Optimizer together with `param_names`."""
    if optimizer_state is None:
        return None
    if isinstance(optimizer_state, OptimizerState):
        return optimizer_state
    if isinstance(optimizer_state, torch.optim.Optimizer):
        optimizer_state = optimizer_state.state_dict()
    if isinstance(optimizer_state, Mapping) and "state" in optimizer_state and "param_groups" in optimizer_state:
        if param_names is None:
            raise CheckpointError(
                "a torch.optim state_dict is keyed by number: pass param_names= (this rank's "
                "piece names in the optimizer's parameter order)"
            )
        return optimizer_state_from_torch(optimizer_state, param_names)
    if isinstance(optimizer_state, Mapping) and all(isinstance(v, Mapping) for v in optimizer_state.values()):
        return OptimizerState(dict(optimizer_state))
    raise CheckpointError(
        "optimizer_state must be {piece name -> {'exp_avg': tensor, ...}}, an OptimizerState, "
        "or a torch.optim state_dict with param_names="
    )


def rank_state(
    family: Family,
    dims: ModelDims,
    layout: Layout,
    rank: Rank,
    shapes: Mapping[str, tuple[int, ...]],
    model_state: Mapping[str, Any],
    optimizer: OptimizerState | None,
    dp_size: int = 1,
) -> RankState:
    """Check a rank's pieces (and optimizer state) against the layout; order them as NxD does."""
    pieces = family.rank_pieces(layout, dims, rank.tp, rank.pp, shapes, rank.ep)
    where = f"rank ({rank.describe()}) of {layout.describe()}"
    expected = {p.name: p for p in pieces}
    if not isinstance(model_state, Mapping):
        raise CheckpointError(f"model_state must be a dict {{piece name -> tensor}}, got {type(model_state).__name__}")
    missing = [p.name for p in pieces if p.name not in model_state]
    extra = [n for n in model_state if n not in expected and not family.is_ignored(str(n))]
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]!r}, which is not"
        raise StateMismatchError(
            f"model_state {what} a piece of {where} ({len(missing)} missing, {len(extra)} unexpected): save "
            "exactly this rank's pieces, named as family.rank_pieces(layout, ...) names them"
        )
    model = []
    for piece in pieces:
        tensor = _tensor(model_state[piece.name], piece.name)
        if tuple(tensor.shape) != piece.shape:
            raise StateMismatchError(
                f"model_state[{piece.name!r}] has shape {tuple(tensor.shape)}, but {where} "
                f"holds {piece.shape}: the layout or config does not match the model"
            )
        model.append((piece.name, tensor))
    state = RankState(
        rank, model, expert={p.name for p in pieces if p.expert}, dp_size=dp_size, write_model=rank.dp == 0
    )
    if optimizer is not None:
        _add_optimizer(state, optimizer, expected, where)
    return state


def _tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{name} is a {type(value).__name__}, not a tensor")
    return value.detach()


def _add_optimizer(state: RankState, opt: OptimizerState, expected: Mapping[str, Piece], where: str) -> None:
    """NxD's optimizer files hold Adam state for every parameter: exp_avg, exp_avg_sq, step and
    (for all parameters or none) the fp32 master weight; with dp_size > 1 each tensor is this dp
    rank's ZeRO-1 shard (dim 0 padded to a multiple of dp_size, piece rank.dp)."""
    unknown = [n for n in opt.state if n not in expected]
    if unknown:
        raise StateMismatchError(
            f"optimizer state has {unknown[0]!r}, which is not a piece of {where}: key the "
            "optimizer state by this rank's piece names"
        )
    D = state.dp_size
    model = dict(state.model)
    master = any(MASTER in (opt.state.get(n) or {}) for n in expected)
    out: dict[str, dict[str, Any]] = {}
    for name, piece in expected.items():
        entry = dict(opt.state.get(name) or {})
        shape = piece.shape
        want = shape if D == 1 else ((shard_rows(shape[0], D), *shape[1:]) if shape else (1,))
        extra = [k for k in entry if k not in (*MOMENTS, MASTER, "step")]
        if extra:
            raise StateMismatchError(
                f"optimizer state {extra[0]!r} of {name}: NxD's optimizer files hold Adam state "
                "only (exp_avg, exp_avg_sq, step, and the fp32 master)"
            )
        if not entry:  # no update yet: zero moments, step 0 (NxD saves every parameter)
            entry = {m: torch.zeros(want, dtype=torch.float32) for m in MOMENTS}
            entry["step"] = 0
        if master and MASTER not in entry:  # an fp32 parameter is its own master
            entry[MASTER] = model[name].float() if D == 1 else dp_shard(model[name].float(), D, state.rank.dp)
        for key in (*MOMENTS, *((MASTER,) if master else ())):
            value = entry.get(key)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                what = f"its parameter's shape {shape}" if D == 1 else f"dp rank {state.rank.dp}'s ZeRO-1 shard {want}"
                raise StateMismatchError(f"optimizer state {key!r} of {name} is {got}, not {what}")
            entry[key] = value.detach()
        step = entry.get("step", 0)
        step = step.item() if isinstance(step, torch.Tensor) else step
        if not isinstance(step, (int, float)):
            raise CheckpointError(f"optimizer step of {name} is {step!r}, not a number")
        entry["step"] = step
        out[name] = entry
    state.optim = out
    state.master = master
    state.groups = [int(opt.groups.get(n, 0)) for n, _ in state.model]
    hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]
    while len(hyper) <= max(state.groups, default=0):
        hyper.append({})
    check_plain(hyper, "optimizer param_groups")
    state.param_groups = hyper


# ---- plain data (scheduler, user content) ---------------------------------------------------------

_PLAIN = (str, int, float, bool, complex, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)


def check_plain(obj: Any, what: str, path: str = "") -> None:
    """Refuse objects that `torch.load(weights_only=True)` could not read back."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (dict, OrderedDict)):
        for k, v in obj.items():
            check_plain(k, what, f"{path}[{k!r}]")
            check_plain(v, what, f"{path}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, what, f"{path}[{i}]")
        return
    raise CheckpointError(
        f"{what}{path} is a {type(obj).__name__}: save plain data (dicts, lists, numbers, "
        "strings, tensors) so that it loads without running pickle code"
    )


def scheduler_state(scheduler: Any) -> Any:
    """A scheduler's state_dict (or the plain data given)."""
    if scheduler is None:
        return None
    if hasattr(scheduler, "state_dict") and callable(scheduler.state_dict):
        scheduler = scheduler.state_dict()
    check_plain(scheduler, "scheduler state")
    return scheduler
