"""The one engine behind convert, merge and reshard: plan output files, then stream them.

A *plan* lists the output files and, for each, the pieces it holds (target names and the slices
of full tensors they are made of). The *executor* builds each output file by locating those
slices in the source checkpoint (`SegmentIndex.locate`), reading only them, concatenating, and
handing each tensor to a streaming writer. Sources are read positionally (nothing is
memory-mapped), so memory stays near one output file (torch, xser) or one block of rows
(safetensors) per worker, whatever the model size. Output goes to a staging directory renamed into place at the end. Under torchrun the
output files are divided among the job's processes (distributed.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from . import __version__
from .distributed import current_job
from .errors import DestinationExistsError, FormatError, ShardkitError
from .formats import MANIFEST, Checkpoint, open_checkpoint
from .formats import hf, nxd
from .formats.base import DTYPE_NAMES, FileRecord, TensorSpec
from .formats.safetensors_io import SafetensorsWriter
from .formats.torch_io import TorchWriter
from .formats.xser import XserWriter
from .hub import resolve_source
from .layout import FULL, HW_TO_REPLICATION, Layout
from .placements import Piece, Read, Segment, SegmentIndex, build_piece, make_piece

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
"""Called as progress(bytes_done_now, bytes_total) while output is written."""

SHARD_FORMATS = ("torch", "xser", "safetensors")


# ---- reading ---------------------------------------------------------------------------------


class SourceReader:
    """Reads slices of a checkpoint's pieces. Readers hold only metadata and a file descriptor
    (bytes are read positionally, nothing is mapped), so files stay open, up to `max_open`."""

    def __init__(self, ckpt: Checkpoint, max_open: int = 256, index: SegmentIndex | None = None):
        self.ckpt = ckpt
        self.index = index or ckpt.index()
        self.max_open = max_open
        self._open: OrderedDict[str, Any] = OrderedDict()

    def _file(self, key: str):
        if key in self._open:
            self._open.move_to_end(key)
        else:
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)[1].close()
            self._open[key] = self.ckpt.open(key)
        return self._open[key]

    def read(self, r: Read) -> torch.Tensor:
        """One read: a slice of a source piece, in the full tensor's orientation."""
        file = self._file(r.holder)
        if r.slab is None and not r.transposed:
            tensor = file.read(r.piece_name, r.dim, r.start, r.stop)
        else:
            base = file.read(r.piece_name, 0, r.slab, r.slab + 1)[0] if r.slab is not None else file.read(r.piece_name)
            tensor = r.take(base)
        return tensor

    def read_segment(self, seg: Segment) -> torch.Tensor:
        parts = [self.read(r) for r in self.index.locate(seg)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=seg.dim)

    def read_piece(self, piece: Piece) -> torch.Tensor:
        if piece.stacked or piece.transposed or piece.cat_dim != 0:
            return build_piece(piece, self.read_segment)
        reads = [r for seg in piece.slabs[0] for r in self.index.locate(seg)]
        if len(reads) == 1:
            return self.read(reads[0])
        # several blocks of rows: read each straight into its place, no concatenation copy
        out = torch.empty(piece.shape, dtype=self.dtype_of(piece.slabs[0][0].source))
        row = 0
        for r in reads:
            block = out.narrow(0, row, r.stop - r.start)
            file = self._file(r.holder)
            if r.slab is not None or not getattr(file, "read_into", None) or not file.read_into(
                    r.piece_name, r.start, r.stop, block):
                block.copy_(self.read(r))
            row += r.stop - r.start
        return out

    def row_blocks(self, piece: Piece):
        """A piece as consecutive blocks of rows, when its bytes are simply its reads one after
        another (one slab, concatenated along dim 0): streamed without assembling the piece."""
        if piece.stacked or piece.transposed or piece.cat_dim != 0:
            return None
        return (self.read(r) for seg in piece.slabs[0] for r in self.index.locate(seg))

    def dtype_of(self, source: str) -> torch.dtype:
        holdings = self.index.holdings(source)
        if not holdings:
            raise FormatError(f"no file holds {source}")
        return self._file(holdings[0].holder).dtype(holdings[0].piece_name)

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open.clear()


def open_source(src: str | Path | Checkpoint, config: str | Path | Mapping | None = None,
                hints: Mapping | None = None, revision: str | None = None) -> Checkpoint:
    """A checkpoint to read from: `src` itself, a local path, or a Hub repo id (fetched into the
    Hugging Face cache by `hub.resolve_source`; `revision` picks its branch, tag or commit)."""
    if isinstance(src, Checkpoint):
        return src
    return open_checkpoint(resolve_source(src, revision=revision), config, hints)


# ---- planning --------------------------------------------------------------------------------


@dataclass
class OutputFile:
    """One file to write: its path under the output root and the pieces it holds, in order."""

    path: str
    pieces: list[Piece]
    rank: tuple[int, int, int] | None = None

    @property
    def expert_parallel(self) -> list[str]:
        return [p.name for p in self.pieces if p.expert]

    def nbytes(self, itemsize: int) -> int:
        return sum(p.numel() for p in self.pieces) * itemsize


def plan_sharded(ckpt_family, dims, layout: Layout, fmt: str) -> list[OutputFile]:
    """Rank files of `layout` (NxD names), each with its pieces."""
    layout.validate(dims)
    shapes = ckpt_family.full_shapes(dims)
    outputs = []
    for ep, tp, pp in layout.ranks():
        pieces = ckpt_family.rank_pieces(layout, dims, tp, pp, shapes, ep)
        outputs.append(OutputFile(nxd.rank_file_name(ep, tp, pp, layout, fmt), pieces, (ep, tp, pp)))
    return outputs


def plan_full(ckpt_family, dims, itemsize: int, max_shard_size: int | str) -> tuple[list[OutputFile], dict | None]:
    """Hugging Face safetensors files holding every full tensor, split by size."""
    shapes = ckpt_family.full_shapes(dims)
    split_dims = ckpt_family.split_dims(dims)
    pieces = {}
    for name, shape in shapes.items():
        dim = split_dims[name]
        pieces[name] = make_piece(name, [Segment(name, dim, 0, shape[dim] if shape else 1)], shapes)
    sizes = {n: p.numel() * itemsize for n, p in pieces.items()}
    files, index = hf.split_into_files(sizes, max_shard_size)
    return [OutputFile(f, [pieces[n] for n in names]) for f, names in files.items()], index


# ---- executing -------------------------------------------------------------------------------


def _writer(fmt: str, path: Path, root: Path, specs: list[TensorSpec], out: OutputFile):
    if fmt == "safetensors":
        return SafetensorsWriter(path, root, specs)
    if fmt == "xser":
        return XserWriter(path, root, specs, out.expert_parallel)
    if fmt == "torch":
        return TorchWriter(path, root, specs)
    raise ShardkitError(f"format {fmt!r} is unknown: use one of {', '.join(SHARD_FORMATS)}")


def execute(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    out_root: Path,
    fmt: str,
    dtype: torch.dtype | None = None,
    workers: int = 1,
    progress: ProgressCallback | None = None,
) -> list[FileRecord]:
    """Write every output file from `src`; returns the records of the files written."""
    index = src.index()
    probe = SourceReader(src, index=index)
    dtypes: dict[str, torch.dtype] = {}
    try:
        for out in outputs:
            for piece in out.pieces:
                source = piece.segments[0].source
                if source not in dtypes:
                    dtypes[source] = dtype or probe.dtype_of(source)
    finally:
        probe.close()
    total = sum(p.numel() * dtypes[p.segments[0].source].itemsize for o in outputs for p in o.pieces)
    done = 0
    lock = threading.Lock()

    def build(out: OutputFile) -> list[FileRecord]:
        nonlocal done
        specs = [TensorSpec(p.name, p.shape, dtypes[p.segments[0].source]) for p in out.pieces]
        writer = _writer(fmt, out_root / out.path, out_root, specs, out)
        reader = SourceReader(src, index=index)
        try:
            for piece, spec in zip(out.pieces, specs):
                blocks = reader.row_blocks(piece) if hasattr(writer, "write_chunks") else None
                if blocks is not None:
                    writer.write_chunks(piece.name, blocks)
                else:
                    tensor = reader.read_piece(piece)
                    if tensor.dtype != spec.dtype:
                        tensor = tensor.to(spec.dtype)
                    if tuple(tensor.shape) != piece.shape:
                        raise FormatError(f"{piece.name}: read shape {tuple(tensor.shape)}, expected {piece.shape}")
                    writer.write(piece.name, tensor)
                    del tensor
                if progress:
                    with lock:
                        done += spec.nbytes
                        progress(done, total)
        finally:
            reader.close()
        return writer.close()

    records: list[FileRecord] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the work is copies; torch's intra-op threads only contend
    try:
        if workers <= 1:
            for out in outputs:
                records += build(out)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for result in pool.map(build, outputs):
                    records += result
    finally:
        torch.set_num_threads(threads)
    return records


# ---- output directories ------------------------------------------------------------------------


def prepare_staging(dst: Path, overwrite: bool, sources: Sequence[Path] = ()) -> Path:
    """Check the destination and create a staging folder beside it (renamed to dst at the end)."""
    dst = Path(dst).absolute()
    for src in sources:
        src = Path(src).absolute()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ShardkitError(f"destination {dst} overlaps the source {src}: choose another destination")
    if dst.exists() and not dst.is_dir():
        raise DestinationExistsError(f"{dst} exists and is a file: choose another destination")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise DestinationExistsError(f"{dst} exists and is not empty: pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.parent / f".{dst.name}.shardkit-tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def commit_staging(staging: Path, dst: Path) -> None:
    """Put the finished staging folder in place of dst (replacing it when it exists)."""
    dst = Path(dst).absolute()
    if dst.exists():
        old = dst.parent / f".{dst.name}.shardkit-old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(staging, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, dst)


def produce(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    dst: Path,
    fmt: str,
    dtype: torch.dtype | None,
    workers: int,
    overwrite: bool,
    progress: ProgressCallback | None,
    finish: Callable[[Path, list[FileRecord]], None],
) -> list[FileRecord]:
    """Write `outputs` into a staging folder, let `finish` add its files, and rename to `dst`.

    In a torch.distributed job every rank writes its share of the files (see distributed.py)."""
    job = current_job()
    if job.leader:
        try:
            prepared: Any = prepare_staging(dst, overwrite, [src.root])
        except ShardkitError as e:
            prepared = e
    staging = job.broadcast(prepared if job.leader else None)
    if isinstance(staging, BaseException):
        raise staging
    try:
        mine = job.run_all_or_none(lambda: execute(src, job.share(list(outputs)), staging, fmt, dtype, workers,
                                                   progress if job.leader else None))
        records = sorted((r for part in job.gather(mine) for r in part), key=lambda r: r.path)

        def finish_and_rename() -> None:
            if job.leader:
                finish(staging, records)
                commit_staging(staging, dst)

        job.run_all_or_none(finish_and_rename)
        if job.world > 1:
            log.info("rank %d wrote %d of %d files", job.rank, len(mine), len(records))
    except BaseException:
        if job.leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return records


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _config_for_output(src: Checkpoint, dtype: torch.dtype | None) -> dict[str, Any]:
    config = dict(src.config)
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "dtype":
                config[key] = name
    return config


def _side_file_dirs(src: Checkpoint) -> list[Path]:
    return [src.root, src.root.parent] if src.kind == "sharded" and src.manifest is None else [src.root]


def _copy_side_files(src: Checkpoint, dst: Path) -> None:
    for folder in _side_file_dirs(src):
        if hf.copy_side_files(folder, dst):
            break


def _manifest(src: Checkpoint, layout: Layout, fmt: str, dtypes: str, records: list[FileRecord],
              command: str | None) -> dict[str, Any]:
    return {
        "shardkit": __version__,
        "kind": "sharded",
        "format": fmt,
        "family": src.family.name,
        "layout": layout.to_dict(),
        "dtype": dtypes,
        "source": str(src.root),
        "command": command,
        "tensors": {n: list(s) for n, s in src.full_shapes.items()},
        "files": [{"path": r.path, "size": r.size, "sha256": r.sha256} for r in records],
    }


# ---- the public operations ---------------------------------------------------------------------


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ShardkitError(f"dtype {dtype!r} is unknown: use one of bf16, fp16, fp32")
    return DTYPE_NAMES[dtype]


def make_layout(tp: int = 1, pp: int = 1, ep: int = 1, kv_multiplier: int = 1, kv_replication: str | None = None,
                hw: str | None = None, qkv: str = "separate") -> Layout:
    """A Layout from CLI-style options (`hw` trn1/trn2 is an alias for the replication)."""
    if hw is not None:
        if hw not in HW_TO_REPLICATION:
            raise ShardkitError(f"hardware {hw!r} is unknown: use trn1 or trn2")
        if kv_replication and kv_replication != HW_TO_REPLICATION[hw]:
            raise ShardkitError(f"--hw {hw} means {HW_TO_REPLICATION[hw]} replication, not {kv_replication}")
        kv_replication = HW_TO_REPLICATION[hw]
    return Layout(tp=tp, pp=pp, ep=ep, kv_multiplier=kv_multiplier, kv_replication=kv_replication or "interleaved", qkv=qkv)


@dataclass
class Result:
    """What an operation wrote."""

    path: Path
    files: list[FileRecord]
    layout: Layout
    format: str

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def reshard(
    src: str | Path | Checkpoint,
    dst: str | Path,
    layout: Layout,
    *,
    format: str = "torch",
    dtype: str | torch.dtype | None = None,
    workers: int = 1,
    overwrite: bool = False,
    config: str | Path | Mapping | None = None,
    hints: Mapping | None = None,
    progress: ProgressCallback | None = None,
    command: str | None = None,
    revision: str | None = None,
) -> Result:
    """Write `src` (any checkpoint: a path or a Hub repo id) as shards of `layout` in `format`,
    reading only the slices each shard needs."""
    ckpt = open_source(src, config, hints, revision)
    if format not in SHARD_FORMATS:
        raise ShardkitError(f"format {format!r} is unknown: use one of {', '.join(SHARD_FORMATS)}")
    target_dtype = parse_dtype(dtype)
    layout.validate(ckpt.dims)
    ckpt.check_files()
    outputs = plan_sharded(ckpt.family, ckpt.dims, layout, format)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(ckpt, stage)
        dtype_name = str(target_dtype or ckpt.dtype()).replace("torch.", "")
        _write_json(stage / MANIFEST, _manifest(ckpt, layout, format, dtype_name, records, command))

    records = produce(ckpt, outputs, Path(dst), format, target_dtype, workers, overwrite, progress, finish)
    log.info("wrote %d files (%s) to %s", len(records), layout.describe(), dst)
    return Result(Path(dst), records, layout, format)


def convert(src: str | Path, dst: str | Path, layout: Layout, **options) -> Result:
    """Hugging Face checkpoint (directory or state-dict file) -> shards of `layout`."""
    return reshard(src, dst, layout, **options)


def merge(
    src: str | Path | Checkpoint,
    dst: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    workers: int = 1,
    overwrite: bool = False,
    config: str | Path | Mapping | None = None,
    hints: Mapping | None = None,
    progress: ProgressCallback | None = None,
    revision: str | None = None,
) -> Result:
    """Any checkpoint (a path or a Hub repo id) -> a Hugging Face model directory (safetensors +
    index + config)."""
    ckpt = open_source(src, config, hints, revision)
    target_dtype = parse_dtype(dtype)
    ckpt.check_files()
    itemsize = (target_dtype or ckpt.dtype()).itemsize
    outputs, index = plan_full(ckpt.family, ckpt.dims, itemsize, max_shard_size)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        if index is not None:
            _write_json(stage / "model.safetensors.index.json", index)
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(ckpt, stage)

    records = produce(ckpt, outputs, Path(dst), "safetensors", target_dtype, workers, overwrite, progress, finish)
    log.info("merged %s into %s (%d files)", ckpt.root, dst, len(records))
    return Result(Path(dst), records, FULL, "safetensors")
