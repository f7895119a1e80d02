"""torchtitan's training checkpoints (PyTorch DCP), read and written by meaning.

torchtitan's `CheckpointManager.save` (`components/checkpoint.py`, releases 0.1-0.2) writes
`<dump>/checkpoint/step-<N>/` with `dcp.save` of one state dict: the model's parameters at the top
level, under torchtitan's names (`conventions.TITAN`); `optimizer`, AdamW's state flattened per
parameter (`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`:
`state.<fqn>.exp_avg|exp_avg_sq|step`, `param_groups.<fqn>.<hyperparameter>`); `lr_scheduler`
(the first scheduler's state dict); `dataloader`; `train_state` (`step`, `ntokens_seen`). Every
tensor is saved in the chunks its ranks held (FSDP's dim-0 shards, tensor parallel cuts).

Reading (`open_titan`): the model is the folder's DCP model (`formats.dcp.describe_model`), and
AdamW's moments are pieces of the full tensors `"exp_avg::<HF name>"`, cut and permuted like their
parameters (`TitanOptimizer`, which `ckpt reshard` and its readers take as they take NxD's ZeRO-1
state); parameters with the same hyperparameters form one param group. The schedule becomes NxD's
`scheduler.pt`, and the step, with every value NxD's tree has no place for (the schedule's and
the data loader's items, as flattened), goes into `user_content.pt` (`TITAN`), so that the way
back writes them as they were.

Writing (`write_titan`): a DCP folder `step-<N>` of a layout's chunks (a data file per (tp, pp)
rank, as `formats.dcp.plan_outputs` cuts the model), holding the parameters, each one's moments
(the same chunks), step and hyperparameters, and the schedule, train state and data loader state.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..conventions import TITAN_03, TITAN_03_UNFUSED, Convention, Fusion, get_convention, to_native
from ..distributed import Job
from ..formats import Checkpoint, SourceReader, open_checkpoint
from ..formats.dcp import CHUNK_BYTES, describe_model, parse_chunk_name, plan_outputs
from ..formats.dcp_files import METADATA, DcpFileWriter, DcpFolder, finish_folder, read_tensor
from ..formats.manifest import MANIFEST, file_record, manifest
from ..io.data.digest import FileRecord
from ..io.safety.durable import write_text
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.transaction import commit_all, staged_output
from ..layout import FULL, Layout, ModelDims
from ..placements import Piece, Segment
from .base import CheckpointError
from .tree import CONFIG
from .zero1 import MOMENTS, SEP, StageOrder, Zero1Tag, prefixed

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
TITAN_ITEMS = "torchtitan"
"""The key of `user_content.pt` under which the flattened items torchtitan saved beside the model
and optimizer are kept ({flat key: [nested path, value]})."""
_KEPT = ("lr_scheduler.", "dataloader.", "train_state.")


def titan_step_dir(src: Path, tag: str | None = None) -> Path | None:
    """The DCP training checkpoint `src` names: itself (a folder with `.metadata`), or, in a folder
    of torchtitan's `step-<N>` checkpoints, `tag` or the newest; None when `src` is neither."""
    src = Path(src)
    if (src / METADATA).is_file():
        if tag not in (None, src.name):
            raise CheckpointError(f"{src} is one DCP checkpoint ({src.name}): --tag {tag} does not name it")
        return src
    if not src.is_dir():
        return None
    steps = {int(m.group(1)): p for p in src.iterdir() if (m := STEP_DIR.match(p.name)) and (p / METADATA).is_file()}
    if not steps:
        return None
    if tag is not None:
        if not (src / tag / METADATA).is_file():
            raise CheckpointError(
                f"{src} holds no DCP checkpoint {tag} (it holds {', '.join(sorted(p.name for p in steps.values()))})"
            )
        return src / tag
    return steps[max(steps)]


@dataclass
class TitanOptimizer(Zero1Tag):
    """AdamW's state in a torchtitan checkpoint, offered as `Zero1Tag` offers NxD's: `view()` is a
    Checkpoint of the full tensors `"<moment>::<HF name>"`; one group per distinct set of
    hyperparameters."""

    moments_view: Checkpoint | None = None
    groups_of: dict[str, int] = field(default_factory=dict)

    def moments(self) -> list[str]:
        return list(MOMENTS)

    def view(self, moments: Sequence[str] | None = None) -> Checkpoint:
        assert self.moments_view is not None
        return self.moments_view

    def group_of(self) -> dict[str, int]:
        return dict(self.groups_of)


@dataclass
class TitanTag:
    """An opened torchtitan checkpoint: its model, AdamW's state, step, schedule and kept items."""

    step_dir: Path
    model: Checkpoint
    optimizer: TitanOptimizer
    step: int
    scheduler: dict[str, Any] | None
    user_content: dict[str, Any]


def open_titan(step_dir: Path, config: Any = None) -> TitanTag:
    """A torchtitan DCP training checkpoint, checked: every parameter's moments and step present,
    one step for all."""
    model = open_checkpoint(step_dir, config)
    if model.format != "dcp":
        raise CheckpointError(f"{step_dir} is not a DCP checkpoint")
    moments = describe_model(step_dir, model.family, model.dims, model.convention, [m + SEP for m in MOMENTS])
    folder = moments.folder
    if moments.convention.fusions:  # torchtitan 0.3: say whether its q, k and v were one parameter
        fused = any(p != moments.convention.native(h) for h, p in moments.params.items())
        model.convention = TITAN_03 if fused else TITAN_03_UNFUSED
    view = Checkpoint(
        **{**model.__dict__, "files": moments.files, "holdings": moments.holdings, "opener": moments.open}
    )
    hyper, groups_of, step = _groups_and_step(folder, moments.prefix, model, moments.params)
    names = list(model.full_shapes)
    optimizer = TitanOptimizer(step_dir, model, dp=1, step=float(step), hyper=hyper)
    optimizer.moments_view, optimizer.groups_of = view, groups_of
    optimizer.orders[(0, 0, 0)] = StageOrder(
        names, [groups_of[n] for n in names], [model.full_shapes[n] for n in names]
    )
    items = {k: [list(folder.paths.get(k, (k,))), folder.object(k)] for k in folder.objects if k.startswith(_KEPT)}
    train = _nested({k: v for k, v in items.items() if k.startswith("train_state.")}).get("train_state", {})
    schedule = _nested({k: v for k, v in items.items() if k.startswith("lr_scheduler.")}).get("lr_scheduler")
    count = int(train.get("step", step)) if isinstance(train, Mapping) else int(step)
    content = {"step": count, "total_steps": count, TITAN_ITEMS: items}
    return TitanTag(step_dir, model, optimizer, count, schedule, content)


def _groups_and_step(
    folder: DcpFolder, at: str, model: Checkpoint, params: Mapping[str, str]
) -> tuple[list[dict[str, Any]], dict[str, int], float]:
    """The distinct hyperparameter sets (param groups), each parameter's group, and the one step
    (`params`: the parameter each HF tensor's state is kept under)."""
    hyper: list[dict[str, Any]] = []
    groups: dict[str, int] = {}
    steps: set[float] = set()
    for hf in model.full_shapes:
        fqn = params[hf]
        mine = {
            k.rsplit(".", 1)[1]: folder.object(k)
            for k in folder.objects
            if k.startswith(f"{at}optimizer.param_groups.{fqn}.")
        }
        if mine not in hyper:
            hyper.append(mine)
        groups[hf] = hyper.index(mine)
        key = f"{at}optimizer.state.{fqn}.step"
        if key not in folder.tensors:
            raise CheckpointError(f"{folder.root}: {key} is missing: the optimizer state is incomplete")
        steps.add(float(read_tensor(folder, key).item()))
    if len(steps) != 1:
        raise CheckpointError(f"{folder.root}: the parameters have taken different numbers of steps ({sorted(steps)})")
    return hyper, groups, steps.pop()


def _nested(items: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """Flattened DCP items {key: [path, value]} as the nested state dict they came from."""
    out: dict[str, Any] = {}
    for path, value in items.values():
        node: Any = out
        for part, after in zip(path[:-1], path[1:]):
            if isinstance(node, dict):
                node = node.setdefault(part, [] if isinstance(after, int) else {})
            else:
                while len(node) <= part:
                    node.append([] if isinstance(after, int) else {})
                node = node[part]
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return out


# ---- writing a torchtitan checkpoint ---------------------------------------------------------


def _flat(tree: Mapping[str, Any], top: str) -> dict[str, list[Any]]:
    """A nested value as DCP flattens it ({key: [path, value]}): mappings walked into, lists only
    when they hold mappings or lists."""
    out: dict[str, list[Any]] = {}

    def walk(path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk((*path, str(k)), v)
        elif isinstance(value, list) and any(isinstance(v, (Mapping, list)) for v in value):
            for i, v in enumerate(value):
                walk((*path, i), v)
        else:
            out[".".join(map(str, path))] = [list(path), value]

    walk((top,), tree)
    return out


def kept_items(user_content: Any, scheduler: Any, step: int) -> dict[str, list[Any]]:
    """What a torchtitan checkpoint saves beside the model and optimizer: the items kept from one
    (`TITAN_ITEMS`), else the schedule's state and a train state at `step` (no data position)."""
    if isinstance(user_content, Mapping) and isinstance(user_content.get(TITAN_ITEMS), Mapping):
        return {k: list(v) for k, v in user_content[TITAN_ITEMS].items()}
    items = _flat({"step": step, "ntokens_seen": 0}, "train_state")
    if isinstance(scheduler, Mapping):
        items |= _flat(scheduler, "lr_scheduler")
    log.info("the checkpoint was not torchtitan's: its schedule is written as saved, and no data loader state")
    return items


@dataclass
class TitanWrite:
    """A torchtitan checkpoint to write: the source's readers, layout, names, and what to keep."""

    model: Checkpoint  # what the weights are read from (the model, or its master weights)
    optimizer: Zero1Tag | None
    layout: Layout
    convention: str
    step: int
    items: dict[str, list[Any]]
    dtype: torch.dtype


def write_titan(src_dir: Path, dst: Path, plan: TitanWrite, job: Job, check: Any = None, sink: Sink = NO_SINK) -> Path:
    """`dst/step-<N>`: the training state in torchtitan's DCP layout (see the module's doc),
    written through the I/O core's staged output; a data file per rank of `plan.layout`, each
    handed to `sink` (`io.safety.sinks`) once written."""
    convention = get_convention(plan.convention)
    convention.check(plan.model.family.name, plan.model.dims)
    files = plan_outputs(plan.model.family, plan.model.dims, plan.layout, plan.convention)
    name = f"step-{plan.step}"
    with staged_output(dst, sources=[src_dir], what="ckpt reshard", job=job, sink=sink) as out:
        mine = job.run_all_or_none(lambda: _write_files(out.path / name, plan, job.share(files), out.sink))
        records = [r for part in job.gather(mine) for r in part]
        commit_all(out, job, lambda staging: _finish(staging / name, plan, records, check))
    return dst / name


class _State(NamedTuple):
    """The source's optimizer state, as `_write_files` writes it: its reader, param groups, step."""

    reader: SourceReader
    groups: Mapping[str, int]  # HF name -> param group
    hyper: Sequence[Mapping[str, Any]]
    step: float


def _write_files(
    folder: Path, plan: TitanWrite, files: list[tuple[str, list[Piece], Any]], sink: Sink
) -> list[FileRecord]:
    """This process's data files: the rank's chunks of every parameter and its moments; the step,
    hyperparameters and kept items once; where the convention fuses q, k and v, their moments as
    chunks of the fused parameter's (`fused_chunks`)."""
    model = SourceReader(plan.model)
    opt = plan.optimizer
    state = _State(SourceReader(opt.view()), opt.group_of(), opt.hyper, float(opt.step or 0)) if opt else None
    convention = get_convention(plan.convention)
    fused = fused_chunks(files, convention, plan.model.dims) if state is not None and convention.fused else {}
    records: list[FileRecord] = []
    try:
        for path, pieces, _ in files:
            with DcpFileWriter(folder / path, folder, sink=sink) as writer:
                if path == "__0_0.distcp":
                    for key, (nested, value) in plan.items.items():
                        writer.add_object(key, value, path=tuple(nested))
                for piece in pieces:
                    _write_chunk(writer, piece, model, state, plan, convention)
                for fusion, layer, rows in fused.get(path, []):
                    assert state is not None
                    _write_fused(writer, fusion, layer, rows, state, plan, convention)
                records += writer.close()
    finally:
        model.close()
        if state is not None:
            state.reader.close()
    return records


def _write_chunk(
    writer: DcpFileWriter,
    piece: Piece,
    model: SourceReader,
    state: _State | None,
    plan: TitanWrite,
    convention: Convention,
) -> None:
    """One chunk of a parameter and of each of its moments (and, with its first chunk, its step and
    hyperparameters); the moments of a part of a fused parameter are the fused one's (`_write_fused`)."""
    fqn, offsets, shape, head_dim = parse_chunk_name(piece.name)
    source = piece.segments[0].source

    def native(t: torch.Tensor) -> torch.Tensor:
        return to_native(t, head_dim) if head_dim else t

    writer.add_tensor(fqn, native(model.read_piece(piece).to(plan.dtype)), offsets=offsets, shape=shape, owned=True)
    if state is None or (convention.fused and convention.fusion(source)):
        return
    if not any(offsets or ()):
        _write_step(writer, fqn, source, state)
    for moment in MOMENTS:
        key, path = _state_key(fqn, moment)
        tensor = native(state.reader.read_piece(prefixed(piece, moment + SEP)))
        writer.add_tensor(key, tensor, offsets=offsets, shape=shape, path=path, owned=True)


def _state_key(fqn: str, name: str) -> tuple[str, tuple[str, str]]:
    """The flat key of a parameter's optimizer state `name`, and its nested path (torchtitan's)."""
    return f"optimizer.state.{fqn}.{name}", ("optimizer", f"state.{fqn}.{name}")


def _write_step(writer: DcpFileWriter, fqn: str, source: str, state: _State) -> None:
    """A parameter's step and hyperparameters (those of `source`'s param group), as torchtitan keeps them."""
    key, path = _state_key(fqn, "step")
    writer.add_tensor(key, torch.tensor(state.step), path=path)
    for k, v in state.hyper[state.groups.get(source, 0)].items():
        writer.add_object(f"optimizer.param_groups.{fqn}.{k}", v, path=("optimizer", f"param_groups.{fqn}.{k}"))


def fused_chunks(
    files: Sequence[tuple[str, list[Piece], Any]], convention: Convention, dims: ModelDims
) -> dict[str, list[tuple[Fusion, str, tuple[int, int]]]]:
    """Which data file holds which rows of each fused parameter's moments: its kv heads' groups of
    rows shared out, in rank order, among the files that hold its parts (as a tensor-parallel cut
    of the fused parameter would), each share in chunks of at most `CHUNK_BYTES` of whole heads.
    Returns {file: [(fusion, layer, (first row, end row))]}."""
    holders: dict[tuple[Fusion, str], list[str]] = {}
    for path, pieces, _ in files:
        for piece in pieces:
            for seg in piece.segments:
                found = convention.fusion(seg.source)
                if found is not None and path not in holders.setdefault(found, []):
                    holders[found].append(path)
    out: dict[str, list[tuple[Fusion, str, tuple[int, int]]]] = {}
    group = dims.q_size // dims.num_kv_heads + 2 * dims.head_dim  # rows per kv head
    step = max(dims.head_dim, CHUNK_BYTES // (4 * dims.hidden_size) // dims.head_dim * dims.head_dim)
    for (fusion, layer), paths in holders.items():
        for n, path in enumerate(paths):
            first, last = (dims.num_kv_heads * k // len(paths) * group for k in (n, n + 1))
            out.setdefault(path, []).extend((fusion, layer, (a, min(last, a + step))) for a in range(first, last, step))
    return out


def _write_fused(
    writer: DcpFileWriter,
    fusion: Fusion,
    layer: str,
    rows: tuple[int, int],
    state: _State,
    plan: TitanWrite,
    convention: Convention,
) -> None:
    """Rows [start, stop) (whole heads) of a fused parameter's moments, read from its parts' moments
    (q and k heads in the convention's row order); with its first rows, its step and hyperparameters."""
    dims = plan.model.dims
    fqn, blocks = fusion.native.replace("{i}", layer), fusion.blocks(layer, dims)
    if rows[0] == 0:
        _write_step(writer, fqn, blocks[0][0], state)
    for moment in MOMENTS:
        parts, at = [], 0
        for name, start, stop in blocks:
            lo, hi = max(rows[0], at), min(rows[1], at + stop - start)
            if lo < hi:
                part = state.reader.read_segment(Segment(moment + SEP + name, 0, start + lo - at, start + hi - at))
                head_dim = convention.head_dim(name, dims)
                parts.append(to_native(part, head_dim) if head_dim else part)
            at += stop - start
        key, path = _state_key(fqn, moment)
        tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
        writer.add_tensor(key, tensor, offsets=[rows[0], 0], shape=fusion.shape(dims), path=path, owned=True)


def _finish(folder: Path, plan: TitanWrite, records: list[FileRecord], check: Any) -> None:
    """Leader, after every data file: `.metadata`, config.json and shardkit's manifest; the source
    checked before anything is committed."""
    files = [folder / r.path for r in records] + finish_folder(folder, records)
    write_text(folder / CONFIG, json.dumps(plan.model.config, indent=2) + "\n", fsync=False)
    files.append(folder / CONFIG)
    data = manifest(
        fmt="dcp",
        family=plan.model.family.name,
        layout=plan.layout,
        dtype=str(plan.dtype).replace("torch.", ""),
        records=[file_record(f, folder) for f in files],
        tensors=plan.model.full_shapes,
        command="ckpt reshard",
        convention=plan.convention,
        checkpoint={"step": plan.step, "torchtitan": True},
    )
    write_text(folder / MANIFEST, json.dumps(data, indent=2) + "\n", fsync=False)
    if check is not None:
        check.finish()


def inspect_titan(step_dir: Path, config: Any = None) -> dict[str, Any]:
    """What `ckpt inspect` says of a torchtitan checkpoint."""
    tag = open_titan(step_dir, config)
    opt = tag.optimizer
    names = list(tag.model.full_shapes)
    return {
        "tag": step_dir.name,
        "path": str(step_dir),
        "format": "dcp",
        "convention": tag.model.convention,
        "layout": FULL.to_dict(),
        "describe": "DCP chunks (any layout)",
        "dp": None,
        "zero1": False,
        "step": tag.step,
        "master_weights": False,
        "model_has_data": True,
        "nxd_mode": None,
        "saved_by": "torchtitan",
        "param_groups": [
            {"hyper": h, "parameters_on_tp0_pp0": [n for n in names if opt.groups_of[n] == g]}
            for g, h in enumerate(opt.hyper)
        ],
        "optimizer_bytes": sum(p.stat().st_size for p in step_dir.glob("*.distcp")),
    }
