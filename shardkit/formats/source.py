"""One view over any checkpoint: what each file holds, in terms of full (Hugging Face) tensors.

`open_checkpoint` recognises a Hugging Face directory, a single state-dict file, shardkit's own
sharded directory (with its `shardkit.json` manifest) or NxD's (layout inferred), and returns a
`Checkpoint`: its config, family, layout, files, and for each file the pieces it holds. The
engine needs nothing else to read any slice of any full tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigMismatchError, FormatError
from ..families import Family, family_for
from ..io.safety.small import read_json
from ..io.safety.transaction import recover_interrupted
from ..io.store import Store
from ..layout import FULL, Layout, ModelDims
from ..placements import Piece, Segment, SegmentIndex, make_piece
from . import dcp, hf, nxd, optimum_neuron
from .base import TensorFile
from .manifest import MANIFEST
from .reader import SourceReader
from .registry import format_of_file

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A checkpoint on disk, described in full-tensor terms."""

    root: Path
    kind: str  # "hf" (full tensors) or "sharded"
    format: str  # safetensors | torch | xser
    config: dict[str, Any]
    family: Family
    dims: ModelDims
    layout: Layout
    files: dict[str, Path]  # key (path relative to root) -> path
    holdings: dict[str, list[Piece]]  # key -> pieces that file holds
    ranks: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    naming: str = "hf"
    single_file: bool = False  # opened from one state-dict file: only that file (not root) is the source
    convention: str = "hf"  # whose names the files use (conventions.py): a DCP folder may use torchtitan's
    opener: Callable[[str, Store], TensorFile] | None = None  # a format whose readers need more than a path (DCP)
    store: Store = field(default=None)  # type: ignore[assignment]  # where its files are read from (io.store)

    def __post_init__(self) -> None:
        if self.store is None:
            self.store = Store(self.root)  # a local folder; api.open_source gives an object store's

    @property
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.family.full_shapes(self.dims)

    def open(self, key: str) -> TensorFile:
        if self.opener is not None:
            return self.opener(key, self.store)
        path = self.files[key]
        return format_of_file(path, self.format).reader(path, store=self.store)

    def index(self) -> SegmentIndex:
        index = SegmentIndex()
        for key, pieces in self.holdings.items():
            for piece in pieces:
                index.add(key, piece)
        return index

    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's tensors (of its first file's first tensor)."""
        key = next(iter(self.holdings))
        reader = self.open(key)
        try:
            return reader.dtype(self.holdings[key][0].name)
        finally:
            reader.close()

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for p in self.files.values() for f in format_of_file(p, self.format).files_of(p))

    def check_files(self) -> None:
        """Every file holds exactly the pieces the layout says, with the right shapes."""
        for key, pieces in self.holdings.items():
            reader = self.open(key)
            try:
                have = set(k for k in reader.keys() if not self.family.is_ignored(k))
                want = {p.name for p in pieces}
                missing, extra = sorted(want - have), sorted(have - want)
                if missing or extra:
                    what = f"lacks {missing[0]}" if missing else f"has unexpected {extra[0]}"
                    raise ConfigMismatchError(
                        f"{key} {what} (expected for {self.describe()}): the config or layout does not match the shards"
                    )
                for piece in pieces:
                    shape = reader.shape(piece.name)
                    if tuple(shape) != piece.shape:
                        raise ConfigMismatchError(
                            f"{key}: {piece.name} has shape {tuple(shape)} but {self.describe()} with this config "
                            f"expects {piece.shape}: the config does not match the shards (pass the right --config)"
                        )
            finally:
                reader.close()

    def describe(self) -> str:
        return "a full model" if self.kind == "hf" else self.layout.describe()


def load_config(path: Path | str, within: Path | str | None = None) -> dict[str, Any]:
    """The config.json `path` (or the one in the folder `path`); `within`: the source folder a
    config found beside weights must lie in (io.safety.small: a link out of it is refused)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    config = read_json(path, "config", within=within)
    if not isinstance(config, dict):
        raise FormatError(
            f"config {path} is a JSON {type(config).__name__}, not an object: give the model's config.json"
        )
    return config


def open_checkpoint(
    path: Path | str,
    config: Path | str | Mapping | None = None,
    hints: Mapping | None = None,
    store: Store | None = None,
) -> Checkpoint:
    """Open any supported checkpoint. `config` overrides/provides config.json; `hints` are layout
    fields (qkv, kv_multiplier, kv_replication) for NxD shards whose layout cannot be inferred;
    `store`: what its files are read through (an object store's mirror; default: the local folder)."""
    ckpt = _open(Path(path), config, hints, store)
    if store is not None:
        ckpt.store = store
    return ckpt


def _open(root: Path, config: Path | str | Mapping | None, hints: Mapping | None, store: Store | None) -> Checkpoint:
    hints = {k: v for k, v in (hints or {}).items() if v is not None}
    if not root.exists():
        recover_interrupted(root, log)  # a run killed while replacing it leaves it beside, renamed
        if not root.exists():
            raise FormatError(f"{root} does not exist")
    given = load_config(config) if isinstance(config, (str, Path)) else (dict(config) if config else None)
    where = str(config) if isinstance(config, (str, Path)) else ("the given config" if config else None)

    if root.is_file():
        cfg = given or _config_near(root)
        ckpt = _open_full(root.parent, {root.name: root}, cfg, where or _config_near_path(root), store)
        ckpt.single_file = True
        return ckpt
    if (root / dcp.METADATA).is_file():
        return _open_dcp(root, given, hints, where)
    if optimum_neuron.shards_of(root) is not None:
        return _open_optimum_neuron(root, given, where)
    manifest_path = root / MANIFEST
    if manifest_path.is_file():
        return _open_shardkit(root, given, where)
    rank_files = nxd.find_rank_files(root)
    if rank_files is not None:
        return _open_nxd(root, rank_files, given, hints, where, store)
    if (root / "config.json").is_file() or given:
        files = hf.weight_files(root)
        return _open_full(
            root,
            {f.name: f for f in files},
            given or load_config(root, within=root),
            where or str(root / "config.json"),
            store,
        )
    weights = hf.weight_files(root, strict=False) if root.is_dir() else []
    if weights:
        raise FormatError(
            f"{root} holds weights ({weights[0].name}) but no config.json: pass the model's Hugging Face config "
            "with --config (its config.json, or the folder holding it)"
        )
    raise FormatError(
        f"{root} is not a model directory: expected a Hugging Face directory (config.json + weights), "
        "shardkit shards (shardkit.json) or NxD rank files (model/dp_rank_00_tp_rank_00_pp_rank_00.pt)"
    )


def is_plain_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory (config.json + weights), not shards of any kind."""
    path = Path(path)
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and bool(hf.weight_files(path, strict=False))
        and not (path / MANIFEST).is_file()
        and nxd.find_rank_files(path) is None
    )


def _config_near_path(path: Path) -> str:
    for candidate in (path.parent / "config.json", path.parent.parent / "config.json"):
        if candidate.is_file():
            return str(candidate)
    return "config.json"


def _config_near(path: Path) -> dict[str, Any]:
    for candidate in (path.parent / "config.json", path.parent.parent / "config.json"):
        if candidate.is_file():
            return load_config(candidate, within=candidate.parent)
    raise FormatError(f"no config.json next to {path}: pass the model's config with --config")


def _family_dims(cfg: Mapping[str, Any], where: str | None = None) -> tuple[Family, ModelDims]:
    if not isinstance(cfg, Mapping):
        raise ConfigMismatchError(f"{where or 'config.json'} is not a JSON object: pass the model's config.json")
    family = family_for(cfg)
    return family, ModelDims.from_config(cfg, where or "config.json")


def _open_full(
    root: Path, files: dict[str, Path], cfg: dict[str, Any], where: str | None = None, store: Store | None = None
) -> Checkpoint:
    names = {key: hf.tensor_names(path, store) for key, path in files.items()}
    family, dims = _family_dims(cfg, where)
    total = sum(len(n) for n in names.values())
    if dims.num_layers > total:
        raise ConfigMismatchError(
            f"{where or 'config.json'}: num_hidden_layers is {dims.num_layers} but the weights hold only {total} "
            "tensors: the config does not match the weights (fix num_hidden_layers or pass the right --config)"
        )
    shapes = family.full_shapes(dims)
    split_dims = family.split_dims(dims)
    holdings: dict[str, list[Piece]] = {}
    seen: set[str] = set()
    for key, path in files.items():
        pieces = []
        for name in names[key]:
            if family.is_ignored(name) or name in seen:
                continue
            if name not in shapes:
                if name == "lm_head.weight" and dims.tie_word_embeddings:
                    continue  # some tied checkpoints also store the (identical) lm_head
                raise ConfigMismatchError(
                    f"{path.name} holds {name}, which a {family.name} model with this config does not have: "
                    "the config does not match the weights"
                )
            seen.add(name)
            dim = split_dims[name]
            pieces.append(make_piece(name, [Segment(name, dim, 0, shapes[name][dim] if shapes[name] else 1)], shapes))
        holdings[key] = pieces
    missing = [n for n in shapes if n not in seen]
    if missing:
        raise ConfigMismatchError(
            f"the weights lack {missing[0]} ({len(missing)} tensors missing) that the config implies: "
            "the config does not match the weights"
        )
    fmt = "safetensors" if all(p.suffix == ".safetensors" for p in files.values()) else "torch"
    return Checkpoint(root, "hf", fmt, cfg, family, dims, FULL, files, holdings, store=store or Store(root))


def _open_dcp(root: Path, given: dict | None, hints: Mapping, where: str | None = None) -> Checkpoint:
    """A PyTorch DCP folder's model: chunks as pieces of full tensors (`dcp.describe_model`), under
    the naming convention its names follow (or `hints["convention"]`)."""
    if given is None:
        for candidate in (root / "config.json", root.parent / "config.json"):
            if candidate.is_file():
                given, where = load_config(candidate, within=candidate.parent), str(candidate)
                break
        else:
            raise FormatError(
                f"{root} is a PyTorch DCP checkpoint without a config.json: pass the model's Hugging Face config with --config"
            )
    family, dims = _family_dims(given, where)
    model = dcp.describe_model(root, family, dims, hints.get("convention"))
    manifest = read_json(root / MANIFEST, MANIFEST, within=root) if (root / MANIFEST).is_file() else None
    return Checkpoint(
        root,
        "sharded",
        "dcp",
        given,
        family,
        dims,
        FULL,
        model.files,
        model.holdings,
        {},
        manifest,
        "dcp",
        convention=model.convention.name,
        opener=model.open,
    )


def _open_optimum_neuron(root: Path, given: dict | None, where: str | None = None) -> Checkpoint:
    """An optimum-neuron checkpoint (the saved folder, or its shards/): NxD rank files under the
    layout its metadata describes (`optimum_neuron.describe`)."""
    shards = optimum_neuron.shards_of(root)
    assert shards is not None
    base = shards.parent if shards == root else root
    if given is None:
        candidate = base / "config.json"
        if not candidate.is_file():
            raise FormatError(
                f"{base} is an optimum-neuron checkpoint without its config.json: pass the model's config with --config"
            )
        given, where = load_config(candidate, within=candidate.parent), str(candidate)
    family, dims = _family_dims(given, where)
    described = optimum_neuron.describe(base, family, dims)
    holdings, ranks = _sharded_holdings(family, dims, described.layout, described.keys_by_rank)
    files = {key: base / key for key in holdings}
    manifest = read_json(base / MANIFEST, MANIFEST, within=base) if (base / MANIFEST).is_file() else None
    return Checkpoint(
        base,
        "sharded",
        "optimum-neuron",
        given,
        family,
        dims,
        described.layout,
        files,
        holdings,
        ranks,
        manifest,
        "optimum-neuron",
    )


def _sharded_holdings(family, dims, layout, keys_by_rank) -> tuple[dict[str, list[Piece]], dict[str, tuple]]:
    family.validate(layout, dims)
    shapes = family.full_shapes(dims)
    holdings, ranks = {}, {}
    for (ep, tp, pp), key in keys_by_rank.items():
        holdings[key] = family.rank_pieces(layout, dims, tp, pp, shapes, ep)
        ranks[key] = (ep, tp, pp)
    return holdings, ranks


def _open_shardkit(root: Path, given: dict | None, where: str | None = None) -> Checkpoint:
    manifest = read_json(root / MANIFEST, MANIFEST, within=root)
    try:
        layout = Layout.from_dict(manifest["layout"])
        fmt = manifest["format"]
    except (ValueError, KeyError, TypeError):
        raise FormatError(f"{root / MANIFEST} is corrupt: re-create the shards") from None
    cfg = given or load_config(root, within=root)
    family, dims = _family_dims(cfg, where or str(root / "config.json"))
    keys_by_rank = {}
    for ep, tp, pp in layout.ranks():
        key = nxd.rank_file_name(ep, tp, pp, layout, fmt)
        if not (root / key).is_file():
            raise FormatError(f"rank file {key} is missing from {root}: copy it back or re-create the shards")
        keys_by_rank[(ep, tp, pp)] = key
    holdings, ranks = _sharded_holdings(family, dims, layout, keys_by_rank)
    files = {key: root / key for key in holdings}
    return Checkpoint(
        root,
        "sharded",
        fmt,
        cfg,
        family,
        dims,
        layout,
        files,
        holdings,
        ranks,
        manifest,
        "v3" if layout.ep > 1 else "v2",
    )


def _open_nxd(
    root: Path,
    rank_files: nxd.RankFiles,
    given: dict | None,
    hints: Mapping,
    where: str | None = None,
    store: Store | None = None,
) -> Checkpoint:
    if given is None:
        for candidate in (root / "config.json", root.parent / "config.json"):
            if candidate.is_file():
                given = load_config(candidate, within=candidate.parent)
                where = str(candidate)
                break
        else:
            raise FormatError(
                f"{root} holds NxD shards but no config.json: pass the model's Hugging Face config with --config"
            )
    family, dims = _family_dims(given, where)
    keys_by_rank = {rank: path.relative_to(root).as_posix() for rank, path in rank_files.files.items()}
    files = {key: root / key for key in keys_by_rank.values()}
    store = store or Store(root)
    probe = Checkpoint(root, "sharded", rank_files.format, given, family, dims, FULL, files, {}, store=store)
    first = probe.open(keys_by_rank[(0, 0, 0)])
    try:
        layout = nxd.infer_layout(rank_files, first, dims, dict(hints), family)
        bare = not getattr(first, "holds_data", True)  # saved without tensor data: nothing to compare
    finally:
        first.close()
    holdings, ranks = _sharded_holdings(family, dims, layout, keys_by_rank)
    ckpt = Checkpoint(
        root,
        "sharded",
        rank_files.format,
        given,
        family,
        dims,
        layout,
        files,
        holdings,
        ranks,
        None,
        rank_files.naming,
        store=store,
    )
    if layout.kv_multiplier > 1 and "kv_replication" not in hints and not bare:
        ckpt = _decide_replication(ckpt, keys_by_rank)
    return ckpt


def decide_replication(ckpt: Checkpoint, view: Callable[[Checkpoint], Checkpoint]) -> Checkpoint:
    """`ckpt` under the kv replication its values say, read through `view` (see below): for NxD
    shards whose files hold no tensor data, the training checkpoint's master weights."""
    return _decide_replication(ckpt, {rank: key for key, rank in ckpt.ranks.items()}, view)


def _decide_replication(
    ckpt: Checkpoint, keys_by_rank, view: Callable[[Checkpoint], Checkpoint] | None = None
) -> Checkpoint:
    """Interleaved or blocked kv replication, decided from the data: under the right one, every
    rank that claims to hold a given kv head holds the same values. `view` gives what holds the
    values for a candidate layout, when the files themselves do not (a training checkpoint's
    master weights)."""
    first_layer = ckpt.layout.stage_layers(ckpt.dims.num_layers)[0][0]
    k_rows = ckpt.family.k_source(ckpt.dims, first_layer)
    if k_rows is None:
        raise FormatError(
            f"{ckpt.root}: {ckpt.family.name} has no kv heads whose replication could be read from the data: "
            "pass --kv-replication (or write the layout in shardkit.json)"
        )
    verdicts = {}
    for replication in ("interleaved", "blocked"):
        layout = Layout(**{**ckpt.layout.to_dict(), "kv_replication": replication})
        holdings, _ = _sharded_holdings(ckpt.family, ckpt.dims, layout, keys_by_rank)
        candidate = Checkpoint(**{**ckpt.__dict__, "layout": layout, "holdings": holdings})
        values = view(candidate) if view is not None else candidate
        verdicts[replication] = (candidate, _replicas_agree(values, SourceReader(values), k_rows))
    agree = [r for r, (_, ok) in verdicts.items() if ok]
    if not agree:
        raise FormatError(
            f"{ckpt.root}: the k/v replicas disagree under both interleaved and blocked replication: "
            "the shards are corrupt or were written by a broken converter"
        )
    choice = agree[0]
    log.info("kv replication inferred from the data: %s", choice)
    return verdicts[choice][0]


def _replicas_agree(ckpt: Checkpoint, reader, k_rows: Segment) -> bool:
    """Whether every holder of each k head (the rows `k_rows` of their full tensor: k_proj, or
    the k rows of a fused qkv tensor) holds the same values, compared head by head."""
    index = ckpt.index()
    head_dim = ckpt.dims.head_dim
    try:
        seen: dict[int, torch.Tensor] = {}
        for h in index.holdings(k_rows.source):
            start, stop = max(h.start, k_rows.start), min(h.stop, k_rows.stop)
            if start >= stop:
                continue  # q or v rows of a fused tensor
            data = reader.read(h.read(start, stop))
            for row in range(start, stop, head_dim):
                head = data.narrow(k_rows.dim, row - start, min(head_dim, stop - row))
                if row in seen and not torch.equal(seen[row], head):
                    return False
                seen.setdefault(row, head)
        if not seen:
            raise FormatError(f"{ckpt.root}: no rank file holds {k_rows.source}: the config does not match the shards")
        return True
    finally:
        reader.close()
