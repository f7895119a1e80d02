"""`shardkit ckpt reshard`: a whole NxD training state (model, ZeRO-1 optimizer shards, master
weights) written for another tp / pp / dp / kv-multiplier layout, in NxD's exact format.

The unit of work is one (tp, pp) rank of the target: its model file and its D optimizer files
(one per dp rank). Its pieces are read slice by slice from the source (moments through
`Zero1Tag.view`, resharded like their parameters: kv replicas, fused gate_up, vocab rows, dp
padding), so memory is one target rank's state. Under torchrun the units are divided among the
processes. Everything is written into a staging folder beside DST, `done` last, and renamed
into place: a failure on any process leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from typing_extensions import Unpack

from ..distributed import Job, current_job
from ..formats import Checkpoint, SourceReader, load_config, open_checkpoint
from ..formats.manifest import MANIFEST, file_record, manifest
from ..layout import Layout
from ..placements import Piece
from .base import CheckpointError
from .load import resolve_tag
from .tree import CHECKPOINT_MARKER, CONFIG, DONE_MARKER, MODEL_DIR, SCHEDULER, USER_CONTENT, write_marker
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
    save_object,
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

    @property
    def use_xser(self) -> bool:
        return self.model.format == "xser"


Hints = Mapping[str, Any] | None  # layout facts the files cannot tell (kv_replication)
ParamOrder = list[list[str]] | None  # parameter names per optimizer param group


def open_training_tag(tag_dir: Path, config: Any = None, hints: Hints = None, param_order: ParamOrder = None) -> Source:
    """Open a tag (NxD's or shardkit's) and check its optimizer files against its model files."""
    tag_dir = Path(tag_dir)
    if config is None and not (tag_dir / CONFIG).is_file():
        raise CheckpointError(
            f"{tag_dir} has no config.json (NxD checkpoints carry none): pass the model's "
            "Hugging Face config with --config"
        )
    model = open_checkpoint(tag_dir, config, hints)
    zero = Zero1Tag.open(tag_dir, model, param_order)
    return Source(tag_dir, model, zero, model_has_data(model))


def model_checkpoint(
    tag_dir: Path, config: Any = None, hints: Hints = None, param_order: ParamOrder = None
) -> Checkpoint:
    """A tag's model as the engine reads it (merge, export): its model files, or, when they hold no
    tensor data (NxD's avoid_saving_lower_precision_weights), its fp32 master weights in the
    model's dtype under the model's names."""
    src = open_training_tag(tag_dir, config, hints, param_order)
    if src.has_data:
        return src.model
    if src.zero1 is None:
        raise CheckpointError(
            f"{tag_dir}: the model files hold no tensor data and there are no optimizer files "
            "with master weights: the checkpoint holds no weights"
        )
    return master_weights_view(src.model, src.zero1)


def model_dtype(src: Source) -> torch.dtype:
    return src.model.dtype() if src.has_data else stored_dtype(src.model)


@dataclass
class RankReaders:
    """Readers of a source's model and optimizer views (one per process, closed at the end)."""

    src: Source
    model: SourceReader | None = None
    optim: SourceReader | None = None
    groups: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.src.zero1 is not None:
            self.optim = SourceReader(self.src.zero1.view())
            self.groups = self.src.zero1.group_of()
        if self.src.has_data:
            self.model = SourceReader(self.src.model)

    def weights(self, pieces: list[Piece], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {}
        for p in pieces:
            if self.model is not None:
                t = self.model.read_piece(p)
            elif self.optim is not None and self.src.zero1 is not None and self.src.zero1.master:
                t = self.optim.read_piece(prefixed(p, MASTER + SEP)).to(dtype)
            else:
                raise CheckpointError(
                    f"{self.src.tag_dir}: the model files hold no weights and the optimizer files "
                    "no master weights: the checkpoint has no weights to read"
                )
            out[p.name] = t.contiguous().clone()
        return out

    def state(self, pieces: list[Piece], moments: list[str]) -> dict[str, dict[str, Any]]:
        assert self.optim is not None and self.src.zero1 is not None
        out: dict[str, dict[str, Any]] = {}
        for p in pieces:
            entry: dict[str, Any] = {
                m: self.optim.read_piece(prefixed(p, m + SEP)).contiguous().clone() for m in moments
            }
            entry["step"] = self.src.zero1.step
            out[p.name] = entry
        return out

    def group(self, piece: Piece) -> int:
        return self.groups.get(piece.segments[0].source, 0)

    def close(self) -> None:
        for r in (self.model, self.optim):
            if r is not None:
                r.close()


def write_rank(
    out_tag: Path,
    readers: RankReaders,
    layout: Layout,
    tp: int,
    pp: int,
    dp: int,
    use_xser: bool,
    master: bool,
    dtype: torch.dtype,
) -> list[Path]:
    """One target (tp, pp) rank: its model file and its dp optimizer files (NxD's format)."""
    src = readers.src
    pieces = src.model.family.rank_pieces(layout, src.model.dims, tp, pp, src.model.full_shapes)
    written: list[Path] = []
    weights = readers.weights(pieces, dtype)
    model_path = out_tag / MODEL_DIR / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
    written += save_object(model_path, weights, use_xser)
    del weights
    if src.zero1 is not None:
        moments = [*MOMENTS, MASTER] if master else list(MOMENTS)
        state = readers.state(pieces, moments)
        names = [p.name for p in pieces]
        groups = [readers.group(p) for p in pieces]
        for d in range(dp):
            obj = build_optim(names, groups, src.zero1.hyper, state, dp, d, master)
            written += save_object(out_tag / optim_name(d, tp, pp), obj, use_xser)
    return written


def _staging(dst: Path) -> Path:
    if dst.exists():
        raise CheckpointError(f"{dst} exists: give a new directory for the resharded checkpoint")
    if not dst.parent.is_dir():
        raise CheckpointError(f"{dst.parent} does not exist: create it first")
    staging = dst.parent / f".{dst.name}.shardkit-tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


class TrainingReshardOptions(TypedDict, total=False):
    """How `reshard_training` reads its source and writes the new training checkpoint."""

    dp: int
    """Data-parallel ranks of the new layout: the number of ZeRO-1 optimizer shards (default 1)."""
    zero1: bool
    """One optimizer file per dp rank (default True), or one unsharded file per (tp, pp)."""
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


def reshard_training(
    src_dir: str | Path,
    dst: str | Path,
    layout: Layout,
    *,
    param_order: list[list[str]] | None = None,
    job: Job | None = None,
    **options: Unpack[TrainingReshardOptions],
) -> Path:
    """Write checkpoint `src_dir` (its newest complete tag, or `tag`) as a training checkpoint root
    `dst` (`dst/<tag>/...`) for `layout` and `dp` data-parallel ranks, in NxD's format. Returns
    the tag folder written."""
    job = job or current_job()
    dp, zero1, config = options.get("dp", 1), options.get("zero1", True), options.get("config")
    tag, format, hints = options.get("tag"), options.get("format"), options.get("hints")
    master_weights = options.get("master_weights", "keep")
    src_dir, dst = Path(src_dir), Path(dst)
    if master_weights not in ("keep", "drop"):
        raise CheckpointError(f"--master-weights must be keep or drop, not {master_weights!r}")
    if not isinstance(dp, int) or dp < 1:
        raise CheckpointError(f"--dp must be a whole number >= 1, got {dp!r}")
    cfg = load_config(config) if isinstance(config, (str, Path)) else (dict(config) if config else None)

    def plan() -> tuple[Source, Path, str]:
        name = resolve_tag(src_dir, tag)
        if name is None:
            raise CheckpointError(f"{src_dir} holds no complete checkpoint")
        src = open_training_tag(src_dir / name, cfg, hints, param_order)
        layout.validate(src.model.dims)
        fmt = format or src.model.format
        if fmt not in ("torch", "xser"):
            raise CheckpointError(f"--format {fmt} is not one NxD's trainer writes: use torch or xser")
        staging = _staging(dst) if job.leader else Path()
        return src, staging, name

    src, staging, name = job.run_all_or_none(plan)
    staging = Path(job.broadcast(str(staging)))
    use_xser = (format or src.model.format) == "xser"
    dpn = dp if zero1 else 1
    master = master_weights == "keep" and src.zero1 is not None and src.zero1.master
    out_tag = staging / name
    dtype = model_dtype(src)
    started = time.monotonic()
    try:

        def prepare() -> None:
            if job.leader:
                out_tag.mkdir()
                write_marker(out_tag, CHECKPOINT_MARKER, fsync=False)
                (out_tag / MODEL_DIR).mkdir()

        job.run_all_or_none(prepare)
        units = [(tp, pp) for pp in range(layout.pp) for tp in range(layout.tp)]

        def write_mine() -> list[str]:
            readers = RankReaders(src)
            try:
                files: list[Path] = []
                for tp, pp in job.share(units):
                    files += write_rank(out_tag, readers, layout, tp, pp, dpn, use_xser, master, dtype)
                return [str(f) for f in files]
            finally:
                readers.close()

        written = [f for part in job.gather(job.run_all_or_none(write_mine)) for f in part]

        def finish() -> None:
            if not job.leader:
                return
            for plain in (SCHEDULER, USER_CONTENT):
                if (src.tag_dir / plain).is_file():
                    shutil.copyfile(src.tag_dir / plain, out_tag / plain)
                    written.append(str(out_tag / plain))
            (out_tag / CONFIG).write_text(json.dumps(src.model.config, indent=2) + "\n")
            written.append(str(out_tag / CONFIG))
            records = [file_record(Path(f), out_tag) for f in written]
            data = manifest(
                fmt="xser" if use_xser else "torch",
                family=src.model.family.name,
                layout=layout,
                dtype=str(dtype).replace("torch.", ""),
                records=records,
                tensors=src.model.full_shapes,
                source=str(src.tag_dir),
                command="ckpt reshard",
                checkpoint={
                    "tag": name,
                    "step": _step(src, name),
                    "dp": dpn,
                    "zero1": bool(zero1),
                    "master_weights": master,
                    "nxd": True,
                },
            )
            (out_tag / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
            write_marker(out_tag, DONE_MARKER, fsync=True)
            os.rename(staging, dst)

        job.run_all_or_none(finish)
    except BaseException:
        if job.leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info(
        "resharded %s (%s, dp %d) to %s (%s, dp %d) in %.1fs",
        src.tag_dir,
        src.model.layout.describe(),
        src.zero1.dp if src.zero1 else 1,
        dst / name,
        layout.describe(),
        dpn,
        time.monotonic() - started,
    )
    return dst / name


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
    "RankReaders",
]


def inspect_training(
    src_dir: str | Path, tag: str | None = None, config: Any = None, param_order: list[list[str]] | None = None
) -> dict[str, Any]:
    """What a training checkpoint tag holds: layout incl. dp and ZeRO-1, param groups and their
    hyper-parameters, step, master weights, optimizer bytes. `src_dir` is a checkpoint directory
    (its newest complete tag, or `tag`) or a tag folder."""
    src_dir = Path(src_dir)
    if tag is None and (src_dir / CHECKPOINT_MARKER).is_file():
        src_dir, tag = src_dir.parent, src_dir.name
    name = resolve_tag(src_dir, tag)
    if name is None:
        raise CheckpointError(f"{src_dir} holds no complete checkpoint")
    src = open_training_tag(src_dir / name, config, None, param_order)
    zero = src.zero1
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
        "zero1": bool(zero and zero.dp > 1),
        "step": zero.step if zero else _step(src, name),
        "master_weights": bool(zero and zero.master),
        "model_has_data": src.has_data,
        "param_groups": groups,
        "optimizer_bytes": optim_bytes,
    }
