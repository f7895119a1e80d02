"""NxD sharded directories: rank file names (v1, v2, v3), scanning, and layout inference.

See docs/FORMATS.md ("NxD rank files") for the conventions. shardkit's own shards use the same
names (`.safetensors` instead of `.pt` for the safetensors format) plus a `shardkit.json` manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigMismatchError, FormatError, LayoutError
from ..families import Family, family_for
from ..layout import Layout, ModelDims
from ..paths import inside
from ..placements import QKV_NAMES, HeadGroups, Split
from .registry import SUFFIXES, detect_format, get_format
from .torch_io import regular

TAG_MARKER = "checkpoint"
"""The empty file NxD's `save_checkpoint` writes in each training checkpoint tag (DIR/<tag>/checkpoint)."""

_SUFFIX = "(" + "|".join(re.escape(s) for s in SUFFIXES) + ")"
_V3 = re.compile(r"^dp_rank_(\d+)_ep_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)" + _SUFFIX + "$")
_V2 = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)" + _SUFFIX + "$")
_V1 = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)$")


def rank_file_name(ep: int, tp: int, pp: int, layout: Layout, fmt: str) -> str:
    """NxD's file name for a rank (v3 with ep_rank when ep > 1, else v2), under model/."""
    suffix = get_format(fmt).suffix
    if layout.ep > 1:
        return f"model/dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}{suffix}"
    return f"model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}{suffix}"


@dataclass
class RankFiles:
    """The rank files found in a directory."""

    files: dict[tuple[int, int, int], Path]  # (ep, tp, pp) -> path
    format: str  # torch | xser | safetensors
    naming: str  # v1 | v2 | v3
    tp: int
    pp: int
    ep: int


def find_rank_files(root: Path) -> RankFiles | None:
    """Scan `root` (or `root/model`) for rank files; None when there are none."""
    root = Path(root)
    found: dict[tuple[int, int, int], Path] = {}
    naming = None
    model = root / "model"
    if model.is_dir():
        inside(root, "model", "folder")  # a `model` link that leads out of root is refused, not followed
    for folder in (model, root):
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            key, path = None, entry
            if m := _V3.match(entry.name):
                if int(m.group(1)) == 0:
                    key, naming = (int(m.group(2)), int(m.group(3)), int(m.group(4))), "v3"
            elif m := _V2.match(entry.name):
                if int(m.group(1)) == 0:
                    key, naming = (0, int(m.group(2)), int(m.group(3))), naming or "v2"
            elif (m := _V1.match(entry.name)) and (entry / "checkpoint.pt").exists():
                key, path, naming = (0, int(m.group(1)), int(m.group(2))), entry / "checkpoint.pt", naming or "v1"
            if key is not None and key in found:  # two files say they are the same rank's: which is this model's?
                raise FormatError(
                    f"{found[key]} and {path} are both the rank file of ep {key[0]}, tp {key[1]}, pp {key[2]}: move "
                    "the one that is not this checkpoint's away"
                )
            if key is not None:
                found[key] = path
        if found:
            break
    if not found:
        return None
    for path in found.values():  # a stat each: a FIFO would block its reader, an empty file is no rank file
        if regular(path, "rank file").stat().st_size == 0:
            raise FormatError(
                f"rank file {path} is empty (0 bytes): copy it back from the original or re-create the shards"
            )
    formats = sorted({detect_format(p).name for p in found.values()})
    if len(formats) > 1:
        raise FormatError(f"{root} mixes rank files of formats {' and '.join(formats)}: keep one format per directory")
    fmt = formats[0]
    ep, tp, pp = (max(k[i] for k in found) + 1 for i in range(3))
    files = RankFiles(found, fmt, naming or "v2", tp, pp, ep)
    for key in ((e, t, p) for e in range(ep) for t in range(tp) for p in range(pp)):
        if key not in found:
            example = rank_file_name(*key, Layout(tp=tp, pp=pp, ep=ep), fmt)
            raise FormatError(
                f"rank file {example} is missing from {root} (found {len(found)} of {ep * tp * pp} for "
                f"tp {tp}, pp {pp}{f', ep {ep}' if ep > 1 else ''}): copy it back or re-create the shards"
            )
    return files


def _k_key_suffixes() -> tuple[tuple[str, str], ...]:
    """(qkv style, the rank-file name under the attention scope of the piece that holds k)."""
    out = []
    for style in ("gqa", "fused", "coalesced", "separate"):  # most specific names first
        names = QKV_NAMES[style][0]
        out.append((style, names[1] if len(names) == 3 else names[0]))
    return tuple(out)


QKV_KEYS = _k_key_suffixes()


def _empty(shape: tuple[int, ...], ndim: int) -> bool:
    return len(shape) != ndim or 0 in shape


def _no_data(path, name: str) -> FormatError:
    return FormatError(
        f"{path}: {name} holds no data (NxD saved the weights empty, e.g. with avoid_saving_lower_precision_weights), "
        "so the layout cannot be read from it: write it in a shardkit.json manifest or pass qkv and kv_multiplier"
    )


def _mlp_out_name(family: Family) -> str:
    """The family's row-parallel MLP weight (split over tp along intermediate_size), by its layer table."""
    for rule in family.layer:
        if isinstance(rule, Split) and rule.dim == 1 and rule.shape[1:2] == ("intermediate_size",):
            return rule.out or rule.name
    return "mlp.down_proj.weight"


def infer_layout(
    rank_files: RankFiles, first_file, dims: ModelDims, hints: dict, family: Family | None = None
) -> Layout:
    """The layout of NxD shards from file names, key names and shapes (and `hints` from flags).

    `first_file` is the open tp-rank-0, pp-rank-0 file; `family` (default: by the config's
    model_type) gives the layer prefix in rank files and the attention placement's scope.
    kv replication (interleaved or blocked) cannot be seen in shapes; it comes from `hints` or
    is decided later from the data.
    """
    if family is None:
        family = family_for({"model_type": dims.model_type})
    tp, pp, ep = rank_files.tp, rank_files.pp, rank_files.ep
    keys = set(first_file.keys())
    layer = family.layer_prefix.format(i=0)  # pp rank 0 holds layer 0
    if not any(k.startswith(layer) for k in keys):
        raise FormatError(
            f"{first_file.path} holds no {family.name} layers ({layer}*): is this a sharded {family.name} model directory?"
        )
    attention = next((rule for rule in family.layer if isinstance(rule, HeadGroups)), None)
    mlp_out = layer + _mlp_out_name(family)
    if mlp_out in keys and not _empty(shape := tuple(first_file.shape(mlp_out)), 2):
        cols = shape[1]
        if dims.intermediate_size % cols == 0 and dims.intermediate_size // cols != tp:
            raise FormatError(
                f"by config.json the shards are cut for tp {dims.intermediate_size // cols} but {tp} tp rank files "
                "were found: rank files are missing, or the config does not match the shards"
            )
    qkv = hints.get("qkv")
    m = hints.get("kv_multiplier")
    if attention is None:  # q, k and v as the family keeps them (one style), no kv heads to replicate
        qkv = qkv or family.qkv_styles[0]
        m = m or 1
    else:
        scope = layer + attention.scope
        kv_rows = None
        for style, suffix in QKV_KEYS:
            if scope + suffix in keys:
                qkv = qkv or style
                shape = tuple(first_file.shape(scope + suffix))
                if m is None and _empty(shape, 2):
                    raise _no_data(first_file.path, scope + suffix)
                q_rows = dims.num_heads // tp * dims.head_dim
                kv_rows = shape[0] if style in ("gqa", "separate") else (shape[0] - q_rows) // 2
                break
        if qkv is None or (m is None and kv_rows is None):
            raise FormatError(f"{first_file.path} has no attention weights shardkit knows ({scope}q_proj, qkv_proj)")
        if m is None:
            assert kv_rows is not None
            per_rank = kv_rows // dims.head_dim
            if per_rank * tp % dims.num_kv_heads:
                raise ConfigMismatchError(
                    f"k pieces of {per_rank} heads at tp {tp} do not fit {dims.num_kv_heads} kv heads: "
                    "the config does not match the shards (pass the right --config)"
                )
            m = max(1, per_rank * tp // dims.num_kv_heads)
    vpp = hints.get("vpp") or (_layer_runs(keys, family) if pp > 1 else 1)
    try:
        return Layout(
            tp=tp,
            pp=pp,
            ep=ep,
            kv_multiplier=m,
            qkv=qkv,
            kv_replication=hints.get("kv_replication") or "interleaved",
            vpp=vpp,
        )
    except LayoutError as e:
        raise FormatError(f"cannot infer the layout of the shards: {e}") from None


def _layer_runs(keys: set[str], family: Family) -> int:
    """Runs of consecutive layers in pp rank 0's file: its virtual stages (chunks). NxD gives a pp
    rank the chunks rank, rank + pp, ... of consecutive layers, so each chunk is one run."""
    head, tail = family.layer_prefix.split("{i}")
    pattern = re.compile("^" + re.escape(head) + r"(\d+)" + re.escape(tail))
    layers = sorted({int(match.group(1)) for k in keys if (match := pattern.match(k))})
    return 1 + sum(1 for a, b in zip(layers, layers[1:]) if b != a + 1)
