"""Loading a training checkpoint into any layout: this rank's pieces, read slice by slice.

The model part is an ordinary sharded checkpoint (`open_checkpoint(<tag>)`: the manifest gives
the saved layout; NxD tags without one have it inferred). The optimizer files hold each moment
as a prefixed copy of the model's pieces (`exp_avg::<piece>`), so the same `Checkpoint`
description with every piece name and segment source prefixed by `<moment>::` lets the engine's
`SourceReader` reshard moments exactly like their parameters. For every target piece only the
slices it is made of are read (positional reads of exactly those bytes); nothing is gathered to
full tensors.

Before any tensor is read, the tag is checked: complete (`done`), every listed file present with
its size, the config equal to the caller's, the files this rank reads holding the expected names
and shapes and (with `verify`) their digests equal to the manifest's. A failure raises a
ShardkitError and returns nothing: no rank state is ever loaded half-way.

"The latest checkpoint" (tag None or "latest_if_exists") is the newest complete tag that loads:
damaged tags (malformed manifest) are skipped, and a tag that fails its checks (missing,
truncated or corrupt files) is skipped for the next older one, with a warning naming the tag and
why. In a torch.distributed job only failures every rank sees alike (the manifest, the listed
files and their sizes) are skipped that way; a failure of one rank's own files (digests) raises,
since ranks resuming from different steps would be worse than stopping.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import ConfigMismatchError, FormatError
from ..formats import Checkpoint, SourceReader, load_config
from ..formats.containers import fetch_metadata
from ..formats.source_check import HashCheck
from ..formats.torch_io import load_small
from ..io.data.digest import FAST
from ..io.location import remote as remote_location
from ..io.store import Need, Store, open_store, scope
from ..layout import Layout, ModelDims
from ..paths import UnsafePathError, inside
from ..placements import Piece, Read
from .base import (
    IncompleteCheckpointError,
    LoadedCheckpoint,
    NoCheckpointError,
    OptimizerState,
    Rank,
    distributed_rank,
)
from .nxd_modes import check_masters, open_model, open_optimizer
from .optimum import find_tag
from .tree import (
    CONFIG,
    MODEL_DIR,
    OPTIM_DIR,
    SCHEDULER,
    USER_CONTENT,
    CheckpointInfo,
    is_complete,
    is_tag,
    list_checkpoints,
    model_folder_kind,
    shown_tag,
    tag_path,
    tag_problem,
)
from .zero1 import MASTER, SEP, Zero1Tag, load_object, model_has_data, optim_name, prefixed, stored_dtype

log = logging.getLogger(__name__)

LATEST_IF_EXISTS = "latest_if_exists"


def plain_file(tag_dir: Path, name: str, store: Store | None = None) -> Any:
    """A tag's plain torch file (scheduler.pt, user_content.pt), read whole by the bounded reader,
    within the tag (a link out of it is refused); None when the tag has none."""
    path = Path(tag_dir) / name
    return load_small(path, name, within=Path(tag_dir), store=store) if os.path.lexists(path) else None


def resolve_tag(directory: Path, tag: str | None) -> str | None:
    """The tag to load: the newest complete one (tag None; None when there is none and tag is
    "latest_if_exists"), or the named tag, which must be complete."""
    directory = Path(directory)
    if tag is None or tag == LATEST_IF_EXISTS:
        found = _candidates(directory, tag)
        return found[0] if found else None
    tag_dir = tag_path(directory, tag)
    if not tag_dir.is_dir():
        raise NoCheckpointError(f"checkpoint {tag_dir} does not exist (see `shardkit ckpt list {directory}`)")
    if not is_complete(tag_dir):
        raise IncompleteCheckpointError(
            f"checkpoint {tag_dir} has no done marker: it is incomplete (an interrupted save or deletion); "
            f"load another tag (`shardkit ckpt list {directory}`)"
        )
    check_loadable(tag_dir)
    return str(tag)


def check_loadable(tag_dir: Path) -> dict[str, Any] | None:
    """The manifest (None for NxD's tags) of a complete tag that can be loaded (`tree.tag_problem`);
    else a one-line FormatError saying why and what to do."""
    manifest, problem, unloadable = tag_problem(tag_dir)
    if problem is not None:
        for entry in (manifest or {}).get("files", []):
            _listed_path(tag_dir, entry["path"])  # a listed name leading out of the tag: UnsafePathError
        what = "cannot be loaded" if unloadable else "is damaged"
        raise FormatError(
            f"checkpoint {tag_dir} {what}: {problem}; load an older tag (tag=..., `shardkit ckpt list "
            f"{tag_dir.parent}`) or restore its files"
        )
    return manifest


def tag_to_read(directory: str | Path, tag: str | None, instead: str) -> tuple[Path, str]:
    """(checkpoint directory, tag) a `ckpt` command reads: `directory`'s newest complete tag or
    `tag`, or `directory` itself when it is a tag folder. A folder that holds no tags is refused
    with what it is and, for a model folder, the command that reads it (`instead`, say
    "shardkit merge DIR OUT"; "DIR" stands for the folder). optimum-neuron's checkpoint-<step>
    folders are tags too (`optimum.find_tag`)."""
    found = find_tag(directory, tag)
    if found is not None:
        return found
    directory = Path(directory)
    if tag is None and is_tag(directory):
        return directory.parent, cast(str, resolve_tag(directory.parent, directory.name))
    if not directory.is_dir():
        raise NoCheckpointError(
            f"{directory} does not exist: give the checkpoint directory (the trainer's --checkpoint-dir) or a tag in it"
        )
    if tag is None and not any(is_tag(p) for p in directory.iterdir()):
        kind = model_folder_kind(directory)
        if kind is not None:
            command = instead.replace("DIR", str(directory))
            raise NoCheckpointError(
                f"{directory} is a model folder ({kind}), not a training checkpoint directory: use `{command}`"
            )
        raise NoCheckpointError(
            f"{directory} holds no checkpoint tags (folders with a done marker): give the trainer's --checkpoint-dir "
            "or a tag in it"
        )
    name = resolve_tag(directory, tag)
    if name is None:
        raise AssertionError("resolve_tag returns a tag or raises when none is asked for by name")
    return directory, name


def _candidates(directory: Path, tag: str | None) -> list[str]:
    """The loadable tags (`tree.tag_problem`), newest first; logs the newer complete tags skipped
    because they cannot be loaded. No candidate: NoCheckpointError (tag None), [] (latest_if_exists),
    or an error when complete tags exist but none can be loaded (never "train from scratch" over
    damaged checkpoints)."""
    infos = list_checkpoints(directory, details=False)
    loadable = [i for i in reversed(infos) if i.loadable]
    newest = loadable[0] if loadable else None
    damaged = [i for i in infos if i.complete and i.damaged and (newest is None or _newer(i, newest, infos))]
    for info in damaged:
        log.warning("skipping checkpoint %s: it %s", info.path, info.verdict)
    if loadable:
        return [i.tag for i in loadable]
    if damaged:
        raise FormatError(
            f"every complete checkpoint in {directory} is damaged or lacks its files ({shown_tag(damaged[-1].tag)}: "
            f"{damaged[-1].problem}): restore its files or shardkit.json, or load a tag by name"
        )
    if tag is None:
        raise NoCheckpointError(
            f"{directory} holds no complete checkpoint (no <tag>/done): nothing to load yet "
            "(latest_if_exists starts fresh when there is none)"
        )
    return []


def _newer(a: CheckpointInfo, b: CheckpointInfo, ordered: list[CheckpointInfo]) -> bool:
    return ordered.index(a) > ordered.index(b)


# ---- checks before reading -------------------------------------------------------------------------


def _listed_path(tag_dir: Path, name: str) -> Path:
    """A file named by the manifest: inside the tag (no absolute names, `..` or escaping links)."""
    try:
        return inside(tag_dir, name, f"file {name!r} listed in {tag_dir.name}/shardkit.json")
    except UnsafePathError as e:
        raise UnsafePathError(f"{e}; checkpoint {tag_dir} is damaged or tampered with: load another tag") from None


def _compare_configs(saved: Mapping[str, Any], given: Mapping[str, Any], tag_dir: Path) -> None:
    a, b = ModelDims.from_config(saved), ModelDims.from_config(given)
    if a == b:
        return
    for field_name in a.__dataclass_fields__:
        if getattr(a, field_name) != getattr(b, field_name):
            raise ConfigMismatchError(
                f"checkpoint {tag_dir} was saved for a model with {field_name} {getattr(a, field_name)!r}, but the "
                f"target config has {getattr(b, field_name)!r}: resume with the model's own config, or another "
                "checkpoint directory"
            )


def _check_files(ckpt: Checkpoint, keys: set[str]) -> None:
    """The files this rank reads hold the names and shapes the layout and config imply."""
    for key in sorted(keys):
        reader = ckpt.open(key)
        try:
            have = set(reader.keys())
            for piece in ckpt.holdings[key]:
                if piece.name not in have:
                    raise ConfigMismatchError(
                        f"{ckpt.root.name}/{key} lacks {piece.name} (expected for {ckpt.layout.describe()}): "
                        "the config or layout does not match the checkpoint"
                    )
                shape = tuple(reader.shape(piece.name))
                if shape != piece.shape:
                    raise ConfigMismatchError(
                        f"{ckpt.root.name}/{key}: {piece.name} has shape {shape} but {ckpt.layout.describe()} with "
                        f"this config expects {piece.shape}: the config does not match the checkpoint"
                    )
        finally:
            reader.close()


def _verify_hashes(tag_dir: Path, manifest: Mapping[str, Any], keys: set[str], store: Store | None = None) -> None:
    """Every file (and xser tensor file) behind `keys` against the manifest's fast digest (sha256
    where the manifest predates it), hashed by the one source check (`HashCheck`)."""
    entries = manifest.get("files", [])
    listed: dict[str, list[Path]] = {}
    for key in sorted(keys):
        mine = [e["path"] for e in entries if e["path"] == key or e["path"].startswith(key + ".")]
        if not mine:
            raise FormatError(f"the manifest of {tag_dir} does not list {key}: the checkpoint is damaged")
        listed[key] = [_listed_path(tag_dir, name) for name in mine]
    check = HashCheck(
        tag_dir,
        manifest,
        store if store is not None else Store(tag_dir),
        FAST,
        files_of=listed.__getitem__,
        remedy="load an older tag (tag=...)",
    )
    check.start(listed, background=True).finish()


# ---- reading ---------------------------------------------------------------------------------------


def _whole(key: str, piece: Piece) -> Read:
    """A read of a whole stored piece (the fast path when the target piece is stored as it is)."""
    rows = piece.shape[0] if piece.shape else None
    return Read(key, piece.name, None, 0, 0 if rows is not None else None, rows)


def _plan_reads(
    ckpt: Checkpoint, pieces: list[Piece], rank: Rank, same_layout: bool
) -> tuple[list[tuple[Piece, str | None]], set[str]]:
    """For each target piece, the file holding exactly that piece (read whole), or None (assembled
    from slices); and every file touched. Replicated pieces come from this rank's own file when the
    layout is unchanged, else from a file that is read anyway."""
    holders: dict[Piece, list[str]] = {}
    for key, held in ckpt.holdings.items():
        for p in held:
            holders.setdefault(p, []).append(key)
    index = ckpt.index()
    needed: set[str] = set()
    for piece in pieces:
        keys = holders.get(piece)
        if not keys:
            for seg in piece.segments:
                needed.update(cast(str, r.holder) for r in index.locate(seg))  # ckpt.index() holders are file keys
        elif len(keys) == 1:
            needed.add(keys[0])
    plan: list[tuple[Piece, str | None]] = []
    for piece in pieces:
        keys = holders.get(piece)
        if keys and len(keys) > 1:
            own = [k for k in keys if same_layout and ckpt.ranks.get(k) == rank.key]
            keys = own or [k for k in keys if k in needed] or keys
            needed.add(keys[0])
        plan.append((piece, keys[0] if keys else None))
    return plan, needed


def read_pieces(
    ckpt: Checkpoint,
    pieces: list[Piece],
    rank: Rank,
    manifest: Mapping[str, Any] | None,
    verify: bool,
    same_layout: bool = False,
) -> dict[str, torch.Tensor]:
    """Check, then read, the target pieces from `ckpt` (only the slices they are made of)."""
    plan, needed = _plan_reads(ckpt, pieces, rank, same_layout)
    # in object storage: the metadata of these files (and their xser tensor files), fetched together
    ckpt.store.prepare(
        (p for key in sorted(needed) for p in (ckpt.files[key], Path(f"{ckpt.files[key]}.tensors"))),
        Need.METADATA,
        fetch_metadata,
    )
    _check_files(ckpt, needed)
    if verify and manifest is not None:
        _verify_hashes(ckpt.root, manifest, needed, ckpt.store)
    reader = SourceReader(ckpt)  # positional reads: every tensor read owns its memory
    out: dict[str, torch.Tensor] = {}
    try:
        for piece, key in plan:
            tensor = reader.read(_whole(key, piece)) if key else reader.read_piece(piece)
            if tuple(tensor.shape) != piece.shape:
                raise FormatError(f"{piece.name}: read shape {tuple(tensor.shape)}, expected {piece.shape}")
            out[piece.name] = tensor
    finally:
        reader.close()
    return out


def read_optimizer(zero: Zero1Tag, pieces: list[Piece]) -> OptimizerState:
    """This rank's per-parameter optimizer state from NxD's ZeRO-1 files: each target piece's
    moments (and fp32 `master`), dp-merged and resharded like the piece; `step`; its group."""
    reader = SourceReader(zero.view())
    groups = zero.group_of()
    state: dict[str, dict[str, Any]] = {}
    owner: dict[str, int] = {}
    try:
        for piece in pieces:
            entry: dict[str, Any] = {m: reader.read_piece(prefixed(piece, m + SEP)) for m in zero.moments()}
            entry["step"] = torch.tensor(zero.step if zero.step is not None else 0.0, dtype=torch.float32)
            state[piece.name] = entry
            owner[piece.name] = groups.get(piece.segments[0].source, 0)
    finally:
        reader.close()
    return OptimizerState(state, [dict(g) for g in zero.hyper], owner)


def _from_master(ckpt: Checkpoint, zero: Zero1Tag | None, pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """The weights from the fp32 master weights, when the model files hold no tensor data."""
    zero = check_masters(ckpt.root, zero)
    dtype = stored_dtype(ckpt)
    reader = SourceReader(zero.view([MASTER]))
    try:
        return {p.name: reader.read_piece(prefixed(p, MASTER + SEP)).to(dtype) for p in pieces}
    finally:
        reader.close()


def _load_generic(
    tag_dir: Path, name: str, manifest: Mapping[str, Any], rank: Any, optimizer: bool, store: Store | None = None
) -> LoadedCheckpoint:
    """A checkpoint saved without layout/config: the objects exactly as saved (this process's
    ZeRO-1 optimizer shard when each dp rank saved its own)."""
    info = manifest.get("checkpoint") or {}
    dist_rank = distributed_rank()
    dp = rank.dp if isinstance(rank, Rank) else (dist_rank[0] if dist_rank else 0)
    model = load_object(tag_dir / MODEL_DIR / "dp_rank_00_tp_rank_00_pp_rank_00.pt", False, store)
    opt = None
    if optimizer:
        path = tag_dir / optim_name(dp if info.get("zero1") else 0, 0, 0)
        if (tag_dir / OPTIM_DIR).is_dir():
            if not path.is_file():
                raise FormatError(
                    f"{tag_dir.name}/{optim_name(dp, 0, 0)} is missing: the checkpoint has "
                    f"{len(list((tag_dir / OPTIM_DIR).iterdir()))} optimizer shards; load it with as many "
                    "processes as saved it"
                )
            opt = load_object(path, False, store)
    scheduler, user_content = plain_file(tag_dir, SCHEDULER, store), plain_file(tag_dir, USER_CONTENT, store)
    layout = Layout()
    return LoadedCheckpoint(
        name,
        tag_dir,
        info.get("step"),
        layout,
        layout,
        Rank(dp=dp),
        {},
        model,
        opt,
        scheduler,
        user_content,
        manifest.get("format", "torch"),
    )


# ---- the API ---------------------------------------------------------------------------------------


def load_checkpoint(
    dir: str | Path,
    tag: str | None = None,
    *,
    target_layout: Layout | None = None,
    rank: Any = None,
    config: Mapping[str, Any] | str | Path | None = None,
    hints: Mapping[str, Any] | None = None,
    optimizer: bool = True,
    verify: bool = True,
    param_order: list[list[str]] | None = None,
    store: Store | None = None,
) -> LoadedCheckpoint | None:
    """This rank's model pieces and optimizer state for `target_layout`, from checkpoint `tag`.

    `tag`: None = the newest complete tag (NoCheckpointError when there is none);
    "latest_if_exists" = the same, or None when there is none; or a tag name (it must be
    complete). `target_layout`: the layout to resume in (default: the saved one); any valid layout
    works: pieces are resharded on the fly, moments with their parameters. `rank`: (tp, pp),
    (ep, tp, pp) or Rank of the target layout (default: from torch.distributed). `config`: the
    model config the trainer uses; it must match the checkpoint's (and is needed for NxD tags
    without config.json). `verify`: check every file this rank reads against the digest in the
    manifest (xxh3-128, sha256 for older manifests; reads those files once more). `param_order`:
    names per param group, when the ZeRO-1 index order of NxD's optimizer files cannot be
    recovered. Returns a LoadedCheckpoint (for a checkpoint saved without layout/config: the state
    dicts exactly as saved).

    NxD's optimizer files (ZeRO-1, any dp) are read by meaning: `loaded.optimizer.state[piece]` is
    `{"exp_avg", "exp_avg_sq", "step"[, "master"]}` with this rank's tp-local (dp-unsharded)
    shapes; `zero1.dp_shard(t, dp, d)` gives dp rank d's ZeRO-1 part of it. `dir` may be
    s3://bucket/prefix: read through a local mirror, fetching the ranges read; `store`: what a
    local `dir` is read through (a mirror its caller keeps open, as the trainer's --resume)."""
    if (loc := remote_location(dir, "checkpoint directory")) is not None:
        with scope():
            store = open_store(loc, output=False)  # files fetched as this rank reads them
            name = resolve_tag(store.root, tag)
            if name is None:
                return None
            return _load(store.root, store, name, target_layout, rank, config, hints, optimizer, verify, param_order)
    root = Path(dir)
    return _load(root, store or Store(root), tag, target_layout, rank, config, hints, optimizer, verify, param_order)


def _load(  # noqa: PLR0913 - load_checkpoint's arguments, resolved
    root: Path,
    store: Store,
    tag: str | None,
    target_layout: Layout | None,
    rank: Any,
    config: Mapping[str, Any] | str | Path | None,
    hints: Mapping[str, Any] | None,
    optimizer: bool,
    verify: bool,
    param_order: list[list[str]] | None,
) -> LoadedCheckpoint | None:
    """`load_checkpoint` of the local folder `root`, read through `store` (a mirror's, or its own)."""
    if tag is not None and tag != LATEST_IF_EXISTS:
        name = resolve_tag(root, tag)
        assert name is not None
        return _load_tag(root, name, target_layout, rank, config, hints, optimizer, verify, None, param_order, store)
    candidates = _candidates(root, tag)
    if not candidates:
        return None
    one_process = distributed_rank() is None
    first: Exception | None = None
    for pos, name in enumerate(candidates):
        shared = [True]  # still in the checks every rank makes alike
        try:
            return _load_tag(
                root, name, target_layout, rank, config, hints, optimizer, verify, shared, param_order, store
            )
        except _SKIPPABLE as e:
            first = first or e
            if not (one_process or shared[0]):
                log.error(
                    "checkpoint %s fails on this rank (%s): in a torch.distributed job the ranks cannot agree "
                    "on an older tag on their own; pass tag=<an older tag> to every rank",
                    root / name,
                    e,
                )
                raise
            if pos + 1 == len(candidates):
                raise FormatError(
                    f"no complete checkpoint in {root} can be loaded (the newest, {candidates[0]}: "
                    f"{first}): restore the damaged files or load a tag by name"
                ) from e
            log.warning("skipping checkpoint %s: %s; trying the older %s", root / name, e, candidates[pos + 1])
    return None  # unreachable


_SKIPPABLE = (FormatError, UnsafePathError, NoCheckpointError, OSError)
"""Failures of a tag itself (damaged, missing, corrupt) after which an older tag is tried. A config
or layout that does not fit is the caller's, and raised at once."""


def _load_tag(
    root: Path,
    name: str,
    target_layout: Layout | None,
    rank: Any,
    config: Mapping[str, Any] | str | Path | None,
    hints: Mapping[str, Any] | None,
    optimizer: bool,
    verify: bool,
    shared: list[bool] | None = None,
    param_order: list[list[str]] | None = None,
    store: Store | None = None,
) -> LoadedCheckpoint:
    tag_dir = root / name
    if not is_complete(tag_dir):
        raise IncompleteCheckpointError(
            f"checkpoint {tag_dir} has no done marker (removed meanwhile?): load another tag"
        )
    manifest = check_loadable(tag_dir)
    if manifest is not None and (manifest.get("checkpoint") or {}).get("generic"):
        return _load_generic(tag_dir, name, manifest, rank, optimizer, store)
    saved = load_config(tag_dir, within=tag_dir) if (tag_dir / CONFIG).is_file() else None
    given = load_config(config) if isinstance(config, (str, Path)) else (dict(config) if config else None)
    if saved is not None and given is not None:
        _compare_configs(saved, given, tag_dir)
    ckpt = open_model(tag_dir, saved or given, hints, store)  # (its store before the optimizer's views are made)
    target = target_layout or ckpt.layout
    target.validate(ckpt.dims)
    me = Rank.of(rank, target)
    pieces = ckpt.family.rank_pieces(target, ckpt.dims, me.tp, me.pp, ckpt.full_shapes, me.ep)
    same = target == ckpt.layout
    if shared is not None:
        shared[0] = False  # from here on, each rank reads (and hashes) its own files
    has_data = model_has_data(ckpt)
    zero = open_optimizer(tag_dir, ckpt, param_order) if optimizer or not has_data else None
    if has_data:
        model = read_pieces(ckpt, pieces, me, manifest, verify, same)
    else:
        model = _from_master(ckpt, zero, pieces)
    if verify and manifest is not None and zero is not None:
        _verify_hashes(tag_dir, manifest, {p.relative_to(tag_dir).as_posix() for p in zero.files.values()}, store)
    opt = read_optimizer(zero, pieces) if optimizer and zero is not None else None
    scheduler, user_content = plain_file(tag_dir, SCHEDULER, store), plain_file(tag_dir, USER_CONTENT, store)
    step = (manifest.get("checkpoint") or {}).get("step") if manifest else None
    if step is None and isinstance(user_content, Mapping) and isinstance(user_content.get("step"), int):
        step = user_content["step"]
    if step is None:
        from .tree import tag_step

        step = tag_step(name)
    log.info(
        "loaded checkpoint %s (saved %s) as rank (%s) of %s",
        tag_dir,
        ckpt.layout.describe(),
        me.describe(),
        target.describe(),
    )
    return LoadedCheckpoint(
        name, tag_dir, step, ckpt.layout, target, me, ckpt.config, model, opt, scheduler, user_content, ckpt.format
    )
