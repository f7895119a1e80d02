"""The public operations, as users call them from Python (the CLI is a thin shell over these).

Each resolves its sources once (a local path, or a Hub repo id with `revision`, fetched into the
Hugging Face cache), opens them, and hands the opened checkpoints to the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from typing_extensions import Unpack

from .checkpoint import resolve_tag
from .checkpoint.reshard import TrainingReshardOptions, model_checkpoint
from .engine import (
    ProgressCallback,
    Result,
    TensorDiff,
    VerifyReport,
    WriteArgs,
    inspect_checkpoint,
    merge_checkpoint,
    no_full_collections,
    reshard_checkpoint,
    verify_checkpoints,
)
from .formats import Checkpoint, open_checkpoint
from .hub import resolve_source
from .io import remote as remote_io
from .io.location import RemoteLocation
from .io.location import remote as remote_location
from .io.transaction import recover_interrupted
from .io.upload import remote_output
from .layout import Layout, make_layout
from .paths import inside

__all__ = [
    "Result",
    "VerifyReport",
    "TensorDiff",
    "convert",
    "export_checkpoint",
    "inspect",
    "make_layout",
    "merge",
    "open_source",
    "reshard",
    "verify",
]

log = logging.getLogger(__name__)

ConfigArg = str | Path | Mapping[str, Any] | None


# ---- object storage (s3://): sources are read through local mirrors, outputs uploaded at the end ------


def _remote_options(src: object, options: dict[str, Any]) -> None:
    """A source in object storage is not re-hashed against its manifest: that would fetch every
    byte of every file, where an operation fetches only the ranges it uses (each GET is pinned to
    the object's ETag instead)."""
    if remote_location(src, "SRC") is not None and options.get("verify_hashes", True) not in (False, "none"):
        log.info("%s: the source's files are not re-hashed (only the byte ranges used are read)", src)
        options["verify_hashes"] = "none"


@contextlib.contextmanager
def _destination(dst: str | Path, overwrite: bool, sources: tuple[object, ...] = ()) -> Iterator[str | Path]:
    """The local folder to write `dst` into: `dst` itself, or for s3:// a staging folder
    uploaded once the operation succeeds (`io.upload.remote_output`)."""
    loc = remote_location(dst, "DST")
    if loc is None:
        yield dst
        return
    remote_sources = [
        r
        for r in (
            remote_io.location_of(s.root) if isinstance(s, Checkpoint) else remote_location(s, "SRC")
            for s in sources
            if isinstance(s, (str, Path, Checkpoint))
        )
        if r is not None
    ]
    with remote_output(loc, overwrite=overwrite, sources=remote_sources) as local:
        yield local


def _located(result: Result, dst: str | Path) -> Result:
    """`result` naming `dst` as given (an s3:// URL rather than the staging folder)."""
    return dataclasses.replace(result, path=dst if remote_location(dst) is not None else result.path)  # type: ignore[arg-type]


def _mirror_root(src: str | Path | RemoteLocation, whole: bool = True) -> remote_io.Mirror | None:
    loc = remote_location(src, "SRC")
    return None if loc is None else remote_io.open_prefix(loc, prepare=whole, whole=whole)


def open_source(
    src: str | Path | Checkpoint, config: ConfigArg = None, hints: Mapping | None = None, revision: str | None = None
) -> Checkpoint:
    """A checkpoint to read from: `src` itself, a local path, or a Hub repo id (fetched into the
    Hugging Face cache; `revision` picks its branch, tag or commit)."""
    if isinstance(src, Checkpoint):
        return src
    mirror = _mirror_root(src)
    if mirror is not None:  # s3://: a local mirror whose byte ranges are fetched as they are needed
        return open_checkpoint(mirror.root, config, hints)
    if not os.path.lexists(src):
        recover_interrupted(Path(src), log)  # a run killed while replacing it left it beside, renamed
    return open_checkpoint(resolve_source(src, revision=revision), config, hints)


@no_full_collections()
def reshard(
    src: str | Path | Checkpoint,
    dst: str | Path,
    layout: Layout,
    *,
    format: str = "torch",
    config: ConfigArg = None,
    hints: Mapping | None = None,
    revision: str | None = None,
    command: str | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Write `src` (any checkpoint: a path or a Hub repo id) as shards of `layout` in `format`,
    reading only the slices each shard needs. `options`: dtype, workers, overwrite, progress,
    verify_hashes, direct_io, sha256 (see `engine.WriteArgs`); `config`/`hints` describe NxD shards that lack
    them; `revision` picks a Hub repo's branch, tag or commit. `src` and `dst` may be
    s3://bucket/prefix."""
    _remote_options(src, options)  # type: ignore[arg-type]
    with remote_io.mirrors_scope(), _destination(dst, bool(options.get("overwrite")), (src,)) as out:
        ckpt = open_source(src, config, hints, revision)
        result = reshard_checkpoint(ckpt, out, layout, format=format, command=command, **options)
    return _located(result, dst)


def convert(src: str | Path, dst: str | Path, layout: Layout, **options: Any) -> Result:
    """Hugging Face checkpoint (directory, state-dict file or Hub repo id) -> shards of `layout`
    (the same options as `reshard`)."""
    return reshard(src, dst, layout, **options)


@no_full_collections()
def merge(
    src: str | Path | Checkpoint,
    dst: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    config: ConfigArg = None,
    hints: Mapping | None = None,
    revision: str | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Any checkpoint (a path or a Hub repo id) -> a Hugging Face model directory (safetensors +
    index + config), in files of at most `max_shard_size`. `options` as for `reshard`."""
    _remote_options(src, options)  # type: ignore[arg-type]
    with remote_io.mirrors_scope(), _destination(dst, bool(options.get("overwrite")), (src,)) as out:
        ckpt = open_source(src, config, hints, revision)
        result = merge_checkpoint(ckpt, out, max_shard_size=max_shard_size, **options)
    return _located(result, dst)


def inspect(
    path: str | Path,
    config: ConfigArg = None,
    hints: Mapping | None = None,
    check_data: bool = False,
    revision: str | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Describe a checkpoint: kind, format, family, layout, stages, files, tensors and problems.

    With `check_data`, also re-hash files against the manifest and compare every replicated
    copy of every slice (reads the whole checkpoint; `progress(bytes_done, bytes_total)` follows
    it), and say what was checked in the report's "checked"."""
    with remote_io.mirrors_scope():
        ckpt = open_source(path, config, hints, revision)
        report = inspect_checkpoint(ckpt, check_data, progress=progress)
        if remote_location(path) is not None:
            report["path"] = str(path)
    return report


@no_full_collections()
def verify(
    a: str | Path,
    b: str | Path,
    *,
    config_a: ConfigArg = None,
    config_b: ConfigArg = None,
    hints_a: Mapping | None = None,
    hints_b: Mapping | None = None,
    atol: float = 0.0,
    on_tensor: Callable[[TensorDiff], None] | None = None,
    revision_a: str | None = None,
    revision_b: str | None = None,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Compare two checkpoints (any formats and layouts; paths or Hub repo ids) tensor by tensor
    in full-weight space, streaming blocks of rows: bit-exact in the tensors' own dtype when
    `atol` is 0 and the dtypes agree, else within `atol` in float32. `progress(bytes_done,
    bytes_total)` counts the bytes of A's tensors."""
    with remote_io.mirrors_scope():
        ca, cb = open_source(a, config_a, hints_a, revision_a), open_source(b, config_b, hints_b, revision_b)
        return verify_checkpoints(ca, cb, atol=atol, on_tensor=on_tensor, names=(str(a), str(b)), progress=progress)


@no_full_collections()
def export_checkpoint(
    dir: str | Path,
    out: str | Path,
    tag: str | None = None,
    *,
    max_shard_size: int | str = "5GB",
    config: ConfigArg = None,
    hints: Mapping[str, Any] | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Merge a training checkpoint's model (the newest complete tag, or `tag`) into a Hugging Face
    model directory `out` (safetensors + index + config.json); `options` as for `merge`. `dir`
    and `out` may be s3://bucket/prefix."""
    _remote_options(dir, options)  # type: ignore[arg-type]
    with remote_io.mirrors_scope(), _destination(out, bool(options.get("overwrite")), (dir,)) as local_out:
        mirror = _mirror_root(dir, whole=False)
        root = mirror.root if mirror is not None else Path(dir)
        name = resolve_tag(root, tag)
        if name is None:
            raise AssertionError("resolve_tag returns a tag or raises when none is asked for by name")
        if mirror is not None:
            mirror.prepare(name)  # the tag's metadata; its tensors' bytes as the merge reads them
        # the tag's model files, or its fp32 master weights when the model files hold no data
        model = model_checkpoint(inside(root, name, "checkpoint tag"), config, hints)
        result = merge(model, local_out, max_shard_size=max_shard_size, **options)
    return _located(result, out)


@no_full_collections()
def reshard_training_checkpoint(
    src: str | Path,
    dst: str | Path,
    layout: Layout,
    *,
    param_order: str | Path | list[list[str]] | None = None,
    **options: Unpack[TrainingReshardOptions],
) -> Path | str:
    """Write the training checkpoint `src` (NxD's or shardkit's: model, ZeRO-1 optimizer shards,
    master weights, scheduler, user content) for `layout` and `dp` data-parallel ranks as a new
    checkpoint root `dst`, in NxD's format (see shardkit.checkpoint.reshard). `param_order`: a
    JSON file (or list) of parameter names per param group, when the optimizer's order cannot be
    recovered from the model files."""
    from .checkpoint.reshard import reshard_training
    from .checkpoint.zero1 import read_param_order

    order = read_param_order(param_order) if isinstance(param_order, (str, Path)) else param_order
    _remote_options(src, options)  # type: ignore[arg-type]
    with remote_io.mirrors_scope(), _destination(dst, False, (src,)) as out:
        mirror = _mirror_root(src, whole=False)
        root = _prepared_tag_root(mirror, options.get("tag")) if mirror is not None else src
        written = reshard_training(root, out, layout, param_order=order, **options)
    loc = remote_location(dst)
    return written if loc is None else str(loc.child(written.name))


def inspect_training_checkpoint(
    src: str | Path,
    tag: str | None = None,
    config: ConfigArg = None,
    param_order: str | Path | list[list[str]] | None = None,
) -> dict[str, Any]:
    """Layout (tp, pp, dp, ZeRO-1), param groups, step, master weights and optimizer bytes of a
    training checkpoint tag (see shardkit.checkpoint.reshard.inspect_training)."""
    from .checkpoint.reshard import inspect_training
    from .checkpoint.zero1 import read_param_order

    order = read_param_order(param_order) if isinstance(param_order, (str, Path)) else param_order
    with remote_io.mirrors_scope():
        mirror = _mirror_root(src, whole=False)
        root = _prepared_tag_root(mirror, tag) if mirror is not None else src
        info = inspect_training(root, tag, config, order)
    if mirror is not None and isinstance(info.get("path"), str):
        info["path"] = info["path"].replace(str(mirror.root), str(src), 1)
    return info


def _prepared_tag_root(mirror: remote_io.Mirror, tag: str | None) -> Path:
    """The mirror's root, with the metadata of the tag an operation reads fetched (the named
    tag, or the newest complete one)."""
    name = resolve_tag(mirror.root, tag)
    if name is not None:
        mirror.prepare(name)
    return mirror.root
