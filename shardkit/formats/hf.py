"""Hugging Face model directories (and single state-dict files): find the weights, write them.

Read: `model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
`pytorch_model.bin` (single or with index), or one torch state-dict file (NxD's merge output).
Write: config.json (+ generation config and tokenizer files), safetensors split by size with
huggingface_hub's splitter, and the index when there is more than one file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory

from ..errors import FormatError
from ..io.safety.small import COPY_LIMIT, check_small, copy_small, read_json
from ..io.store import Store
from ..paths import member
from .safetensors_io import read_header
from .torch_io import regular

SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",  # BERT's WordPiece vocabulary
    "chat_template.jinja",
)


def weight_files(path: Path, strict: bool = True) -> list[Path]:
    """The weight files of an HF model directory, safetensors preferred over .bin.

    Names an index lists must stay inside the directory (no absolute paths, no `..`), and every
    weight file must be a regular file (a folder, FIFO or device is refused, never read)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.exists():
            try:
                weight_map = read_json(index, "index", within=path)["weight_map"]
            except (KeyError, TypeError):
                raise FormatError(f"{index} is not a valid index (no weight_map): re-create it") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise FormatError(f"{index} is not a valid index (weight_map is not names -> file names): re-create it")
            files = sorted({member(path, f, f"{index_name} entry") for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise FormatError(f"{index.name} names {missing[0]}, which is missing from {path}")
            return [regular(f, "weight file") for f in files]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).exists():
            return [regular(path / name, "weight file")]
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(path.glob(pattern))
        if files:
            return [regular(f, "weight file") for f in files]
    if strict:
        raise FormatError(f"{path} has config.json but no weights (*.safetensors or pytorch_model*.bin)")
    return []


def tensor_names(file: Path, store: Store | None = None) -> list[str]:
    """Names in a weight file, cheaply (safetensors header, or a torch file's metadata), read
    through `store` (default: a local folder)."""
    if file.suffix == ".safetensors":
        return [k for k in read_header(file, store) if k != "__metadata__"]
    from .torch_io import TorchFile

    reader = TorchFile(file, store=store)
    names = reader.keys()
    reader.close()
    return names


def side_files(src: Path, names: Iterable[str] = SIDE_FILES) -> list[str]:
    """The side files (`names`: generation config, tokenizer and chat files) `src` holds, each
    checked as `copy_side_files` will read it: a regular file inside `src`, or a link that stays
    inside it. A link leading outside `src`, a dangling one or a loop is refused in one line
    (io.safety.small.SmallFileError), before anything is written."""
    found = []
    for name in names:
        if os.path.lexists(src / name):
            check_small(src / name, "side file", COPY_LIMIT, within=src)
            found.append(name)
    return found


def copy_side_files(src: Path, dst: Path, names: Iterable[str] = SIDE_FILES) -> list[str]:
    """Copy the side files `src` holds (`side_files`) into `dst`, through the I/O core's reader
    (io.safety.small.copy_small: read within `src`, never through a link out of it; the copy is no more
    readable than the source file). Returns the names copied."""
    copied = side_files(src, names)
    for name in copied:
        copy_small(src / name, dst / name, "side file", within=src)
    return copied


def split_into_files(sizes: dict[str, int], max_shard_size: int | str) -> tuple[dict[str, list[str]], dict | None]:
    """Split tensors (name -> bytes) into safetensors files as transformers names them.

    Returns file -> tensor names, and the index dict (None for a single file)."""
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(split.tensor_to_filename)}
    return dict(split.filename_to_tensors), index
