"""What one rank saves: its model pieces and optimizer moments, checked against the layout.

`model_state` is a rank's pieces, `{piece name -> tensor}` with exactly the names and shapes of
`family.rank_pieces(layout, dims, tp, pp, shapes, ep)` (NxD's names). The optimizer state is
keyed by the same piece names; each moment has its parameter's shape, so on disk it is one more
"model" whose names carry a `<moment>::` prefix, resharded with its parameter's pieces.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..families import Family
from ..formats import nxd
from ..layout import Layout, ModelDims
from ..placements import Piece
from .base import (
    MOMENT_SEP,
    CheckpointError,
    OptimizerState,
    Rank,
    StateMismatchError,
    jsonable,
    optimizer_state_from_torch,
)
from .tree import MODEL_DIR, OPTIM_DIR


def model_file(rank: Rank, layout: Layout, fmt: str) -> str:
    """`model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt` (v3 names with ep_rank when ep > 1)."""
    return nxd.rank_file_name(rank.ep, rank.tp, rank.pp, layout, fmt)


def optim_file(rank: Rank, layout: Layout, fmt: str) -> str:
    """The optimizer file of a rank: the model file's name under `optim/` (dp rank 00: no ZeRO-1)."""
    return OPTIM_DIR + model_file(rank, layout, fmt)[len(MODEL_DIR):]


def moment_name(moment: str, piece: str) -> str:
    return f"{moment}{MOMENT_SEP}{piece}"


@dataclass
class RankState:
    """A rank's tensors in file order, ready for the writers."""

    rank: Rank
    model: list[tuple[str, torch.Tensor]]
    optim: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    expert: set[str] = field(default_factory=set)  # expert-parallel names (xser's .info.pt)
    moments: list[str] = field(default_factory=list)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # full tensor -> {"step", "group"}
    param_groups: list[dict[str, Any]] = field(default_factory=list)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.model + self.optim

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())


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
            raise CheckpointError("a torch.optim state_dict is keyed by number: pass param_names= (this rank's "
                                  "piece names in the optimizer's parameter order)")
        return optimizer_state_from_torch(optimizer_state, param_names)
    if isinstance(optimizer_state, Mapping) and all(isinstance(v, Mapping) for v in optimizer_state.values()):
        return OptimizerState(dict(optimizer_state))
    raise CheckpointError("optimizer_state must be {piece name -> {'exp_avg': tensor, ...}}, an OptimizerState, "
                          "or a torch.optim state_dict with param_names=")


def rank_state(
    family: Family, dims: ModelDims, layout: Layout, rank: Rank, shapes: Mapping[str, tuple[int, ...]],
    model_state: Mapping[str, Any], optimizer: OptimizerState | None,
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
            "exactly this rank's pieces, named as family.rank_pieces(layout, ...) names them")
    model = []
    for piece in pieces:
        tensor = _tensor(model_state[piece.name], piece.name)
        if tuple(tensor.shape) != piece.shape:
            raise StateMismatchError(f"model_state[{piece.name!r}] has shape {tuple(tensor.shape)}, but {where} "
                                     f"holds {piece.shape}: the layout or config does not match the model")
        model.append((piece.name, tensor))
    state = RankState(rank, model, expert={p.name for p in pieces if p.expert})
    if optimizer is not None:
        _add_optimizer(state, optimizer, expected, where)
    return state


def _tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{name} is a {type(value).__name__}, not a tensor")
    return value.detach()


def _add_optimizer(state: RankState, opt: OptimizerState, expected: Mapping[str, Piece], where: str) -> None:
    unknown = [n for n in opt.state if n not in expected]
    if unknown:
        raise StateMismatchError(f"optimizer state has {unknown[0]!r}, which is not a piece of {where}: key the "
                                 "optimizer state by this rank's piece names")
    moments: list[str] | None = None
    for name, piece in expected.items():
        entry = opt.state.get(name)
        if not entry:
            continue
        these, step = [], None
        for key, value in entry.items():
            if key == "step":
                step = value.item() if isinstance(value, torch.Tensor) else value
                if not isinstance(step, (int, float)):
                    raise CheckpointError(f"optimizer step of {name} is {step!r}, not a number")
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != piece.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise StateMismatchError(
                    f"optimizer state {key!r} of {name} is {shape}, not a tensor of its parameter's shape "
                    f"{piece.shape}: only moments shaped like their parameter (and 'step') can be resharded")
            if MOMENT_SEP in key:
                raise CheckpointError(f"optimizer state key {key!r} must not contain {MOMENT_SEP!r}")
            these.append(key)
        if moments is None:
            moments = these
        elif set(these) != set(moments):
            raise StateMismatchError(f"optimizer state of {name} has moments {sorted(these)} but other pieces have "
                                     f"{sorted(moments)}: every parameter with state needs the same moments")
        for moment in moments:
            state.optim.append((moment_name(moment, name), entry[moment].detach()))
        for seg in piece.segments:
            state.params[seg.source] = {"step": step, "group": int(opt.groups.get(name, 0))}
        if piece.expert:
            state.expert.update(moment_name(m, name) for m in moments)
    state.moments = moments or []
    state.param_groups = [jsonable({k: v for k, v in g.items() if k not in ("params", "param_names")})
                          for g in opt.param_groups]


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
    raise CheckpointError(f"{what}{path} is a {type(obj).__name__}: save plain data (dicts, lists, numbers, "
                          "strings, tensors) so that it loads without running pickle code")


def scheduler_state(scheduler: Any) -> Any:
    """A scheduler's state_dict (or the plain data given)."""
    if scheduler is None:
        return None
    if hasattr(scheduler, "state_dict") and callable(scheduler.state_dict):
        scheduler = scheduler.state_dict()
    check_plain(scheduler, "scheduler state")
    return scheduler
