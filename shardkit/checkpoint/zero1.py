"""NxD's ZeRO-1 optimizer files: read them as per-parameter state, write them for any layout.

What NxD's trainer writes per rank (docs/FORMATS.md, "What NxD's trainer writes"):
`optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt` = torch-xla `ZeroRedundancyOptimizer.state_dict()`:
`{"state": {}, "param_groups": [{hyper..., "params": [idx...]}], "base_state": {idx: {"step",
"exp_avg", "exp_avg_sq"}}, "shape_info": {idx: [tp-local shape]}[, "sharded_master_weights":
{idx: fp32}]}`. idx counts over the flattened param groups of the stage-local module, restarting
at 0 on every pp rank. Each tensor is the dp shard of the tp-local one: dim 0 padded with zeros
to ceil(n0 / D) * D rows, cut into D pieces, piece d on dp rank d.

`Zero1Tag` reads a tag's optim files: it checks them all (every dp shard present, shapes,
steps), recovers which parameter each idx is (from the model file's key order, the groups and
`shape_info`), and offers the merged (dp-unsharded, unpadded) tp-local tensors as a `Checkpoint`
whose pieces are `"<moment>::<piece name>"`, so the engine's `SourceReader` reshards moments
slice by slice exactly like their parameters. `build_optim` builds the objects NxD would
save for a rank of any layout (their tensors given, or `object_writer.Deferred`: read when written);
`saving` writes them byte for byte as torch.save (or xser) does. Only plain data is ever loaded (weights_only).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError, ShardkitError
from ..formats import Checkpoint, xser
from ..formats.torch_io import safe_load
from ..formats.torch_metadata import TensorReference
from ..io.safety.small import SmallFileError, read_json
from ..io.store import Store
from ..placements import Piece
from .object_writer import KEEP, Deferred, map_leaves
from .tree import MODEL_DIR, OPTIM_DIR

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "master"
"""The name under which `sharded_master_weights` appear in per-parameter optimizer state."""
SEP = "::"
"""Moments are addressed as `f"{moment}{SEP}{piece name}"` in the merged view (never on disk)."""

_OPTIM_RE = re.compile(r"^dp_rank_(\d+)_(?:ep_rank_(\d+)_)?tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


class ParamOrderError(FormatError):
    """Which parameter each ZeRO-1 index is cannot be recovered from the checkpoint."""


class OptimFileError(FormatError):
    """An optimizer file is missing, malformed or disagrees with the model files or the others."""


# ---- geometry -------------------------------------------------------------------------------------


def shard_rows(n0: int, dp: int) -> int:
    """Rows of each dp shard of a tensor with n0 rows (ceil)."""
    return -(-n0 // dp)


def dp_shard(tensor: torch.Tensor, dp: int, d: int) -> torch.Tensor:
    """dp rank d's ZeRO-1 shard of a tp-local tensor: dim 0 zero-padded to a multiple of dp, piece d
    (its own contiguous storage). 0-d tensors are treated as one row."""
    t = tensor.reshape(1) if tensor.dim() == 0 else tensor
    rows = shard_rows(t.shape[0], dp)
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    start = d * rows
    stop = min(t.shape[0], start + rows)
    if stop > start:
        out[: stop - start].copy_(t[start:stop])
    return out


def dp_unshard(shards: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The tp-local tensor of `shape` from its dp shards (padding removed)."""
    full = torch.cat(list(shards), dim=0) if len(shards) > 1 else shards[0]
    n0 = shape[0] if len(shape) else 1
    return full[:n0].reshape(tuple(shape)).contiguous()


def optim_name(dp: int, tp: int, pp: int, ep: int | None = None) -> str:
    """`optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt` (with `ep_rank_EE_` when ep is given)."""
    mid = f"ep_rank_{ep:02d}_" if ep is not None else ""
    return f"{OPTIM_DIR}/dp_rank_{dp:02d}_{mid}tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def default_groups(names: Sequence[str]) -> list[list[str]]:
    """NxD's Llama example: group 0 = names with neither "bias" nor "norm", group 1 = the rest
    (empty groups dropped from the end)."""
    decay = [n for n in names if "bias" not in n and "norm" not in n]
    rest = [n for n in names if n not in set(decay)]
    return [decay, rest] if rest else [decay]


# ---- files ----------------------------------------------------------------------------------------


def is_xser_tag(tag_dir: Path) -> bool:
    """NxD's rule: xser iff any `<tag>/*/` folder holds an entry ending in `.tensors`."""
    for sub in (Path(tag_dir) / MODEL_DIR, Path(tag_dir) / OPTIM_DIR):
        if sub.is_dir() and any(e.name.endswith(".tensors") for e in sub.iterdir()):
            return True
    return False


def load_object(path: Path, use_xser: bool, store: Store | None = None) -> Any:
    """A saved object with every tensor (memory-mapped); xser references resolved (read through
    `store`, default a local folder)."""
    obj = safe_load(Path(path), store=store)
    return _resolve(obj, Path(path), store) if use_xser else obj


def _resolve(obj: Any, path: Path, store: Store | None = None) -> Any:
    """xser.resolve that keeps shared objects shared."""

    def leaf(x: Any) -> Any:
        if not isinstance(x, TensorReference):
            return KEEP
        tid: Any = x.tid  # unpickled from the file, so anything: tensor_path refuses all but an int >= 0
        return safe_load(xser.tensor_path(path, tid), store=store)

    return map_leaves(obj, leaf)


# ---- building the objects NxD saves ---------------------------------------------------------------


def build_optim(
    names: Sequence[str],
    groups: Sequence[int],
    hyper: Sequence[dict[str, Any]],
    state: Mapping[str, Mapping[str, Any]],
    dp: int,
    d: int,
    master: bool,
    presharded: bool = False,
    shapes: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """dp rank d's ZeRO-1 optimizer object for a stage whose parameters are `names` (stage-local
    `named_parameters()` order), `groups[i]` the group of names[i]. `state[name]` holds the
    tp-local `exp_avg`, `exp_avg_sq`, `step` (and `master` when `master`); with `presharded`,
    already dp rank d's shards, and `shapes[i]` is names[i]'s tp-local shape."""

    def cut(t: Any) -> Any:
        if isinstance(t, Deferred):  # cut when it is written (`save_together`)
            rows = t.shape[0] if t.shape else 1
            shape = t.shape if presharded else (shard_rows(rows, dp), *t.shape[1:])
            return t.after(cut, tuple(shape), torch.float32)
        return t.float().clone() if presharded else dp_shard(t.float(), dp, d)

    order = [i for g in range(len(hyper)) for i, gi in enumerate(groups) if gi == g]
    param_groups = copy.deepcopy(list(hyper))  # shared objects (betas) stay shared, like NxD's
    for g in param_groups:
        g["params"] = []
    base_state: dict[int, Any] = {}
    shape_info: dict[int, list[int]] = {}
    masters: dict[int, torch.Tensor] = {}
    for idx, i in enumerate(order):
        name = names[i]
        param_groups[groups[i]]["params"].append(idx)
        entry = state[name]
        step = entry["step"]
        step_t = torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step), dtype=torch.float32)
        base_state[idx] = {"step": step_t, "exp_avg": cut(entry["exp_avg"]), "exp_avg_sq": cut(entry["exp_avg_sq"])}
        shape_info[idx] = list(shapes[i]) if shapes is not None else list(entry["exp_avg"].shape)
        if master:
            masters[idx] = cut(entry[MASTER])
    obj: dict[str, Any] = {
        "state": {},
        "param_groups": param_groups,
        "base_state": base_state,
        "shape_info": shape_info,
    }
    if master:
        obj["sharded_master_weights"] = masters
    return obj


def hyper_of(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups without their `params` (copied; shared objects stay shared)."""
    groups = copy.deepcopy(list(param_groups))
    for g in groups:
        g.pop("params", None)
    return groups


def model_has_data(ckpt: Checkpoint) -> bool:
    """False when the model files hold no tensor data (NxD's avoid_saving_lower_precision_weights):
    the master weights in the optimizer files are then the truth."""
    key = next(iter(ckpt.holdings))
    reader = ckpt.open(key)
    try:
        if not getattr(reader, "holds_data", True):  # xser saved without its tensor files
            return False
        names = set(reader.keys())
        for piece in ckpt.holdings[key]:
            if piece.name not in names:
                return False
            shape = tuple(reader.shape(piece.name))
            if shape != piece.shape and 0 in shape or (shape == (0,) and piece.shape != (0,)):
                return False
        return True
    finally:
        reader.close()


def stored_dtype(ckpt: Checkpoint) -> torch.dtype:
    """The model's dtype when its files hold no tensor data: the dtype the data-less tensors keep,
    else the manifest's, else the config's (bf16 when none says)."""
    key = next(iter(ckpt.holdings))
    reader = ckpt.open(key)
    try:
        names = set(reader.keys())
        for piece in ckpt.holdings[key]:
            if piece.name in names:
                return reader.dtype(piece.name)
    finally:
        reader.close()
    name = (ckpt.manifest or {}).get("dtype") or ckpt.config.get("torch_dtype") or ckpt.config.get("dtype")
    dtype = getattr(torch, str(name or "bfloat16").replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


# ---- reading a tag's optimizer files ----------------------------------------------------------------


@dataclass
class StageOrder:
    """The parameters of one (tp, pp) rank in ZeRO-1 index order, and their groups."""

    names: list[str]  # idx -> name
    groups: list[int]  # idx -> group
    shapes: list[tuple[int, ...]]


def read_param_order(path: str | Path) -> list[list[str]]:
    """A `--param-order` file: a JSON list of name lists, one per param group."""
    try:
        data = read_json(path, "--param-order file")
    except SmallFileError as e:
        raise ParamOrderError(str(e)) from None
    if not (isinstance(data, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in data)):
        raise ParamOrderError(f"--param-order {path} must be a JSON list of lists of parameter names (one per group)")
    return data


@dataclass
class Zero1Tag:
    """The ZeRO-1 optimizer files of one tag, checked against its model files."""

    tag_dir: Path
    model: Checkpoint
    param_order: list[list[str]] | None = None
    dp: int = 1
    use_xser: bool = False
    files: dict[tuple[int, int, int, int], Path] = field(default_factory=dict)  # (dp, ep, tp, pp) -> path
    orders: dict[tuple[int, int, int], StageOrder] = field(default_factory=dict)  # (ep, tp, pp) -> order
    step: float | None = None
    master: bool = False
    hyper: list[dict[str, Any]] = field(default_factory=list)
    _objects: dict[tuple[int, int, int, int], Any] = field(default_factory=dict)

    @classmethod
    def open(cls, tag_dir: Path, model: Checkpoint, param_order: list[list[str]] | None = None) -> Zero1Tag | None:
        """The tag's optimizer files, checked; None when it has no `optim/` folder."""
        folder = Path(tag_dir) / OPTIM_DIR
        if not folder.is_dir():
            return None
        tag = cls(Path(tag_dir), model, param_order, use_xser=is_xser_tag(tag_dir))
        tag._scan(folder)
        tag._check()
        return tag

    def _rel(self, path: Path) -> str:
        return f"{self.tag_dir.name}/{path.relative_to(self.tag_dir).as_posix()}"

    def _scan(self, folder: Path) -> None:
        for entry in sorted(folder.iterdir()):
            m = _OPTIM_RE.match(entry.name)
            if m:  # an expert-parallel rank's file holds its experts' state (`ep_rank_EE_`)
                ep = int(m.group(2)) if m.group(2) is not None else 0
                key = (int(m.group(1)), ep, int(m.group(3)), int(m.group(4)))
                if key in self.files:  # two files say they are the same shard: which is this run's?
                    raise OptimFileError(
                        f"{self._rel(self.files[key])} and {self._rel(entry)} are both the ZeRO-1 shard of dp {key[0]}, "
                        f"ep {ep}, tp {key[2]}, pp {key[3]}: move the one that is not this checkpoint's away"
                    )
                self.files[key] = entry
        if not self.files:
            raise OptimFileError(
                f"{self.tag_dir.name}/{OPTIM_DIR} holds no optimizer files "
                "(optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt): the checkpoint is damaged"
            )
        self.dp = max(k[0] for k in self.files) + 1
        layout = self.model.layout
        for ep, tp, pp in layout.ranks():
            for d in range(self.dp):
                if (d, ep, tp, pp) not in self.files:
                    name = optim_name(d, tp, pp, ep if layout.ep > 1 else None)
                    raise OptimFileError(
                        f"{self.tag_dir.name}/{name} is missing (dp {self.dp}: every "
                        f"(dp, tp, pp) rank has its ZeRO-1 shard): copy it back or load another tag"
                    )
        extra = [k for k in self.files if k[1] >= layout.ep or k[2] >= layout.tp or k[3] >= layout.pp]
        if extra:
            raise OptimFileError(
                f"{self._rel(self.files[extra[0]])} has no model file of its (tp, pp) rank "
                f"({layout.describe()}): the checkpoint is damaged"
            )

    def object(self, d: int, ep: int, tp: int, pp: int) -> dict[str, Any]:
        key = (d, ep, tp, pp)
        if key not in self._objects:
            path = self.files[key]
            obj = load_object(path, self.use_xser, self.model.store)
            if not (
                isinstance(obj, dict)
                and isinstance(obj.get("param_groups"), list)
                and isinstance(obj.get("base_state"), dict)
                and isinstance(obj.get("shape_info"), dict)
            ):
                raise OptimFileError(
                    f"{self._rel(path)} is not a ZeRO-1 optimizer state (param_groups, base_state, "
                    "shape_info): it was not written by NxD's ZeRO-1 optimizer"
                )
            self._objects[key] = obj
        return self._objects[key]

    def _check(self) -> None:
        layout = self.model.layout
        for ep, tp, pp in layout.ranks():
            order = self._order(ep, tp, pp)
            self.orders[(ep, tp, pp)] = order
            for d in range(self.dp):
                self._check_file(d, ep, tp, pp, order)
                self._objects.pop((d, ep, tp, pp), None)  # checked; reopened (mapped) when read

    def _model_keys(self, ep: int, tp: int, pp: int) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
        key = next(k for k, r in self.model.ranks.items() if r == (ep, tp, pp))
        reader = self.model.open(key)
        expected = {p.name: p.shape for p in self.model.holdings[key]}
        try:
            names = [n for n in reader.keys() if not self.model.family.is_ignored(n)]
            if not names:  # a model file without tensor data: the family's order and shapes
                return key, list(expected.items())
            shapes = [tuple(reader.shape(n)) for n in names]
            # tensors saved without data (avoid_saving_lower_precision_weights) keep their names
            return key, [
                (n, expected.get(n, s) if s != expected.get(n, s) and not _numel(s) else s)
                for n, s in zip(names, shapes)
            ]
        finally:
            reader.close()

    def _order(self, ep: int, tp: int, pp: int) -> StageOrder:
        path = self.files[(0, ep, tp, pp)]
        obj = self.object(0, ep, tp, pp)
        key, named = self._model_keys(ep, tp, pp)
        shapes = dict(named)
        sizes = [len(g.get("params", [])) for g in obj["param_groups"]]
        info = obj["shape_info"]
        n = sum(sizes)
        flat = [i for g in obj["param_groups"] for i in g.get("params", [])]
        if sorted(flat) != list(range(n)) or sorted(info) != list(range(n)):
            raise OptimFileError(
                f"{self._rel(path)}: its param_groups index {n} parameters but shape_info has "
                f"{len(info)}: the file is corrupt"
            )
        if not self.hyper:
            self.hyper = hyper_of(obj["param_groups"])
        model_names = [nm for nm, _ in named]
        candidates: list[tuple[str, list[list[str]]]] = []
        if self.param_order is not None:
            candidates.append(("--param-order", [[x for x in g if x in shapes] for g in self.param_order]))
        else:
            candidates.append(("NxD's decay groups", default_groups(model_names)))
            pos, split = 0, []
            for s in sizes:
                split.append(model_names[pos : pos + s])
                pos += s
            candidates.append(("model file order", split))
            # torch's and the trainer's convention: weight decay for matrices, none for 1-D tensors
            # (norm scales, biases); differs from NxD's name rule where a matrix's name holds "norm"
            # (DBRX's `norm_attn_norm.attn.Wqkv.weight`)
            matrices = [nm for nm in model_names if len(shapes[nm]) >= 2]
            vectors = [nm for nm in model_names if len(shapes[nm]) < 2]
            candidates.append(("1-D tensors without decay", [matrices, vectors] if vectors else [matrices]))
        first_problem = None
        for label, groups in candidates:
            problem = self._fit(groups, sizes, obj, shapes, n)
            if problem is None:
                names = [x for g in groups for x in g]
                grp = [gi for gi, g in enumerate(groups) for _ in g]
                # idx order follows the file's params lists (normally 0..n-1 in group order)
                by_idx = {i: (names[pos], grp[pos]) for pos, i in enumerate(flat)}
                return StageOrder(
                    [by_idx[i][0] for i in range(n)],
                    [by_idx[i][1] for i in range(n)],
                    [tuple(shapes[by_idx[i][0]]) for i in range(n)],
                )
            first_problem = first_problem or f"{label}: {problem}"
        if self.param_order is not None or n == len(model_names):
            hint = (
                ""
                if self.param_order is not None
                else "; if NxD grouped the parameters differently, pass --param-order FILE (a JSON list of names per group)"
            )
            raise OptimFileError(f"{self._rel(path)} does not match {key} ({first_problem}){hint}")
        raise ParamOrderError(
            f"{self._rel(path)}: cannot tell which parameter each of its {n} optimizer indices is ({first_problem}): "
            "pass --param-order FILE (a JSON list of parameter names per param group, in NxD's order)"
        )

    @staticmethod
    def _fit(
        groups: list[list[str]], sizes: list[int], obj: Mapping[str, Any], shapes: Mapping[str, tuple], n: int
    ) -> str | None:
        if [len(g) for g in groups] != sizes:
            return f"groups of {[len(g) for g in groups]} parameters, the file has {sizes}"
        flat = [i for g in obj["param_groups"] for i in g.get("params", [])]
        names = [x for g in groups for x in g]
        for pos, idx in enumerate(flat):
            want = list(shapes[names[pos]])
            have = [int(v) for v in obj["shape_info"][idx]]
            if have != want:
                return f"shape_info[{idx}] is {have} but {names[pos]} is {want} in the model file"
        return None

    def _check_file(self, d: int, ep: int, tp: int, pp: int, order: StageOrder) -> None:
        path = self.files[(d, ep, tp, pp)]
        where = self._rel(path)
        obj = self.object(d, ep, tp, pp)
        ref = self.object(0, ep, tp, pp) if d else obj
        if [g.get("params") for g in obj["param_groups"]] != [g.get("params") for g in ref["param_groups"]]:
            raise OptimFileError(f"{where}: its param_groups differ from dp rank 0's: the file is from another run")
        has_master = "sharded_master_weights" in obj
        if (d, ep, tp, pp) == (0, 0, 0, 0):
            self.master = has_master
        elif has_master != self.master:
            raise OptimFileError(
                f"{where}: {'has' if has_master else 'lacks'} sharded_master_weights, unlike "
                f"{self.tag_dir.name}/{optim_name(0, 0, 0)}: the files are from different runs"
            )
        for idx, (name, shape) in enumerate(zip(order.names, order.shapes)):
            if [int(v) for v in obj["shape_info"].get(idx, [])] != list(shape):
                raise OptimFileError(
                    f"{where}: shape_info[{idx}] ({name}) is {obj['shape_info'].get(idx)}, the "
                    f"model file holds {list(shape)}: the optimizer and model files disagree"
                )
            entry = obj["base_state"].get(idx)
            if not isinstance(entry, dict) or not all(isinstance(entry.get(m), torch.Tensor) for m in MOMENTS):
                raise OptimFileError(
                    f"{where}: base_state[{idx}] ({name}) lacks exp_avg/exp_avg_sq: only Adam-style "
                    "optimizer state is supported"
                )
            rows = shard_rows(shape[0] if shape else 1, self.dp)
            want = (rows, *shape[1:]) if shape else (rows,)
            tensors = [(m, entry[m]) for m in MOMENTS]
            if has_master:
                tensors.append(("sharded_master_weights", obj["sharded_master_weights"].get(idx)))
            for m, t in tensors:
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else t
                    raise OptimFileError(
                        f"{where}: {m} of {name} (idx {idx}) is {got}, a dp {self.dp} shard of {list(shape)} is "
                        f"{list(want)}: dp shards are missing or the files are from different runs"
                    )
            step = entry.get("step")
            step_v = float(step.item()) if isinstance(step, torch.Tensor) else step
            if not isinstance(step_v, (int, float)):
                raise OptimFileError(f"{where}: base_state[{idx}] ({name}) has no step")
            if self.step is None:
                self.step = float(step_v)
            elif float(step_v) != self.step:
                raise OptimFileError(
                    f"{where}: {name} (idx {idx}) has taken {step_v:g} optimizer steps, other "
                    f"parameters {self.step:g}: the files are from different steps of the run"
                )

    # -- the merged view
    def group_of(self) -> dict[str, int]:
        """Full (source) tensor name -> param group, from every rank's stage order."""
        out: dict[str, int] = {}
        for key, pieces in self.model.holdings.items():
            ep, tp, pp = self.model.ranks[key]
            order = self.orders[(ep, tp, pp)]
            gmap = dict(zip(order.names, order.groups))
            for p in pieces:
                for s in p.segments:
                    if p.name in gmap:
                        out.setdefault(s.source, gmap[p.name])
        return out

    def moments(self) -> list[str]:
        return [*MOMENTS, MASTER] if self.master else list(MOMENTS)

    def view(self, moments: Sequence[str] | None = None) -> Checkpoint:
        """The optimizer state as a Checkpoint of tp-local tensors `"<moment>::<piece>"` per (tp, pp)."""
        moments = list(moments or self.moments())
        holdings, files, ranks = {}, {}, {}
        for key, pieces in self.model.holdings.items():
            ep, tp, pp = self.model.ranks[key]
            vkey = f"{OPTIM_DIR}/{f'ep_rank_{ep:02d}_' if ep else ''}tp_rank_{tp:02d}_pp_rank_{pp:02d}"
            holdings[vkey] = [prefixed(p, m + SEP) for m in moments for p in pieces]
            files[vkey] = self.files[(0, ep, tp, pp)]
            ranks[vkey] = (ep, tp, pp)
        view = _MergedCheckpoint(
            self.tag_dir,
            "sharded",
            "torch",
            self.model.config,
            self.model.family,
            self.model.dims,
            self.model.layout,
            files,
            holdings,
            ranks,
            None,
            "v2",
            store=self.model.store,
        )
        view.zero1 = self
        return view

    def merged_reader(self, ep: int, tp: int, pp: int) -> MergedOptimFile:
        return MergedOptimFile(self, ep, tp, pp)


def prefixed(piece: Piece, prefix: str) -> Piece:
    """The same piece with its name and every segment's source prefixed (a moment of it)."""
    from dataclasses import replace

    slabs = tuple(tuple(replace(s, source=prefix + s.source) for s in slab) for slab in piece.slabs)
    return replace(piece, name=prefix + piece.name, slabs=slabs)


class _MergedCheckpoint(Checkpoint):
    zero1: Zero1Tag

    def open(self, key: str) -> MergedOptimFile:
        ep, tp, pp = self.ranks[key]
        return self.zero1.merged_reader(ep, tp, pp)


class MergedOptimFile:
    """An (ep, tp, pp) rank's optimizer state, dp-merged, as a TensorFile of `"<moment>::<name>"`."""

    def __init__(self, tag: Zero1Tag, ep: int, tp: int, pp: int):
        self.tag, self.ep, self.tp, self.pp = tag, ep, tp, pp
        self.order = tag.orders[(ep, tp, pp)]
        self.index = {n: i for i, n in enumerate(self.order.names)}
        self.path = tag.files[(0, ep, tp, pp)]
        self._objs: list[Any] | None = None

    def _objects(self) -> list[Any]:
        if self._objs is None:
            self._objs = [
                load_object(self.tag.files[(d, self.ep, self.tp, self.pp)], self.tag.use_xser, self.tag.model.store)
                for d in range(self.tag.dp)
            ]
        return self._objs

    def _split(self, name: str) -> tuple[str, int]:
        moment, _, piece = name.partition(SEP)
        if piece not in self.index or moment not in self.tag.moments():
            raise KeyError(name)
        return moment, self.index[piece]

    def keys(self) -> list[str]:
        return [m + SEP + n for m in self.tag.moments() for n in self.order.names]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.order.shapes[self._split(name)[1]])

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def full(self, name: str) -> torch.Tensor:
        moment, idx = self._split(name)
        if moment == MASTER:
            shards = [o["sharded_master_weights"][idx] for o in self._objects()]
        else:
            shards = [o["base_state"][idx][moment] for o in self._objects()]
        return dp_unshard(shards, self.order.shapes[idx])

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        t = self.full(name)
        if start is None:
            return t
        return t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start).contiguous()

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        self._objs = None


class _MasterWeightsCheckpoint(Checkpoint):
    """A tag's model read from its fp32 master weights (model files without tensor data)."""

    zero1: Zero1Tag
    weights_dtype: torch.dtype

    def open(self, key: str) -> _MasterWeightsFile:
        ep, tp, pp = self.ranks[key]
        return _MasterWeightsFile(self.zero1.merged_reader(ep, tp, pp), self.weights_dtype)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.zero1.files.values())


class _MasterWeightsFile:
    """A (tp, pp) rank's weights under their own names, from `master::<name>`, in the model dtype."""

    def __init__(self, merged: MergedOptimFile, dtype: torch.dtype):
        self.merged, self.dtype_, self.path = merged, dtype, merged.path

    def keys(self) -> list[str]:
        return list(self.merged.order.names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.merged.shape(MASTER + SEP + name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_

    def full(self, name: str) -> torch.Tensor:
        return self.merged.full(MASTER + SEP + name).to(self.dtype_)

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return self.merged.read(MASTER + SEP + name, dim, start, stop).to(self.dtype_)

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        self.merged.close()


def master_weights_view(model: Checkpoint, zero: Zero1Tag) -> Checkpoint:
    """The tag's model as a Checkpoint whose tensors are the optimizer files' fp32 master weights
    (cast to the model's dtype), under the model's own names and layout: what a merge or export
    reads when the model files hold no tensor data."""
    if not zero.master:
        raise OptimFileError(
            f"{model.root}: the model files hold no tensor data and the optimizer files no master "
            "weights (sharded_master_weights): the checkpoint holds no weights"
        )
    files = {key: zero.files[(0, ep, tp, pp)] for key, (ep, tp, pp) in model.ranks.items()}
    view = _MasterWeightsCheckpoint(
        model.root,
        "sharded",
        "torch",
        model.config,
        model.family,
        model.dims,
        model.layout,
        files,
        model.holdings,
        model.ranks,
        model.manifest,
        model.naming,
        store=model.store,
    )
    view.zero1 = zero
    view.weights_dtype = stored_dtype(model)
    return view


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


def check_param_order_names(order: list[list[str]] | None) -> None:
    if order is not None and len({n for g in order for n in g}) != sum(len(g) for g in order):
        raise ShardkitError("--param-order names a parameter twice")
