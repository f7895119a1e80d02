"""The protocol of a training checkpoint, and the small values every part of it shares.

A training checkpoint is one *tag* directory in NxD's tree (docs/FORMATS.md, "Training
checkpoint tree"):

```
<dir>/<tag>/checkpoint                                  "1": written FIRST (rank 0)
<dir>/<tag>/model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt   this rank's model pieces (NxD names)
<dir>/<tag>/optim/dp_rank_DD_tp_rank_XX_pp_rank_YY.pt   NxD's ZeRO-1 optimizer state (zero1.py),
                                                        one per dp rank with zero1
<dir>/<tag>/scheduler.pt, user_content.pt               plain data (loads with weights_only=True)
<dir>/<tag>/config.json, shardkit.json                  the model config; the manifest (layout,
                                                        format, family, step, files + sha256)
<dir>/<tag>/done                                        "1": written LAST, after every rank's
                                                        files are durable (fsync)
```

The protocol, which every part of this package keeps:
1. A tag is *complete* iff its `done` marker exists; only complete tags are ever loaded, and only
   when they are *loadable* (`tree.tag_problem`, the one rule): the files of the layout their
   manifest names, with its sizes (without one, NxD's: the rank files their names imply).
2. `done` is written only after every file of every rank and the manifest are fsynced, and the
   directory entries too.
3. Deleting a tag removes `done` first (made durable), then the files, then `checkpoint`, then the
   folder: an interrupted deletion leaves an *incomplete* tag, never a complete-looking one.
4. Incomplete tags older than the newest loadable tag are leftovers (of an interrupted deletion,
   or of a save that crashed before the job resumed from an older tag) and retention removes
   them; the newest loadable tag is never removed.
5. Tags are ordered by step (from the manifest, else from the tag name: `step_120`,
   `epoch=1-step=120`, `120`), then by the mtime of their `checkpoint` marker; when some tag has
   no step, by that mtime alone (NxD's rule).
6. One writer per checkpoint directory: a save (until its retention is over, also in the
   background) and a prune hold an flock on `<dir>/.shardkit.lock`, which names the holder (pid,
   host, command). Only rank 0 of a job takes it; the kernel releases it when the holder dies.
7. Nothing is deleted through a symlink: a tag that is a link is removed (or replaced by a save)
   by unlinking the link; links inside a tag are unlinked, never followed.
8. A complete tag whose manifest is unreadable or malformed is *damaged*, one without its files
   *cannot be loaded*: listed as such, never "the latest", neither counted nor removed by
   retention. Resuming from the latest checkpoint skips them and tags that fail their checks,
   with a warning (load.py).
9. Tag names are plain folder names (`tree.tag_name_problem`, one rule for save, load, list, prune
   and --tag: no separators, `..`, control characters, leading '.' or '-'); the file names a
   manifest lists are confined to their folders (`shardkit.paths.inside`): UnsafeTagError /
   UnsafePathError.

Ranks. A process's place in the job is a `Rank` (tp, pp, ep, dp). Without an explicit rank it
comes from torch.distributed's global rank, in NxD/Megatron order, tensor parallel fastest:
`global = ((dp * ep_size + ep) * pp_size + pp) * tp_size + tp` (so with ep = 1,
`global = dp * tp_size * pp_size + pp * tp_size + tp`). Data-parallel replicas (dp > 0) hold the
same pieces as dp 0: the model is saved once, by dp rank 0; the optimizer state by dp rank 0, or
with `zero1=True` by every dp rank, its own shard (`optim/dp_rank_DD_...`, NxD's ZeRO-1 layout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigMismatchError, FormatError, LayoutError, ShardkitError
from ..formats.registry import format_names
from ..layout import Layout
from ..paths import UnsafePathError

FORMATS = tuple(format_names())

# ---- errors --------------------------------------------------------------------------------------


class CheckpointError(ShardkitError):
    """A training checkpoint could not be saved, found or loaded."""


class NoCheckpointError(CheckpointError):
    """The directory holds no complete checkpoint (or not the tag asked for)."""


class IncompleteCheckpointError(CheckpointError, FormatError):
    """The tag has no `done` marker: an interrupted save or deletion."""


class UnsafeTagError(CheckpointError, UnsafePathError):
    """A tag name would lead outside its checkpoint directory (absolute, `..`, separators)."""


class CheckpointLockedError(CheckpointError):
    """Another process (or Checkpointer) is saving to or pruning the same checkpoint directory."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (for async saves: raised at the next save, wait or close)."""


class StateMismatchError(CheckpointError, ConfigMismatchError):
    """The state given to save does not match the layout and config (names or shapes)."""


# ---- configuration -------------------------------------------------------------------------------


@dataclass
class CheckpointerConfig:
    """How a `Checkpointer` saves. Every `save` call may override these per call."""

    format: str = "torch"
    """Rank-file format: torch (NxD's .pt), xser (torch-xla's, one file per tensor) or safetensors."""
    async_save: bool = False
    """Copy the state to host memory, then write it in a background thread while training goes on."""
    num_kept: int | None = None
    """Keep the newest N complete checkpoints (None: keep all); applied after each `done` marker."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (None: no such exception)."""
    fsync: bool = True
    """fsync every file and folder before `done` (turn off only for throwaway checkpoints)."""
    reuse_buffers: bool = True
    """Keep the host copies of an async save for the next one (no page faults when copying again)."""

    def __post_init__(self) -> None:
        check_format(self.format)
        check_retention(self.num_kept, self.keep_every)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise CheckpointError(f"checkpoint format {fmt!r} is unknown: use one of {', '.join(FORMATS)}")
    return fmt


def check_retention(num_kept: int | None, keep_every: int | None) -> None:
    if num_kept is not None and num_kept != -1 and (not isinstance(num_kept, int) or num_kept < 1):
        raise CheckpointError(f"num_kept must be a whole number >= 1 (or None to keep all), got {num_kept!r}")
    if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
        raise CheckpointError(f"keep_every must be a whole number >= 1, got {keep_every!r}")


# ---- ranks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rank:
    """A process's place in a parallel layout: its tensor, pipeline and expert coordinates, and
    which data-parallel replica it is (dp > 0 replicas write no model files)."""

    tp: int = 0
    pp: int = 0
    ep: int = 0
    dp: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        """(ep, tp, pp): the rank file's coordinates."""
        return self.ep, self.tp, self.pp

    def describe(self) -> str:
        parts = [f"tp {self.tp}", f"pp {self.pp}"]
        if self.ep:
            parts.insert(0, f"ep {self.ep}")
        if self.dp:
            parts.append(f"dp {self.dp}")
        return ", ".join(parts)

    def validate(self, layout: Layout) -> Rank:
        for name, size in (("tp", layout.tp), ("pp", layout.pp), ("ep", layout.ep)):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < size:
                raise LayoutError(
                    f"{name} rank {value!r} is outside the layout ({layout.describe()}): use 0..{size - 1}"
                )
        if self.dp < 0:
            raise LayoutError(f"dp rank must be >= 0, got {self.dp}")
        return self

    @classmethod
    def from_global(cls, global_rank: int, layout: Layout) -> Rank:
        """NxD/Megatron order: tp fastest, then pp, then ep, dp outermost."""
        tp = global_rank % layout.tp
        rest = global_rank // layout.tp
        pp = rest % layout.pp
        rest //= layout.pp
        return cls(tp=tp, pp=pp, ep=rest % layout.ep, dp=rest // layout.ep)

    def to_global(self, layout: Layout) -> int:
        return ((self.dp * layout.ep + self.ep) * layout.pp + self.pp) * layout.tp + self.tp

    @classmethod
    def of(cls, value: Any, layout: Layout) -> Rank:
        """A Rank from a Rank, (tp, pp), (ep, tp, pp) or None (this process's torch.distributed rank;
        rank 0 of a one-process run). dp is derived from the global rank when not given."""
        if isinstance(value, Rank):
            return value.validate(layout)
        dist_rank = distributed_rank()
        if value is None:
            if dist_rank is None:
                return cls().validate(layout)
            return cls.from_global(dist_rank[0], layout).validate(layout)
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (2, 3):
            ep, tp, pp = (0, *value) if len(value) == 2 else tuple(value)
            dp = dist_rank[0] // (layout.tp * layout.pp * layout.ep) if dist_rank else 0
            return cls(tp=int(tp), pp=int(pp), ep=int(ep), dp=dp).validate(layout)
        raise LayoutError(f"rank {value!r} is not understood: give (tp, pp), (ep, tp, pp) or a Rank")


def distributed_rank() -> tuple[int, int] | None:
    """(global rank, world size) when torch.distributed is initialised with more than one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


# ---- optimizer state -----------------------------------------------------------------------------

MOMENT_SEP = "::"
"""Optimizer files hold `f"{moment}{MOMENT_SEP}{piece name}"` -> tensor."""


@dataclass
class OptimizerState:
    """An optimizer's state keyed by piece (parameter) name.

    `state[piece]` maps each moment (`exp_avg`, `exp_avg_sq`, ... : tensors with the parameter's
    shape) to a tensor, plus `step` (a number or 0-dim tensor). `param_groups` are the groups'
    hyperparameters (lr, betas, eps, weight_decay, ...) without their `params`; `groups[piece]` is
    the index of the group a piece belongs to (0 when absent)."""

    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, int] = field(default_factory=dict)

    def to_torch(
        self, param_names: Sequence[str], param_groups: Sequence[Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """A `torch.optim` state_dict for parameters named `param_names` (the trainer's order), ready
        for `optimizer.load_state_dict`. Hyperparameters come from the checkpoint, or from
        `param_groups` (e.g. `optimizer.state_dict()["param_groups"]`) when given."""
        index = {n: i for i, n in enumerate(param_names)}
        unknown = [n for n in self.state if n not in index]
        if unknown:
            raise StateMismatchError(
                f"the loaded optimizer state has {unknown[0]}, which param_names lacks: "
                "pass every parameter name of this rank, in the optimizer's order"
            )
        hyper = [dict(g) for g in (param_groups if param_groups is not None else self.param_groups)]
        if not hyper:
            raise CheckpointError(
                "the checkpoint has no optimizer param_groups: pass param_groups= "
                "(e.g. optimizer.state_dict()['param_groups'])"
            )
        for g in hyper:
            g["params"] = []
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
        for name in param_names:
            group = self.groups.get(name, 0)
            if group >= len(hyper):
                raise CheckpointError(
                    f"{name} belongs to optimizer group {group}, but only {len(hyper)} groups are given"
                )
            hyper[group]["params"].append(index[name])
        state = {}
        for name in param_names:
            if name in self.state:
                entry = dict(self.state[name])
                if "step" in entry and not isinstance(entry["step"], torch.Tensor):
                    entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
                state[index[name]] = entry
        return {"state": state, "param_groups": hyper}


def optimizer_state_from_torch(state_dict: Mapping[str, Any], param_names: Sequence[str]) -> OptimizerState:
    """Key a `torch.optim` (Adam, AdamW, SGD, ...) state_dict by parameter name.

    `param_names[i]` is the piece name of the optimizer's i-th parameter (the order of
    `optimizer.param_groups[*]["params"]`, which `state_dict()` numbers 0, 1, ...)."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError("expected a torch.optim state_dict with 'state' and 'param_groups'")
    count = sum(len(g["params"]) for g in state_dict["param_groups"])
    if count != len(param_names):
        raise StateMismatchError(
            f"the optimizer has {count} parameters but {len(param_names)} param_names were "
            "given: pass one name per parameter, in the optimizer's order"
        )
    groups: dict[str, int] = {}
    hyper = []
    for g_index, group in enumerate(state_dict["param_groups"]):
        hyper.append({k: v for k, v in group.items() if k not in ("params", "param_names")})
        for p in group["params"]:
            groups[param_names[p]] = g_index
    state = {param_names[int(i)]: dict(entry) for i, entry in state_dict["state"].items()}
    return OptimizerState(state, hyper, groups)


def jsonable(value: Any) -> Any:
    """Hyperparameters as JSON (tensors become numbers or lists, tuples lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    raise CheckpointError(
        f"optimizer hyperparameter {value!r} ({type(value).__name__}) cannot be saved: "
        "use numbers, strings, booleans, lists or tensors"
    )


# ---- results -------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    """What `load_checkpoint` returns for one rank of the target layout."""

    tag: str
    path: Any  # Path of the tag directory
    step: int | None
    layout: Layout  # the layout the checkpoint was saved in
    target_layout: Layout
    rank: Rank
    config: dict[str, Any]
    model: dict[str, torch.Tensor]  # piece name -> tensor, in the target rank file's order
    optimizer: OptimizerState | None = None
    scheduler: Any = None
    user_content: Any = None
    format: str = "torch"
