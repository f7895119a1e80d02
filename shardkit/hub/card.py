"""The model card (README.md) of a pushed model: base model, the layout it was trained in, the
command that produced it, tensor count and size."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..conventions import CONVENTIONS
from ..errors import ShardkitError
from ..formats import Checkpoint, get_format, hf, is_plain_hf_dir, open_checkpoint
from ..formats.safetensors_io import read_header
from ..formats.torch_io import TorchFile
from ..io.safety.small import SmallFileError, read_json
from ..sizes import format_bytes
from ..version import __version__
from .download import missing_local_path

_CACHE_REPO = re.compile(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]")


def weight_stats(folder: Path) -> dict[str, Any]:
    """Tensor count, parameters, bytes and dtypes of an HF directory's weights (headers only)."""
    tensors = params = nbytes = 0
    dtypes: set[str] = set()
    for file in hf.weight_files(Path(folder)):
        if file.suffix == ".safetensors":
            for name, entry in read_header(file).items():
                if name == "__metadata__":
                    continue
                tensors += 1
                params += math.prod(entry["shape"])
                nbytes += entry["data_offsets"][1] - entry["data_offsets"][0]
                dtypes.add(entry["dtype"])
        else:
            reader = TorchFile(file)
            try:
                for name in reader.keys():
                    shape, dtype = reader.shape(name), reader.dtype(name)
                    tensors += 1
                    params += math.prod(shape)
                    nbytes += math.prod(shape) * dtype.itemsize
                    dtypes.add(str(dtype).replace("torch.", ""))
            finally:
                reader.close()
    return {"tensors": tensors, "parameters": params, "bytes": nbytes, "dtypes": sorted(dtypes)}


def _base_model(origin: Path | None, manifest: Mapping | None, config: Mapping | None) -> str | None:
    candidates = []
    if manifest and manifest.get("source"):
        candidates.append(str(manifest["source"]))
    if origin is not None:
        candidates.append(str(Path(origin).absolute()))
    for text in candidates:
        if m := _CACHE_REPO.search(text + "/"):
            return f"{m.group(1)}/{m.group(2)}"
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and "/" in name and not Path(name).exists() and missing_local_path(name) is None:
        return name
    return None


def _describe_origin(origin, config=None, hints=None) -> tuple[str, Mapping | None]:
    """How the weights were laid out before the merge (a path or an opened Checkpoint), and the
    shards' manifest if any."""
    if origin is None:
        return "not known (pushed from a Hugging Face directory)", None
    ckpt = origin if isinstance(origin, Checkpoint) else None
    if ckpt is None:
        origin = Path(origin)
        if is_plain_hf_dir(origin) or origin.is_file():
            return "not sharded (a Hugging Face checkpoint)", None
        try:
            ckpt = open_checkpoint(origin, config, hints)
        except ShardkitError:
            return "sharded (layout not recorded)", None
    if ckpt.kind == "hf":
        return "not sharded (a Hugging Face checkpoint)", None
    if ckpt.format == "dcp":
        names = CONVENTIONS[ckpt.convention].label
        return f"a PyTorch DCP checkpoint ({names} tensor names, {ckpt.family.name} family)", ckpt.manifest
    return (
        f"{ckpt.layout.describe()} ({get_format(ckpt.format).label} shards, {ckpt.family.name} family)",
        ckpt.manifest,
    )


def model_card(
    folder: Path,
    repo_id: str,
    *,
    origin=None,
    command: str | None = None,
    base_model: str | None = None,
    config: str | Path | Mapping | None = None,
    hints: Mapping | None = None,
) -> str:
    """README.md for a pushed model: base model, the layout it was trained in, the shardkit
    command that produced it, tensor count and size. `origin`: the checkpoint (path or opened
    Checkpoint) the directory was merged from."""
    folder = Path(folder)
    stats = weight_stats(folder)
    layout, manifest = _describe_origin(origin, config, hints)
    origin_path = origin.root if isinstance(origin, Checkpoint) else (Path(origin) if origin is not None else None)
    try:
        cfg = read_json(folder / "config.json", "config", within=folder)
    except SmallFileError:
        cfg = {}
    base = base_model or _base_model(origin_path, manifest, cfg)
    architecture = ", ".join(cfg.get("architectures") or []) or cfg.get("model_type", "unknown")
    size = stats["bytes"]
    size_text = format_bytes(size)
    meta = ["---", "library_name: transformers"]
    if base:
        meta.append(f"base_model: {base}")
    meta += ["tags:", "- shardkit", "---", ""]
    rows = [
        ("Base model", f"[{base}](https://huggingface.co/{base})" if base else "not recorded"),
        ("Architecture", architecture),
        ("Trained in (layout)", layout),
        ("Tensors", f"{stats['tensors']:,}"),
        ("Parameters", f"{stats['parameters']:,}"),
        ("Size", f"{size_text} ({size:,} bytes), {', '.join(stats['dtypes']) or 'n/a'}"),
        ("Produced by", f"`{command}`" if command else f"shardkit {__version__}"),
    ]
    if manifest and manifest.get("command"):
        rows.append(("Shards written by", f"`{manifest['command']}`"))
    lines = meta + [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"Weights in Hugging Face format (safetensors), uploaded with shardkit {__version__}.",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in rows]
    lines += [
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        "```",
        "",
    ]
    return "\n".join(lines)
