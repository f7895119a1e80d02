"""`shardkit ckpt reshard`: a whole NxD training state (model, ZeRO-1 optimizer shards, master
weights) written for another tp / pp / dp / kv-multiplier layout, in NxD's exact format.

The unit of work is one (ep, tp, pp) rank of the target: its model file and its D optimizer
files (one per dp rank), both written by the engine (`engine.executor`): the model files from the
source's model view (or its master weights), the optimizer files as objects (`OutputFile.body`:
NxD's `build_optim` objects) from the optimizer view (moments through `Zero1Tag.view`, resharded
like their parameters: kv replicas, fused gate_up, vocab rows), the D files of a rank built
together, a tensor of each in turn, so that each moment is read once and cut into its D shards:
memory holds one tensor and its shards, never a rank's state (but for the zero1-dcp mode, which
writes a rank's state at once: `write_rank`). Under torchrun the units are divided among the
processes. Everything is written into a staging folder beside DST, `done` last, and renamed
into place: a failure on any process leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from typing_extensions import Unpack

from ..conventions import TITAN
from ..distributed import Job, current_job
from ..engine.executor import execute
from ..engine.options import WriteOptions
from ..engine.outputs import OutputFile, plan_sharded
from ..errors import ShardkitError
from ..families.lora import base_config, saved_settings
from ..formats import Checkpoint, SourceReader, load_config, nxd
from ..formats.base import compact
from ..formats.manifest import MANIFEST, file_record, manifest
from ..formats.source_check import HashCheck
from ..formats.torch_io import load_small
from ..io.data.buffers import one_torch_thread, reused_buffers
from ..io.data.digest import NONE, FileRecord
from ..io.safety.durable import write_marker, write_text
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.small import PICKLE_LIMIT, copy_small
from ..io.safety.transaction import commit_all, staged_output
from ..io.store import Store
from ..layout import Layout
from ..placements import Piece
from . import optimum
from .base import CheckpointError
from .dcp import TitanWrite, inspect_titan, kept_items, open_titan, titan_step_dir, write_titan
from .load import tag_to_read
from .nxd_modes import (
    AVOID_LP,
    DEFAULT,
    ZERO1_DCP,
    bare_weights,
    check_mode,
    finish_optim,
    mode_of,
    open_model,
    open_optimizer,
    stage_sizes,
    write_dcp_optim,
)
from .object_writer import Deferred, archive_of_files, object_body, save_object
from .tree import CHECKPOINT_MARKER, CONFIG, DONE_MARKER, MODEL_DIR, SCHEDULER, USER_CONTENT, read_manifest, tag_check
from .zero1 import (
    MASTER,
    MOMENTS,
    SEP,
    Zero1Tag,
    build_optim,
    master_weights_view,
    model_has_data,
    optim_name,
    prefixed,
    stored_dtype,
)

log = logging.getLogger(__name__)


@dataclass
class Source:
    """An opened training checkpoint tag: the model view and (when present) its ZeRO-1 optimizer."""

    tag_dir: Path
    model: Checkpoint
    zero1: Zero1Tag | None
    has_data: bool = True
    mode: str = "default"
    """How NxD saved it (`nxd_modes.MODES`): its default, avoid-lp or zero1-dcp."""
    plain: dict[str, Any] = field(default_factory=dict)
    """scheduler.pt and user_content.pt to write from values, not copied (a torchtitan source's)."""

    @property
    def use_xser(self) -> bool:
        return self.model.format == "xser"


Hints = Mapping[str, Any] | None  # layout facts the files cannot tell (kv_replication)
ParamOrder = list[list[str]] | None  # parameter names per optimizer param group


def _config_given(tag_dir: Path, config: Any) -> None:
    """A tag without config.json (NxD's carry none) needs the model's config from the caller."""
    if config is None and not (tag_dir / CONFIG).is_file():
        raise CheckpointError(
            f"{tag_dir} has no config.json (NxD checkpoints carry none): pass the model's "
            "Hugging Face config with --config"
        )


def open_training_tag(
    tag_dir: Path, config: Any = None, hints: Hints = None, param_order: ParamOrder = None, store: Store | None = None
) -> Source:
    """Open a tag (NxD's, shardkit's or an optimum-neuron checkpoint folder) and check its optimizer
    files against its model files (read through `store`, default the local folder)."""
    tag_dir = Path(tag_dir)
    if optimum.is_optimum_tag(tag_dir):
        model, zero, plain = optimum.open_parts(tag_dir, config, param_order, store)
        return Source(tag_dir, model, zero, True, DEFAULT, plain)
    _config_given(tag_dir, config)
    model = open_model(tag_dir, config, hints, store)
    zero = open_optimizer(tag_dir, model, param_order)
    has_data = model_has_data(model)
    return Source(tag_dir, model, zero, has_data, mode_of(tag_dir, has_data, zero))


def model_checkpoint(
    tag_dir: Path, config: Any = None, hints: Hints = None, param_order: ParamOrder = None, store: Store | None = None
) -> Checkpoint:
    """A tag's model as the engine reads it (merge, export): its model files, or, when they hold no
    tensor data (NxD's avoid_saving_lower_precision_weights), its fp32 master weights in the
    model's dtype under the model's names. An optimum-neuron checkpoint's model files always hold
    its weights: its optimizer files are not opened. `store`: what the tag is read through
    (default: the local folder)."""
    if optimum.is_optimum_tag(tag_dir):
        return optimum.open_model(tag_dir, config, store)
    _config_given(Path(tag_dir), config)
    model = open_model(Path(tag_dir), config, hints, store)
    if model_has_data(model):
        return model  # the optimizer files are not opened (nor fetched from object storage)
    zero = open_optimizer(Path(tag_dir), model, param_order)
    if zero is None:
        raise CheckpointError(
            f"{tag_dir}: the model files hold no tensor data and there are no optimizer files "
            "with master weights: the checkpoint holds no weights"
        )
    return master_weights_view(model, zero)


def model_dtype(src: Source) -> torch.dtype:
    return src.model.dtype() if src.has_data else stored_dtype(src.model)


@dataclass
class RankReaders:
    """The reader of a source's optimizer view (one per process, closed at the end)."""

    src: Source
    optim: SourceReader | None = None
    groups: dict[str, int] = field(default_factory=dict)
    archives: tuple[str | None, str | None] = (None, None)
    """How the source's model and optimizer files name their zip records' folder: kept when written."""

    def __post_init__(self) -> None:
        if self.src.zero1 is not None:
            self.optim = SourceReader(self.src.zero1.view())
            self.groups = self.src.zero1.group_of()
        optim_files = self.src.zero1.files.values() if self.src.zero1 is not None else ()
        self.archives = (archive_of_files(self.src.model.files.values()), archive_of_files(optim_files))

    def state(self, pieces: list[Piece], moments: list[str], deferred: bool = True) -> dict[str, dict[str, Any]]:
        """Each piece's optimizer state: its moments as `Deferred` tensors that say their source
        piece (the engine reads them when their files are written: `optimizer_outputs`), or read
        now."""
        optim, zero1 = self.optim, self.src.zero1
        assert optim is not None and zero1 is not None
        out: dict[str, dict[str, Any]] = {}
        for p in pieces:
            entry: dict[str, Any] = {"step": zero1.step}
            for m in moments:
                piece = prefixed(p, m + SEP)
                read = _reader(optim, piece, None)
                # saved as fp32 (`build_optim` cuts them to their dp shards as float)
                entry[m] = Deferred(p.shape, torch.float32, read, piece) if deferred else read()
            out[p.name] = entry
        return out

    def group(self, piece: Piece) -> int:
        return self.groups.get(piece.segments[0].source, 0)

    def close(self) -> None:
        if self.optim is not None:
            self.optim.close()


def _reader(reader: SourceReader, piece: Piece, dtype: torch.dtype | None) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        t = reader.read_piece(piece)
        return compact(t if dtype is None else t.to(dtype))  # copied only when a view of more

    return read


def write_rank(
    out_tag: Path,
    readers: RankReaders,
    layout: Layout,
    rank: tuple[int, int, int],
    dp: int,
    use_xser: bool,
    master: bool,
    dtype: torch.dtype,
    mode: str = "default",
    stages: list[int] | None = None,
    sink: Sink = NO_SINK,
) -> list[Path | FileRecord]:
    """What of one target (ep, tp, pp) rank the engine does not write (`write_model_files`,
    `optimizer_outputs`): in avoid-lp mode its model file without tensor data, in zero1-dcp mode
    its optimizer state through PyTorch DCP (returned as its records). The files written through
    the I/O core are handed to `sink` (the output's, `io.safety.sinks`) as they close."""
    src = readers.src
    ep, tp, pp = rank
    pieces = src.model.family.rank_pieces(layout, src.model.dims, tp, pp, src.model.full_shapes, ep)
    expert = {p.name for p in pieces if p.expert}  # xser's expert_model_parallel flags, as save writes them
    written: list[Path | FileRecord] = []
    if mode == AVOID_LP:  # names, shapes and dtypes only: the weights are the master weights
        model_path = out_tag / nxd.rank_file_name(ep, tp, pp, layout, "torch")
        written += save_object(
            model_path,
            bare_weights(pieces, dtype),
            use_xser,
            expert,
            False,
            archive=readers.archives[0],
            root=out_tag,
            sink=sink,
        )
    if src.zero1 is not None and mode == ZERO1_DCP:
        moments = [*MOMENTS, MASTER] if master else list(MOMENTS)
        names = [p.name for p in pieces]
        state = readers.state(pieces, moments, deferred=False)
        written += write_dcp_optim(out_tag, layout, tp, pp, dp, names, src.zero1.hyper, state, stages or [], sink)
    return written


def optimizer_outputs(
    readers: RankReaders, layout: Layout, rank: tuple[int, int, int], dp: int, use_xser: bool, master: bool
) -> list[OutputFile]:
    """The dp ZeRO-1 optimizer files of one target (ep, tp, pp) rank as the engine writes them
    (NxD's objects: `build_optim`; v3 names with ep_rank when ep > 1): built together, a tensor of
    each in turn, so that each moment piece is read once and cut into its dp shards, and memory
    holds one tensor and its shards, never a rank's state."""
    src = readers.src
    assert src.zero1 is not None
    ep, tp, pp = rank
    pieces = src.model.family.rank_pieces(layout, src.model.dims, tp, pp, src.model.full_shapes, ep)
    expert = any(p.expert for p in pieces)  # xser's expert_model_parallel flag, as save writes it
    moments = [*MOMENTS, MASTER] if master else list(MOMENTS)
    names = [p.name for p in pieces]
    groups = [readers.group(p) for p in pieces]
    state = readers.state(pieces, moments)
    outputs = []
    for d in range(dp):
        obj = build_optim(names, groups, src.zero1.hyper, state, dp, d, master)
        path = optim_name(d, tp, pp, ep if layout.ep > 1 else None)
        outputs.append(OutputFile.of_body(path, object_body(obj, use_xser, expert), together=rank))
    return outputs


def write_model_files(
    src: Source, out_tag: Path, layout: Layout, ranks: Sequence[tuple[int, int, int]], use_xser: bool, sink: Sink
) -> list[FileRecord]:
    """The model files of the target (ep, tp, pp) `ranks`, written by the engine (`engine.execute`:
    read-ahead, kernel copies of bytes that move unchanged, workers) from the source's model files,
    or from its fp32 master weights in the model's dtype when its model files hold no tensor data.
    Each keeps the stored dtype of its weights and the source's zip-record naming (NxD's is after
    the file), so a round trip gives back the source's bytes. The source is not checked here: the
    tag's own check (`tree.tag_check`) covers every file of it."""
    if src.has_data:
        weights = src.model
    elif src.zero1 is not None and src.zero1.master:
        weights = master_weights_view(src.model, src.zero1)
    else:
        raise CheckpointError(
            f"{src.tag_dir}: the model files hold no weights and the optimizer files "
            "no master weights: the checkpoint has no weights to read"
        )
    fmt = "xser" if use_xser else "torch"
    wanted = set(ranks)
    outputs = [o for o in plan_sharded(src.model.family, src.model.dims, layout, fmt) if o.rank in wanted]
    archive = archive_of_files(src.model.files.values())
    options = WriteOptions(fmt=fmt, verify_hashes=NONE, archive=archive, sink=sink)
    return execute(weights, outputs, out_tag, options)


class TrainingReshardOptions(TypedDict, total=False):
    """How `reshard_training` reads its source and writes the new training checkpoint."""

    dp: int | None
    """The new data-parallel degree, counted as the trainer counts it (every data-parallel rank;
    with ep > 1 the expert-parallel ranks are carved out of them): with ZeRO-1, dp / ep optimizer
    shards per (ep, tp, pp) rank. Default: the source's (`source_parallelism`)."""
    zero1: bool | None
    """One optimizer shard per data-parallel rank (NxD's ZeRO-1), or one unsharded file per rank.
    Default: as the source was saved."""
    config: Any
    """The model's Hugging Face config (dict or config.json) when the tag carries none."""
    tag: str | None
    """The tag to reshard (default: the newest complete one)."""
    format: str | None
    """torch or xser (default: the source's)."""
    master_weights: str
    """keep (default: fp32 master weights resharded too) or drop."""
    hints: Mapping[str, Any] | None
    """Layout facts the source's files cannot tell (kv_replication)."""
    verify_hashes: bool
    """Check every file the source tag's manifest lists against its digest before the new
    checkpoint is committed (default True)."""
    convention: str | None
    """With format "dcp": whose names the DCP training checkpoint gets (default torchtitan's)."""
    nxd_mode: str | None
    """How NxD would have saved it (`nxd_modes.MODES`): "default", "avoid-lp" (xser model files
    without tensor data, the weights in the master weights) or "zero1-dcp" (the optimizer through
    PyTorch DCP); default: the source's."""


@dataclass
class _Plan:
    """A `reshard_training` call, checked: its source, target and how to write it."""

    src: Source
    name: str
    layout: Layout
    dp: int
    zero1: bool
    use_xser: bool
    master: bool
    dtype: torch.dtype
    mode: str = "default"
    fmt: str = "torch"
    check: HashCheck | None = None
    data_parallel: int | None = None
    """The data-parallel degree as the trainer counts it (`dp` is the optimizer files per rank)."""


def source_parallelism(src: Source) -> tuple[int | None, bool]:
    """(data-parallel degree, ZeRO-1) the source was saved with. The degree counts every
    data-parallel rank, as the trainer's --dp does (with ep > 1: ep x the optimizer shards per
    rank); None when the files cannot tell it and nothing records it (a shardkit manifest's
    `data_parallel`, the trainer's user content). ZeRO-1: several shards per rank, or what the
    manifest or the trainer recorded; one shard per rank and no record (NxD's own tags) is read as
    NxD's ZeRO-1 optimizer at that degree (the files are the same either way)."""
    per_rank = src.zero1.dp if src.zero1 is not None else None
    if not per_rank:
        return None, False
    section = (read_manifest(src.tag_dir) or {}).get("checkpoint") or {}
    content = _trainer_content(src)
    said = next((r["zero1"] for r in (section, content) if isinstance(r.get("zero1"), bool)), None)
    if per_rank > 1 or said is not False or src.mode == ZERO1_DCP:
        return per_rank * src.model.layout.ep, True
    recorded = next((r[k] for r, k in ((section, "data_parallel"), (content, "dp")) if _whole_positive(r.get(k))), None)
    return recorded, False


def _whole_positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _trainer_content(src: Source) -> dict[str, Any]:
    """The `trainer` section of the source's user content (shardkit's trainer records its dp and
    ZeRO-1 there); empty when there is none or it cannot be read."""
    try:
        content = _plain_value(src, USER_CONTENT)
    except (ShardkitError, OSError):
        return {}
    section = content.get("trainer") if isinstance(content, Mapping) else None
    return dict(section) if isinstance(section, Mapping) else {}


def _data_parallel(src: Source, layout: Layout, options: TrainingReshardOptions) -> tuple[int | None, bool]:
    """(the new data-parallel degree, ZeRO-1): the options', else the source's (see
    TrainingReshardOptions); refused in one line when they cannot be met."""
    dp, zero1 = options.get("dp"), options.get("zero1")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
        raise CheckpointError(f"--dp must be a whole number >= 1, got {dp!r}")
    source_dp, source_zero1 = source_parallelism(src)
    kept = source_zero1 or options.get("nxd_mode") == ZERO1_DCP  # NxD's zero1-dcp mode is ZeRO-1's
    if zero1 is None and dp is not None and not kept and dp != source_dp:
        raise CheckpointError(
            f"--dp {dp} shards nothing: {src.tag_dir} was saved without ZeRO-1 (one optimizer file per rank), which "
            f"is kept unless asked: add --zero1 for {dp} optimizer shards, or --no-zero1"
        )
    zero1 = kept if zero1 is None else bool(zero1)
    dp = source_dp if dp is None else dp
    if not zero1:
        return dp, False
    if dp is None:
        raise CheckpointError(
            f"ZeRO-1 needs --dp: {src.tag_dir} has no ZeRO-1 shards and records no data-parallel degree (give the "
            "data-parallel degree of the run that will resume it, as the trainer's --dp counts it)"
        )
    if dp % layout.ep:
        whose = "--dp" if options.get("dp") is not None else "the source's dp"
        raise CheckpointError(
            f"{whose} {dp} is not a multiple of ep {layout.ep}: the expert-parallel ranks are carved out of the "
            f"data-parallel ones (the trainer's --dp counts them all), so give a --dp divisible by {layout.ep}"
        )
    return dp, True


def _plan(src_dir: Path, layout: Layout, param_order: ParamOrder, options: TrainingReshardOptions) -> _Plan:
    """Open the source tag and check every option against it (every rank: nothing written yet)."""
    config = options.get("config")
    master_weights = options.get("master_weights", "keep")
    if master_weights not in ("keep", "drop"):
        raise CheckpointError(f"--master-weights must be keep or drop, not {master_weights!r}")
    cfg = load_config(config) if isinstance(config, (str, Path)) else (dict(config) if config else None)
    name, src = _open_source(src_dir, cfg, param_order, options)
    layout.validate(src.model.dims)
    total, zero1 = _data_parallel(src, layout, options)
    fmt = options.get("format") or optimum.native_format(src.tag_dir, src.model.format)
    if fmt not in ("torch", "xser", "dcp"):
        raise CheckpointError(f"--format {fmt} is not one NxD's or torchtitan's trainer writes: use torch, xser or dcp")
    master = master_weights == "keep" and src.zero1 is not None and src.zero1.master and fmt != "dcp"
    mode = options.get("nxd_mode") or src.mode
    if options.get("nxd_mode") is None and mode == AVOID_LP and fmt != "xser":
        mode = DEFAULT  # NxD leaves model data out only in xser: elsewhere the weights are written from the masters
    if layout.ep > 1 and (fmt == "dcp" or mode == ZERO1_DCP):
        raise CheckpointError("--ep > 1 is written in NxD's default or avoid-lp mode only, not through DCP")
    if fmt != "dcp":
        groups = len(src.zero1.hyper) if src.zero1 is not None else 1
        check_mode(mode, use_xser=fmt == "xser", master=master, zero1=zero1, groups=groups, layout=layout)
    per_rank = total // layout.ep if zero1 and total is not None else 1
    plan = _Plan(src, name, layout, per_rank, zero1, fmt == "xser", master, model_dtype(src), mode, fmt)
    plan.data_parallel = total
    return plan


def _open_source(
    src_dir: Path, cfg: dict[str, Any] | None, param_order: ParamOrder, options: TrainingReshardOptions
) -> tuple[str, Source]:
    """The source tag: an NxD (or shardkit) tag, or a torchtitan DCP checkpoint (its step-<N>)."""
    titan = titan_step_dir(src_dir, options.get("tag"))
    if titan is not None:
        opened = open_titan(titan, cfg)
        plain = {SCHEDULER: opened.scheduler, USER_CONTENT: opened.user_content}
        return f"step_{opened.step}", Source(titan, opened.model, opened.optimizer, True, "default", plain)
    src_dir, name = tag_to_read(src_dir, options.get("tag"), "shardkit reshard DIR DST")
    return name, open_training_tag(src_dir / name, cfg, options.get("hints"), param_order)


def reshard_training(
    src_dir: str | Path,
    dst: str | Path,
    layout: Layout,
    *,
    param_order: list[list[str]] | None = None,
    job: Job | None = None,
    sink: Sink = NO_SINK,
    **options: Unpack[TrainingReshardOptions],
) -> Path:
    """Write checkpoint `src_dir` (its newest complete tag, or `tag`) as a training checkpoint root
    `dst` (`dst/<tag>/...`) for `layout` and `dp` data-parallel ranks, in NxD's format, through the
    I/O core's staged output (nothing of it exists until it is complete; the source is checked
    against its manifest and for changes before the commit; `sink`: where its finished files go,
    `io.safety.sinks`). Returns the tag folder written."""
    job = job or current_job()
    src_dir, dst = Path(src_dir), Path(dst)
    plan = job.run_all_or_none(lambda: _plan(src_dir, layout, param_order, options))
    if plan.fmt == "dcp":
        return _to_titan(src_dir, dst, plan, job, options, sink)
    started = time.monotonic()
    with staged_output(dst, sources=[src_dir, plan.src.tag_dir], what="ckpt reshard", job=job, sink=sink) as out:
        if job.leader:
            plan.check = tag_check(plan.src.tag_dir, options.get("verify_hashes", True), plan.src.model.store)
        out_tag = out.path / plan.name
        job.run_all_or_none(lambda: _begin_tag(out_tag) if job.leader else None)
        mine = job.run_all_or_none(lambda: _write_mine(job, plan, out_tag, out.sink))
        written = [f for part in job.gather(mine) for f in part]
        commit_all(out, job, lambda staging: _finish_tag(plan, out_tag, written))
    src = plan.src
    log.info(
        "resharded %s (%s, dp %s) to %s (%s, dp %s%s) in %.1fs",
        src.tag_dir,
        src.model.layout.describe(),
        source_parallelism(src)[0] or "?",
        dst / plan.name,
        layout.describe(),
        plan.data_parallel or "?",
        ", ZeRO-1" if plan.zero1 else "",
        time.monotonic() - started,
    )
    return dst / plan.name


def _to_titan(
    src_dir: Path, dst: Path, plan: _Plan, job: Job, options: TrainingReshardOptions, sink: Sink = NO_SINK
) -> Path:
    """The training state as a torchtitan DCP checkpoint `dst/step-<N>` (`checkpoint.dcp`)."""
    src = plan.src
    step = int(_step(src, plan.name) or 0)
    content, scheduler = _plain_value(src, USER_CONTENT), _plain_value(src, SCHEDULER)
    weights = src.model if src.has_data or src.zero1 is None else master_weights_view(src.model, src.zero1)
    write = TitanWrite(
        weights,
        src.zero1,
        plan.layout,
        options.get("convention") or TITAN,
        step,
        kept_items(content, scheduler, step),
        plan.dtype,
    )
    check = tag_check(src.tag_dir, options.get("verify_hashes", True), src.model.store) if job.leader else None
    out = write_titan(src_dir, dst, write, job, check, sink)
    log.info("wrote %s as a torchtitan checkpoint %s (%s names)", src.tag_dir, out, write.convention)
    return out


def _plain_value(src: Source, name: str) -> Any:
    """scheduler.pt's or user_content.pt's value: given with the source, or read from the tag."""
    if src.plain.get(name) is not None:
        return src.plain[name]
    path = src.tag_dir / name
    return load_small(path, name, within=src.tag_dir) if os.path.lexists(path) else None


def _begin_tag(out_tag: Path) -> None:
    out_tag.mkdir()
    write_marker(out_tag, CHECKPOINT_MARKER, fsync=False)
    (out_tag / MODEL_DIR).mkdir()


def _write_mine(job: Job, plan: _Plan, out_tag: Path, sink: Sink = NO_SINK) -> list[str | FileRecord]:
    """This process's share of the target (ep, tp, pp) ranks (their model and optimizer files)."""
    units = sorted(plan.layout.ranks(), key=lambda r: (r[2], r[1], r[0]))  # pp, tp, ep: stage by stage
    mine = job.share(units)
    files: list[Path | FileRecord] = []
    if plan.mode != AVOID_LP:
        files += write_model_files(plan.src, out_tag, plan.layout, mine, plan.use_xser, sink)
    readers = RankReaders(plan.src)
    stages = stage_sizes(plan.src.model, plan.layout) if plan.mode == ZERO1_DCP else None
    try:
        zero1 = plan.src.zero1
        if zero1 is not None and plan.mode != ZERO1_DCP:
            outputs = [
                out
                for rank in mine
                for out in optimizer_outputs(readers, plan.layout, rank, plan.dp, plan.use_xser, plan.master)
            ]
            fmt = "xser" if plan.use_xser else "torch"
            options = WriteOptions(fmt=fmt, verify_hashes=NONE, archive=readers.archives[1], sink=sink)
            files += execute(zero1.view(), outputs, out_tag, options)
        with one_torch_thread(), reused_buffers():  # copies, each tensor written and dropped before the next
            for rank in mine:
                args = (plan.layout, rank, plan.dp, plan.use_xser, plan.master, plan.dtype, plan.mode, stages)
                files += write_rank(out_tag, readers, *args, sink=sink)
        return [f if isinstance(f, FileRecord) else str(f) for f in files]
    finally:
        readers.close()


def _finish_tag(plan: _Plan, out_tag: Path, written: list[str | FileRecord]) -> None:
    """Leader, after every rank's files: the plain files, config, manifest; the source checked
    (unchanged, and every listed file matching its digest); `done` last."""
    src = plan.src
    records = [f for f in written if isinstance(f, FileRecord)]  # hashed as written (and maybe sent away)
    files = [Path(f) for f in written if isinstance(f, str)]
    files += finish_optim(out_tag, records)
    for plain in (SCHEDULER, USER_CONTENT):
        if src.plain.get(plain) is not None:
            files += save_object(out_tag / plain, src.plain[plain], False)
        elif os.path.lexists(src.tag_dir / plain):
            copy_small(src.tag_dir / plain, out_tag / plain, plain, within=src.tag_dir, limit=PICKLE_LIMIT)
            files.append(out_tag / plain)
    write_text(out_tag / CONFIG, json.dumps(src.model.config, indent=2) + "\n", fsync=False)
    files.append(out_tag / CONFIG)
    data = manifest(
        fmt="xser" if plan.use_xser else "torch",
        family=src.model.family.name,
        layout=plan.layout,
        dtype=str(plan.dtype).replace("torch.", ""),
        records=[file_record(f, out_tag) for f in files]
        + [FileRecord(r.path, r.size, r.sha256, r.xxh3_128) for r in records],
        tensors=src.model.full_shapes,
        source=str(src.tag_dir),
        command="ckpt reshard",
        checkpoint={
            "tag": plan.name,
            "step": _step(src, plan.name),
            "dp": plan.dp,
            "data_parallel": plan.data_parallel,
            "zero1": plan.zero1,
            "master_weights": plan.master,
            "nxd": True,
            "nxd_mode": plan.mode,
        },
    )
    write_text(out_tag / MANIFEST, json.dumps(data, indent=2) + "\n", fsync=False)
    if plan.check is not None:
        plan.check.finish()
    write_marker(out_tag, DONE_MARKER, fsync=True)


def _step(src: Source, name: str) -> int | None:
    from .tree import tag_step

    if src.zero1 is not None and src.zero1.step is not None:
        return int(src.zero1.step)
    return tag_step(name)


__all__ = [
    "reshard_training",
    "open_training_tag",
    "model_checkpoint",
    "Source",
    "model_has_data",
    "write_rank",
    "write_model_files",
    "optimizer_outputs",
    "RankReaders",
]


def inspect_training(
    src_dir: str | Path,
    tag: str | None = None,
    config: Any = None,
    param_order: list[list[str]] | None = None,
    store: Store | None = None,
) -> dict[str, Any]:
    """What a training checkpoint tag holds: layout incl. dp and ZeRO-1, param groups and their
    hyper-parameters, step, master weights, optimizer bytes. `src_dir` is a checkpoint directory
    (its newest complete tag, or `tag`) or a tag folder (read through `store`, default itself)."""
    titan = titan_step_dir(Path(src_dir), tag)
    if titan is not None:
        return inspect_titan(titan, config)
    src_dir, name = tag_to_read(src_dir, tag, "shardkit inspect DIR")
    src = open_training_tag(src_dir / name, config, None, param_order, store)
    zero = src.zero1
    data_parallel, zero1 = source_parallelism(src)
    optim_bytes = 0
    if zero is not None:
        for path in zero.files.values():
            for f in [path, Path(str(path) + ".info.pt"), *sorted(Path(str(path) + ".tensors").glob("*"))]:
                if f.is_file():
                    optim_bytes += f.stat().st_size
    groups = []
    if zero is not None:
        order = zero.orders[(0, 0, 0)]
        for g, hyper in enumerate(zero.hyper):
            groups.append(
                {
                    "hyper": {k: v for k, v in hyper.items()},
                    "parameters_on_tp0_pp0": [n for n, gi in zip(order.names, order.groups) if gi == g],
                }
            )
    return {
        "tag": name,
        "path": str(src_dir / name),
        "format": src.model.format,
        "layout": src.model.layout.to_dict(),
        "describe": src.model.layout.describe(),
        "dp": zero.dp if zero else None,
        "data_parallel": data_parallel,
        "zero1": zero1,
        "step": _whole(zero.step) if zero else _step(src, name),
        "master_weights": bool(zero and zero.master),
        "model_has_data": src.has_data,
        "nxd_mode": src.mode,
        "param_groups": groups,
        "optimizer_bytes": optim_bytes,
        "lora": _lora_info(src.model),
    }


def _whole(step: float | None) -> float | int | None:
    """A step as people write it: 20, not 20.0 (optimizer files keep it as a float)."""
    return int(step) if isinstance(step, float) and step.is_integer() else step


def _lora_info(model: Checkpoint) -> dict[str, Any] | None:
    """What an adapter checkpoint's adapters are and what they were trained on (None: full weights)."""
    settings = saved_settings(model.config)
    if settings is None:
        return None
    return {
        **settings.to_dict(),
        "base_model": settings.base_model,
        "base_model_type": base_config(model.config).get("model_type"),
        "trained_parameters": sum(math.prod(s) for s in model.full_shapes.values()),
    }
