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

from .checkpoint import list_checkpoints
from .checkpoint.load import tag_to_read
from .checkpoint.lora import export_peft, merged_view, settings_of
from .checkpoint.reshard import TrainingReshardOptions, model_checkpoint
from .checkpoint.tree import is_checkpoint_root, tag_check
from .engine import (
    ProgressCallback,
    Result,
    TensorDiff,
    VerifyReport,
    WriteArgs,
    inspect_checkpoint,
    merge_checkpoint,
    no_full_collections,
    resave_changes,
    reshard_checkpoint,
    verify_checkpoints,
)
from .engine.check import check_atol
from .errors import FormatError, ShardkitError
from .formats import Checkpoint, open_checkpoint, optimum_neuron
from .formats.base import parse_dtype
from .formats.containers import fetch_metadata
from .hub import resolve_source
from .io.data import digest
from .io.data.digest import BLOCKS_KEY, FAST, NONE, check_mode, file_matches, recording_blocks
from .io.location import remote as remote_location
from .io.safety.sinks import NO_SINK, Sink
from .io.safety.transaction import recover_interrupted
from .io.store import TENSOR_SUFFIXES, MirrorStore, Need, Store, Unpredicted, open_store, prefix, remote_output, scope
from .layout import FULL, Layout, make_layout
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


@contextlib.contextmanager
def _destination(
    dst: str | Path, overwrite: bool, sources: tuple[object, ...] = (), replace: Any = ()
) -> Iterator[tuple[str | Path, Sink]]:
    """The local folder to write `dst` into, and the sink its writers hand each finished file to
    (`io.safety.sinks`): `dst` itself (nothing to do), or for s3:// a staging folder whose files
    are uploaded as they close and committed once the operation succeeds
    (`io.objects.upload.remote_output`; `replace`: the globs of `WriteArgs.replace_objects`)."""
    loc = remote_location(dst, "DST")
    if loc is None:
        yield dst, NO_SINK
        return
    remote_sources = [
        r
        for r in (
            s.store.location() if isinstance(s, Checkpoint) else remote_location(s, "SRC")
            for s in sources
            if isinstance(s, (str, Path, Checkpoint))
        )
        if r is not None
    ]
    patterns = [replace] if isinstance(replace, str) else list(replace or ())
    with remote_output(loc, overwrite=overwrite, sources=remote_sources, replace=patterns) as out, recording_blocks():
        yield out  # its manifest lists block digests: a later read of it streams (io.objects.remote)


def _located(result: Result, dst: str | Path) -> Result:
    """`result` naming `dst` as given (an s3:// URL rather than the staging folder)."""
    return dataclasses.replace(result, path=dst if remote_location(dst) is not None else result.path)  # type: ignore[arg-type]


def _streams(src: object, options: Mapping[str, Any]) -> bool:
    """Whether a source in object storage can be streamed (`io.objects.remote`: fetched a bounded window
    ahead of the engine and dropped once read, instead of fetched whole first): when it is not to
    be checked, has no manifest, or its manifest lists block digests of every file (outputs
    shardkit wrote to object storage do), so that each block is checked as it arrives."""
    import json

    from .formats.manifest import MANIFEST

    loc = remote_location(src, "SRC") if isinstance(src, (str, Path)) else None
    if loc is None:
        return False
    mode = check_mode(options.get("verify_hashes", True))
    if mode == NONE:
        return True
    raw = prefix(loc).get(MANIFEST)
    if raw is None:
        return True
    try:
        files = json.loads(raw).get("files", []) or []
        return mode == FAST and all(
            isinstance(f.get(BLOCKS_KEY), list) and f.get("block_size") == digest.BLOCK_SIZE for f in files
        )
    except (ValueError, AttributeError):
        return False  # the source's own check then says what is wrong with it


def _read_once(
    src: str | Path | Checkpoint,
    config: ConfigArg,
    hints: Mapping | None,
    revision: str | None,
    options: dict[str, Any],
    run: Callable[[Checkpoint, dict[str, Any]], Result],
) -> Result:
    """`run` an engine operation that reads all of `src` once (given the options it runs with, the
    source check settled): a source in object storage streamed where it can be (`_streams`). A
    streamed torch file laid out otherwise than torch.save lays it out (its predicted tensor
    offsets did not hold) is read again, fetched whole first, so any valid file is read right."""
    streamed = _streams(src, options)
    unchecked = check_mode(options.get("verify_hashes", True)) == NONE  # no digest asks for the bytes not read
    ckpt = open_source(
        src, config, hints, revision, Need.PLANNED if streamed and unchecked else Need.EVERYTHING, streamed
    )
    checked = dict(options)
    _check_fetched(ckpt, checked)
    try:
        return run(ckpt, checked)
    except Unpredicted as e:
        log.warning("%s: reading it again, fetched whole first", e)
        ckpt.store.close()
    ckpt = open_source(src, config, hints, revision, Need.EVERYTHING)
    checked = dict(options)
    _check_fetched(ckpt, checked)
    return run(ckpt, checked)


def _check_fetched(ckpt: Checkpoint, options: dict[str, Any]) -> None:
    """A source from object storage is checked against its manifest here: a streamed file's
    blocks as they arrive (`io.objects.remote.Mirror.check`, settled before the output is committed), any
    other file whole as it lies in the mirror, before anything is written (xxh3-128: 0.24 s for
    TinyLlama's 2.2 GB); the engine then does not check on read, which would have the merge read
    every shard in its worker instead of copying it by the kernel (2.5 s more on that merge)."""
    store = ckpt.store
    if not isinstance(store, MirrorStore) or not ckpt.manifest:
        return
    mode = check_mode(options.get("verify_hashes", True))
    if mode == NONE:
        return
    blocks = {}
    read = tuple(ckpt.files)
    for entry in ckpt.manifest.get("files", []) or []:
        listed = str(entry.get("path", ""))
        unread = not (listed in read or listed.startswith(tuple(f"{key}." for key in read)))
        if unread and (listed.endswith(TENSOR_SUFFIXES) or ".tensors/" in listed):
            continue  # tensors the operation does not read (a tag's optimizer files, for its model) are not fetched
        path = inside(Path(ckpt.root), listed, "file the manifest lists")
        if store.is_streamed(path) and isinstance(entry.get(BLOCKS_KEY), list):
            blocks[path.relative_to(store.root).as_posix()] = [str(b) for b in entry[BLOCKS_KEY]]
            continue  # checked block by block as it arrives (io.objects.remote), before the output is committed
        store.ensure(path)
        if not file_matches(path, entry, mode, store):
            raise FormatError(f"{store.shown(path)} does not match the digest its manifest lists: re-create it")
    if blocks:
        store.mirror.check(blocks, digest.BLOCK_SIZE)  # (the size `_streams` found every entry to list)
    options["verify_hashes"] = "none"


def _checkpoint_root(src: str | Path) -> Store | None:
    """The store of a training checkpoint root in object storage (its small objects fetched; the
    caller prepares the tag it reads), None for a local path."""
    loc = remote_location(src, "SRC")
    return None if loc is None else open_store(loc, output=False)


def open_source(
    src: str | Path | Checkpoint,
    config: ConfigArg = None,
    hints: Mapping | None = None,
    revision: str | None = None,
    need: Need = Need.METADATA,
    streamed: bool = False,
) -> Checkpoint:
    """A checkpoint to read from: `src` itself, a local path, a Hub repo id (fetched into the
    Hugging Face cache; `revision` picks its branch, tag or commit), or s3://bucket/prefix (a
    local mirror fetching what `need` says, then the ranges read; `streamed`: its tensor files
    are read once by an engine run, a bounded window at a time, see `io.objects.remote`)."""
    if isinstance(src, Checkpoint):
        return src
    loc = remote_location(src, "SRC")
    if loc is not None:
        store = open_store(loc, streamed=streamed)
        _refuse_checkpoint_root(store.root, str(src))  # before any of its tags is fetched
        store.prepare([store.root], need, fetch_metadata)
        return open_checkpoint(store.root, config, hints, store)
    if not os.path.lexists(src):
        recover_interrupted(Path(src), log)  # a run killed while replacing it left it beside, renamed
    else:
        _refuse_checkpoint_root(Path(src), str(src))
    return open_checkpoint(resolve_source(src, revision=revision), config, hints)


def _refuse_checkpoint_root(path: Path, src: str) -> None:
    """A training checkpoint directory given where a model is read: name `ckpt export` and a tag
    (optimum-neuron's checkpoint folder is a model, not a checkpoint root)."""
    if is_checkpoint_root(path) and optimum_neuron.shards_of(path) is None:
        tags = [i.tag for i in list_checkpoints(path, details=False) if i.loadable]
        example = f" ({src.rstrip('/')}/{tags[-1]})" if tags else ""
        raise FormatError(
            f"{src} is a training checkpoint directory, not a model: `shardkit ckpt export {src} OUT` merges its "
            f"newest complete tag (--tag picks another), or give one tag folder{example}"
        )


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
    convention: str | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Write `src` (any checkpoint: a path or a Hub repo id) as shards of `layout` in `format`,
    reading only the slices each shard needs. `options`: dtype, workers, overwrite, progress,
    verify_hashes, direct_io, sha256 (see `engine.WriteArgs`); `config`/`hints` describe NxD shards that lack
    them; `revision` picks a Hub repo's branch, tag or commit; `convention` names the tensors of
    a DCP output (`hf`, the default, or `torchtitan`: see shardkit.conventions). `src` and `dst`
    may be s3://bucket/prefix."""
    replace = options.get("replace_objects")
    with scope(), _destination(dst, bool(options.get("overwrite")), (src,), replace) as (out, sink):
        # not streamed: a reshard reads pieces more than once and reads copied bytes back to hash them;
        # checked by no digest, it fetches the ranges it plans to read (not a K/V head's other replicas)
        unchecked = check_mode(options.get("verify_hashes", True)) == NONE
        ckpt = open_source(src, config, hints, revision, Need.METADATA if unchecked else Need.EVERYTHING)
        _check_fetched(ckpt, options)  # type: ignore[arg-type]
        result = reshard_checkpoint(
            ckpt, out, layout, format=format, command=command, convention=convention, sink=sink, **options
        )
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
    replace = options.get("replace_objects")
    with scope(), _destination(dst, bool(options.get("overwrite")), (src,), replace) as (out, sink):
        result = _merge(src, out, sink, max_shard_size, dict(options), config, hints, revision)
    return _located(result, dst)


def _merge(
    src: str | Path | Checkpoint,
    out: str | Path,
    sink: Sink,
    max_shard_size: int | str,
    options: dict[str, Any],
    config: ConfigArg = None,
    hints: Mapping | None = None,
    revision: str | None = None,
    before_commit: Callable[[], None] | None = None,
) -> Result:
    """`merge` into the local folder `out`, its finished files handed to `sink` (`before_commit`:
    see `merge_checkpoint`)."""

    def run(ckpt: Checkpoint, checked: dict[str, Any]) -> Result:
        if settings_of(ckpt) is not None:
            shown = ckpt.store.shown(ckpt.root)
            raise FormatError(
                f"{shown} holds LoRA adapters, not a model: `shardkit ckpt export {shown} OUT` writes their "
                "PEFT adapter folder, and with --merged the model they were trained on with them merged in"
            )
        if not isinstance(src, Checkpoint):  # a view (a LoRA merge, an export) is never a plain re-save
            _refuse_resave(ckpt, max_shard_size, checked.get("dtype"))
        return merge_checkpoint(
            ckpt, out, max_shard_size=max_shard_size, sink=sink, before_commit=before_commit, **checked
        )

    return _read_once(src, config, hints, revision, options, run)


def _refuse_resave(ckpt: Checkpoint, max_shard_size: int | str, dtype: Any) -> None:
    """`merge` of a folder that is already a Hugging Face model: refused when the merge would write
    the same model again (nothing to merge), else said on one line (what the re-save changes:
    .bin to safetensors, the dtype, the file split)."""
    if ckpt.kind != "hf" or ckpt.single_file:
        return
    shown = ckpt.store.shown(ckpt.root)
    changes = resave_changes(ckpt, max_shard_size, parse_dtype(dtype))
    if not changes:
        raise FormatError(
            f"{shown} is already a Hugging Face model (safetensors, these dtypes and files): there is nothing to "
            "merge; copy it, give --dtype or --max-shard-size to re-save it otherwise, or `shardkit convert` it to shards"
        )
    log.warning("%s is already a Hugging Face model: merge re-saves it (%s)", shown, "; ".join(changes))


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
    with scope():
        ckpt = open_source(path, config, hints, revision, Need.EVERYTHING if check_data else Need.METADATA)
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
    ignore_dtype: bool = False,
) -> VerifyReport:
    """Compare two checkpoints (any formats and layouts; paths or Hub repo ids) tensor by tensor
    in full-weight space, streaming blocks of rows: bit-exact in the tensors' own dtype when
    `atol` (a finite number >= 0) is 0 and the dtypes agree, else within `atol` in float32. A
    tensor stored in different dtypes is a mismatch unless `ignore_dtype`; the report names them
    either way. `progress(bytes_done, bytes_total)` counts the bytes of A's tensors."""
    check_atol(atol)  # before anything is opened or fetched
    with scope():
        ca = open_source(a, config_a, hints_a, revision_a, Need.EVERYTHING)
        cb = open_source(b, config_b, hints_b, revision_b, Need.EVERYTHING)
        return verify_checkpoints(
            ca, cb, atol=atol, on_tensor=on_tensor, names=(str(a), str(b)), progress=progress, ignore_dtype=ignore_dtype
        )


@no_full_collections()
def export_checkpoint(
    dir: str | Path,
    out: str | Path,
    tag: str | None = None,
    *,
    max_shard_size: int | str = "5GB",
    config: ConfigArg = None,
    hints: Mapping[str, Any] | None = None,
    merged: bool = False,
    base: str | Path | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Merge a training checkpoint's model (the newest complete tag, or `tag`) into a Hugging Face
    model directory `out` (safetensors + index + config.json); `options` as for `merge`. `dir`
    and `out` may be s3://bucket/prefix.

    A LoRA adapter checkpoint (the trainer's `--lora-rank`) becomes a PEFT adapter folder, or with
    `merged` the Hugging Face model of its base with the adapters merged in: `base` (a model
    directory of any layout, or a Hub repo id) or else the base model the checkpoint records."""
    replace = options.get("replace_objects")
    with scope(), _destination(out, bool(options.get("overwrite")), (dir,), replace) as (local_out, sink):
        store = _checkpoint_root(dir)
        root, name = tag_to_read(store.root if store is not None else dir, tag, "shardkit merge DIR OUT")
        if store is not None:  # the model files whole (master weights in optim/: as the merge reads them)
            store.prepare([store.root / name / "model"], Need.EVERYTHING, fetch_metadata)
        # the tag's model files, or its fp32 master weights when the model files hold no data
        model = model_checkpoint(inside(root, name, "checkpoint tag"), config, hints, store=store)
        settings = settings_of(model)
        if settings is None:
            if merged or base is not None:
                raise ShardkitError(
                    f"{model.root} holds full weights, not LoRA adapters: --merged and --base apply to LoRA "
                    "checkpoints only; leave them out"
                )
            result = _merge(model, local_out, sink, max_shard_size, dict(options))
        else:
            result = _export_lora(model, local_out, sink, settings.base_model, merged, base, max_shard_size, options)
    return _located(result, out)


def _export_lora(
    model: Checkpoint,
    out: str | Path,
    sink: Sink,
    recorded: str | None,
    merged: bool,
    base: str | Path | None,
    max_shard_size: int | str,
    options: Any,
) -> Result:
    """`export_checkpoint` of a LoRA adapter checkpoint: its PEFT folder, or `merged` its base model
    (`base`, else the one the checkpoint records) with the adapters merged in; each finished file
    of `out` handed to `sink`."""
    base_model = str(base) if base is not None else recorded
    if not merged:
        verify = options.get("verify_hashes", True) not in (False, "none")
        dtype = parse_dtype(options.get("dtype"))
        records = export_peft(
            model,
            out,
            base_model,
            dtype=dtype,
            overwrite=options.get("overwrite", False),
            verify_hashes=verify,
            sink=sink,
        )
        return Result(Path(out), records, FULL, "peft")
    if base_model is None:
        raise ShardkitError(
            f"{model.root} does not record its base model: pass --base DIR (the model the adapters were trained on)"
        )
    if base is None and remote_location(base_model) is None and not os.path.lexists(base_model):
        raise ShardkitError(
            f"the base model {model.root} records, {base_model}, does not exist (moved or deleted?): pass --base DIR"
        )
    base_ckpt = open_source(base_model, need=Need.EVERYTHING)
    check = tag_check(model.root, options.get("verify_hashes", True), model.store)
    try:  # the adapters' tag held from before the merge reads it until its commit
        return _merge(
            merged_view(base_ckpt, model), out, sink, max_shard_size, dict(options), before_commit=check.finish
        )
    finally:
        check.stop()


@no_full_collections()
def reshard_training_checkpoint(
    src: str | Path,
    dst: str | Path,
    layout: Layout | Callable[[dict[str, Any]], Layout],
    *,
    param_order: str | Path | list[list[str]] | None = None,
    **options: Unpack[TrainingReshardOptions],
) -> Path | str:
    """Write the training checkpoint `src` (NxD's or shardkit's: model, ZeRO-1 optimizer shards,
    master weights, scheduler, user content) for `layout` and `dp` data-parallel ranks as a new
    checkpoint root `dst`, in NxD's format (see shardkit.checkpoint.reshard). `layout` may be a
    function of the source tag's `inspect_training_checkpoint` (the CLI's "a dimension not given
    is the source's"): the tag is then read once, also from object storage. `param_order`: a JSON
    file (or list) of parameter names per param group, when the optimizer's order cannot be
    recovered from the model files."""
    from .checkpoint.reshard import inspect_training, reshard_training
    from .checkpoint.zero1 import read_param_order

    order = read_param_order(param_order) if isinstance(param_order, (str, Path)) else param_order
    with scope(), _destination(dst, False, (src,)) as (out, sink):
        store = _checkpoint_root(src)
        root = _prepared_tag_root(store, options.get("tag"), Need.EVERYTHING) if store is not None else src
        if not isinstance(layout, Layout):
            layout = layout(inspect_training(root, options.get("tag"), options.get("config"), order))
        written = reshard_training(root, out, layout, param_order=order, sink=sink, **options)
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
    with scope():
        store = _checkpoint_root(src)
        root = _prepared_tag_root(store, tag, Need.METADATA) if store is not None else src
        info = inspect_training(root, tag, config, order, store)
    if store is not None and isinstance(info.get("path"), str):
        info["path"] = info["path"].replace(str(store.root), str(src), 1)
    return info


def _prepared_tag_root(store: Store, tag: str | None, need: Need) -> Path:
    """The mirror's root, with what `need` says of the tag an operation reads fetched (the named
    tag, or the newest complete one, or the root itself when it is a tag). A root without tags is
    left as it is: the operation says what it is."""
    try:
        root, name = tag_to_read(store.root, tag, "shardkit reshard DIR DST")
    except ShardkitError:
        return store.root
    store.prepare([root / name], need, fetch_metadata)
    return store.root
