"""NxD's other two ways of saving a training checkpoint, read and written by meaning.

`save_checkpoint(..., avoid_saving_lower_precision_weights=True)` ("avoid-lp"): with xser and
ZeRO-1 master weights, the model's reference and `.info.pt` files are written (every tensor's
dtype and shape) but not its tensor files (at pp > 1 an empty `.tensors` folder is left per model
file); the weights are the optimizer's fp32 master weights (`sharded_master_weights`), cast to the
model's dtype. NxD's `load_checkpoint` then zero-fills the model and takes the masters. The mode
is told by the tensor files being absent and the master weights present (`mode_of`).

`save_checkpoint(..., use_zero1_dcp=True)` ("zero1-dcp", NxD 2.29 `optimizer/zero_dcp_utils.py`):
the ZeRO-1 optimizer state goes through PyTorch DCP into `<tag>/optim/` (`.metadata`,
`__<global rank>_0.distcp`) instead of per-rank files. NxD keys `base_state` by parameter name,
flattens the state dict and suffixes each moment's key with the rank's pipeline and tensor ranks
(`|pp-PPPP` when pp > 1, `|tp-TTTT` when tp > 1): `base_state.<name>.exp_avg|pp-0000|tp-0001` is
a global tensor of the tp-local shape whose DCP chunks are the dp shards (dim 0, the last one
without its padding); `base_state.<name>.step` is a scalar saved once; `param_groups.<g>.<key>`
and `shape_info.<idx>` are plain values (DCP keeps one copy of each key, whichever rank held it).
NxD's code only saves this with one param group (it numbers parameters per group) and without
master weights (it looks `sharded_master_weights` up by name), and only consistently at pp 1
(each rank plans every rank's entries from its own parameters); shardkit writes every stage's
own entries, which NxD's loader reads. See docs/FORMATS.md, "NxD's other save modes".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError
from ..formats import Checkpoint, open_checkpoint
from ..formats.dcp import DcpTensors
from ..formats.dcp_files import (
    METADATA,
    ChunkedRecord,
    DcpFileWriter,
    DcpFolder,
    data_file,
    finish_folder,
    read_folder,
    read_tensor,
)
from ..formats.source import decide_replication
from ..io.data.digest import FileRecord
from ..io.safety.sinks import NO_SINK, Sink
from ..io.store import Store
from ..layout import Layout
from ..placements import Piece
from .base import CheckpointError
from .tree import OPTIM_DIR
from .zero1 import (
    MOMENTS,
    SEP,
    OptimFileError,
    StageOrder,
    Zero1Tag,
    default_groups,
    master_weights_view,
    model_has_data,
    shard_rows,
)

DEFAULT, AVOID_LP, ZERO1_DCP = "default", "avoid-lp", "zero1-dcp"
MODES = (DEFAULT, AVOID_LP, ZERO1_DCP)
"""NxD's ways of saving a training checkpoint (`ckpt reshard --nxd-mode`)."""


def mode_of(tag_dir: Path, has_data: bool, zero: Zero1Tag | None = None) -> str:
    """How NxD saved a tag: its optimizer through DCP, its model without tensor data (avoid-lp: the
    tensor files absent, whether or not their `.tensors` folders are, and the master weights in
    the ZeRO-1 optimizer files: `check_masters`), or neither."""
    if (Path(tag_dir) / OPTIM_DIR / METADATA).is_file():
        return ZERO1_DCP
    if has_data:
        return DEFAULT
    check_masters(tag_dir, zero)
    return AVOID_LP


def check_masters(tag_dir: Path, zero: Zero1Tag | None) -> Zero1Tag:
    """The optimizer state of a tag whose model files hold no tensor data, once it holds the master
    weights (the weights then); else a one-line FormatError: the tag holds no weights."""
    if zero is None or not zero.master:
        raise FormatError(
            f"{tag_dir}: the model files hold no tensor data (their tensor files are absent) and the optimizer "
            "files no master weights, so the checkpoint holds no weights: restore the model's .tensors files"
        )
    return zero


def open_optimizer(tag_dir: Path, model: Checkpoint, param_order: list[list[str]] | None = None) -> Zero1Tag | None:
    """The tag's ZeRO-1 optimizer state, from per-rank files or from NxD's DCP layout; None when
    the tag has no `optim/` folder."""
    if (Path(tag_dir) / OPTIM_DIR / METADATA).is_file():
        return DcpZero1Tag.open_dcp(Path(tag_dir), model, param_order)
    return Zero1Tag.open(tag_dir, model, param_order)


def open_model(
    tag_dir: Path, config: Any = None, hints: Mapping[str, Any] | None = None, store: Store | None = None
) -> Checkpoint:
    """A tag's model files opened (layout inferred for NxD's; read through `store`, default the
    local folder), with the kv replication read from the master weights when the files hold no
    data to read it from (avoid-lp, kv-multiplier > 1)."""
    model = open_checkpoint(tag_dir, config, hints, store)
    undecided = model.manifest is None and model.layout.kv_multiplier > 1 and not (hints or {}).get("kv_replication")
    if not undecided or model_has_data(model):
        return model

    def masters(candidate: Checkpoint) -> Checkpoint:
        zero = open_optimizer(tag_dir, candidate)
        if zero is None or not zero.master:
            raise CheckpointError(
                f"{tag_dir}: the model files hold no data and no master weights say how the kv heads are "
                "replicated: pass --kv-replication interleaved|blocked"
            )
        return master_weights_view(candidate, zero)

    return decide_replication(model, masters)


# ---- avoid-lp ----------------------------------------------------------------------------------


def bare_weights(pieces: Sequence[Piece], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A rank's model state as NxD's avoid-lp save keeps it: names, shapes and the dtype, no data."""
    return {p.name: torch.empty(p.shape, dtype=dtype, device="meta") for p in pieces}


# ---- checks of a requested mode ------------------------------------------------------------------


def check_mode(mode: str, *, use_xser: bool, master: bool, zero1: bool, groups: int, layout: Layout) -> None:
    """Refuse, in one line, a mode NxD could not have saved this checkpoint in."""
    if mode not in MODES:
        raise CheckpointError(f"--nxd-mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == AVOID_LP:
        if not use_xser:
            raise CheckpointError(
                "NxD saves a model without its lower-precision weights only in xser: add --format xser"
            )
        if not master:
            raise CheckpointError(
                "--nxd-mode avoid-lp keeps the weights only in the optimizer's master weights, and this checkpoint "
                "has none (or --master-weights drop was given)"
            )
    if mode == ZERO1_DCP:
        if not zero1:
            raise CheckpointError("NxD saves its optimizer through DCP only with ZeRO-1: drop --no-zero1")
        if master:
            raise CheckpointError(
                "NxD's DCP optimizer layout cannot hold master weights (zero_dcp_utils looks them up by name): "
                "add --master-weights drop, or use --nxd-mode default"
            )
        if groups != 1:
            raise CheckpointError(
                f"NxD's DCP optimizer code numbers parameters per param group, so it saves and loads only one param group; "
                f"this checkpoint has {groups}: use --nxd-mode default"
            )
        if layout.ep > 1:
            raise CheckpointError("NxD's DCP optimizer layout has no expert-parallel ranks: use --nxd-mode default")


# ---- zero1-dcp: reading ------------------------------------------------------------------------

_FQN = re.compile(r"^base_state\.(?P<name>.+)\.(?P<key>[^.|]+)(?:\|pp-(?P<pp>\d+))?(?:\|tp-(?P<tp>\d+))?$")


@dataclass
class DcpZero1Tag(Zero1Tag):
    """A tag's ZeRO-1 optimizer state in NxD's DCP layout, offered as `Zero1Tag` offers per-rank
    files: per (tp, pp) rank, its parameters' tp-local moments (the DCP tensors, whose chunks are
    the dp shards), read slice by slice."""

    folder: DcpFolder | None = None
    keys: dict[tuple[int, int], dict[tuple[str, str], str]] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open_dcp(cls, tag_dir: Path, model: Checkpoint, param_order: list[list[str]] | None = None) -> DcpZero1Tag:
        tag = cls(tag_dir, model, param_order)
        tag.folder = read_folder(tag_dir / OPTIM_DIR)
        tag._index()
        for ep, tp, pp in model.layout.ranks():
            tag.orders[(ep, tp, pp)] = tag._stage(ep, tp, pp)
        return tag

    def _where(self) -> str:
        return f"{self.tag_dir.name}/{OPTIM_DIR}/{METADATA}"

    def _index(self) -> None:
        folder, layout = self.folder, self.model.layout
        assert folder is not None
        tps, pps = set(), set()
        for fqn, entry in folder.tensors.items():
            m = _FQN.match(fqn)
            if m is None:
                continue
            if not entry.shape:
                self.steps[m["name"]] = fqn
                continue
            tp, pp = int(m["tp"] or 0), int(m["pp"] or 0)
            tps.add(m["tp"] is not None)
            pps.add(m["pp"] is not None)
            self.keys.setdefault((tp, pp), {})[(m["name"], m["key"])] = fqn
            self.dp = max(self.dp, len(entry.chunks))
        if not self.keys:
            raise OptimFileError(f"{self._where()} holds no ZeRO-1 optimizer state (base_state.<name>.exp_avg...)")
        found = (max(t for t, _ in self.keys) + 1, max(p for _, p in self.keys) + 1)
        if found != (layout.tp, layout.pp) or layout.ep > 1 or (layout.tp > 1) not in tps or (layout.pp > 1) not in pps:
            raise OptimFileError(
                f"{self._where()} holds the optimizer state of tp {found[0]}, pp {found[1]}, but the model files are "
                f"{layout.describe()}: the checkpoint is damaged or mixed"
            )
        groups: dict[int, dict[str, Any]] = {}
        for fqn in folder.objects:
            parts = fqn.split(".")
            if len(parts) == 3 and parts[0] == "param_groups" and parts[1].isdigit():
                groups.setdefault(int(parts[1]), {})[parts[2]] = folder.object(fqn)
        self.hyper = [{k: v for k, v in groups[g].items() if k != "params"} for g in sorted(groups)]
        rank = {
            (d, tp, pp): (pp * self.dp + d) * layout.tp + tp for d in range(self.dp) for _, tp, pp in layout.ranks()
        }
        for (d, tp, pp), g in rank.items():
            path = self.tag_dir / OPTIM_DIR / data_file(g)
            self.files[(d, 0, tp, pp)] = path if path.is_file() else self.tag_dir / OPTIM_DIR / METADATA

    def _stage(self, ep: int, tp: int, pp: int) -> StageOrder:
        assert self.folder is not None
        _, named = self._model_keys(ep, tp, pp)
        names = [n for n, _ in named]
        groups = [0] * len(names)
        if len(self.hyper) > 1:  # not NxD's (it saves one group): the decay rule, or --param-order
            split = self.param_order or default_groups(names)
            where = {n: g for g, group in enumerate(split) for n in group}
            groups = [where.get(n, 0) for n in names]
        entries = self.keys.get((tp, pp), {})
        for name, shape in named:
            for moment in MOMENTS:
                fqn = entries.get((name, moment))
                if fqn is None:
                    raise OptimFileError(
                        f"{self._where()} lacks {moment} of {name} (tp {tp}, pp {pp}): it is incomplete"
                    )
                if self.folder.tensors[fqn].shape != tuple(shape):
                    raise OptimFileError(
                        f"{self._where()}: {fqn} is {list(self.folder.tensors[fqn].shape)}, the model file holds "
                        f"{name} as {list(shape)}: the optimizer and model files disagree"
                    )
            step = self.steps.get(name)
            if step is None:
                raise OptimFileError(f"{self._where()} lacks the step of {name}: it is incomplete")
            value = float(read_tensor(self.folder, step).item())
            if self.step is None:
                self.step = value
            elif value != self.step:
                raise OptimFileError(
                    f"{self._where()}: {name} has taken {value:g} optimizer steps, other parameters {self.step:g}: "
                    "the state is from different steps"
                )
        return StageOrder(names, groups, [tuple(s) for _, s in named])

    def merged_reader(self, ep: int, tp: int, pp: int) -> Any:
        """A (tp, pp) rank's moments as a TensorFile of `"<moment>::<name>"`, read from DCP chunks."""
        assert self.folder is not None
        entries = self.keys.get((tp, pp), {})
        return DcpTensors(
            self.folder, {m + SEP + n: entries[(n, m)] for m in MOMENTS for n in self.orders[(0, tp, pp)].names}
        )


# ---- zero1-dcp: writing ------------------------------------------------------------------------


def stage_sizes(model: Checkpoint, layout: Layout) -> list[int]:
    """The number of parameters on each pipeline stage of `layout` (tp rank 0)."""
    shapes = model.full_shapes
    return [len(model.family.rank_pieces(layout, model.dims, 0, pp, shapes)) for pp in range(layout.pp)]


def write_dcp_optim(
    out_tag: Path,
    layout: Layout,
    tp: int,
    pp: int,
    dp: int,
    names: Sequence[str],
    hyper: Sequence[Mapping[str, Any]],
    state: Mapping[str, Mapping[str, Any]],
    stages: Sequence[int],
    sink: Sink = NO_SINK,
) -> list[FileRecord]:
    """The DCP data files of one (tp, pp) rank's dp ranks in NxD's zero1-dcp layout (see the
    module's docstring): each dp rank's unpadded shard of every moment, the steps and plain values
    once (from the lowest rank that has them), each handed to `sink` once written. Returns their
    records (`finish_optim` writes `.metadata` from them)."""
    suffix = (f"|pp-{pp:04d}" if layout.pp > 1 else "") + (f"|tp-{tp:04d}" if layout.tp > 1 else "")
    records: list[FileRecord] = []
    for d in range(dp):
        rank = (pp * dp + d) * layout.tp + tp
        with DcpFileWriter(out_tag / OPTIM_DIR / data_file(rank), out_tag, sink=sink) as writer:
            first = d == 0 and tp == 0
            if first:
                _plain_values(writer, pp, names, hyper, state, stages)
            for name in names:
                entry = state[name]
                if first:
                    step = entry["step"]
                    value = float(step.item() if isinstance(step, torch.Tensor) else step)
                    writer.add_tensor(f"base_state.{name}.step", torch.tensor(value), path=("base_state", name, "step"))
                for moment in MOMENTS:
                    tensor = entry[moment].float()
                    writer.add_tensor(
                        f"base_state.{name}.{moment}{suffix}",
                        _dp_part(tensor, dp, d, name),
                        offsets=[d * shard_rows(tensor.shape[0], dp)] + [0] * (tensor.dim() - 1),
                        shape=tensor.shape,
                        path=("base_state", name, moment + suffix),
                    )
            records += writer.close()
    return records


def _plain_values(
    writer: DcpFileWriter,
    pp: int,
    names: Sequence[str],
    hyper: Sequence[Mapping[str, Any]],
    state: Mapping[str, Mapping[str, Any]],
    stages: Sequence[int],
) -> None:
    """The param groups (stage 0's) and the `shape_info` entries no earlier stage had."""
    if pp == 0:
        for g, group in enumerate(hyper):
            for key, value in {**group, "params": list(range(len(names)))}.items():
                writer.add_object(f"param_groups.{g}.{key}", value, path=("param_groups", g, key))
    for idx in range(max(stages[:pp], default=0), len(names)):
        shape = list(state[names[idx]]["exp_avg"].shape)
        writer.add_object(f"shape_info.{idx}", shape, path=("shape_info", str(idx)))


def _dp_part(tensor: torch.Tensor, dp: int, d: int, name: str) -> torch.Tensor:
    """dp rank d's rows of a tp-local tensor without padding, as NxD hands them to DCP."""
    n0 = tensor.shape[0]
    rows = shard_rows(n0, dp)
    if (dp - 1) * rows >= n0:
        raise CheckpointError(
            f"at dp {dp} the last dp rank would hold no rows of {name} ({n0} rows), which NxD's DCP layout "
            "cannot express: choose a smaller --dp or --nxd-mode default"
        )
    return tensor[d * rows : min(n0, (d + 1) * rows)]


def finish_optim(out_tag: Path, records: Sequence[FileRecord]) -> list[Path]:
    """`optim/.metadata` of a tag whose optimizer was written by `write_dcp_optim`."""
    chunked = [r for r in records if isinstance(r, ChunkedRecord)]
    return finish_folder(out_tag / OPTIM_DIR, chunked, root=out_tag) if chunked else []
