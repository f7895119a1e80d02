"""LoRA adapter checkpoints (the trainer's `--lora-rank` runs) out of NxD's tree: a PEFT adapter
folder, or the base model with the adapters merged in.

An adapter checkpoint holds only A and B of each adapted layer, in any tp/pp layout (the adapter
family of `families.lora`). `write_peft` gathers them into the folder peft loads
(`PeftModel.from_pretrained(base, folder)`): `adapter_model.safetensors` under peft's names and
`adapter_config.json`. The trainer's `--export-lora` and `shardkit ckpt export` both write it here.
`merged_view` is the base model as a `Checkpoint` whose adapted weights read as W + (alpha / r) B A,
so the engine's merge writes the merged Hugging Face model one tensor (or block of rows) at a
time, from a base of any layout.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..distributed import Job, current_job
from ..errors import ConfigMismatchError
from ..families.lora import TARGETS, LoraSettings, adapted_weights, base_config, saved_settings
from ..formats import Checkpoint, SourceReader
from ..formats.base import TensorFile, TensorSpec
from ..formats.safetensors_io import SafetensorsWriter
from ..io.data.digest import FileRecord, Recording
from ..io.safety.durable import write_text
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.transaction import commit_all, staged_output
from ..io.store import joined
from ..layout import ModelDims
from ..placements import Piece, make_piece, whole
from .tree import tag_check

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_CACHE = 8  # modules whose full A and B a merged view keeps (the adapters of a few layers)


def settings_of(ckpt: Checkpoint) -> LoraSettings | None:
    """The LoRA settings of an opened checkpoint (None: it holds full weights)."""
    return saved_settings(ckpt.config)


def peft_config(settings: LoraSettings, base_model: str | None) -> dict[str, Any]:
    """adapter_config.json as peft reads it (LoraConfig fields)."""
    alpha: float | int = int(settings.alpha) if float(settings.alpha).is_integer() else settings.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS[t].split(".")[-1] for t in settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def _whole_piece(ckpt: Checkpoint, name: str) -> Piece:
    shapes = ckpt.full_shapes
    return make_piece(name, [whole(name, shapes, ckpt.family.split_dims(ckpt.dims)[name])], shapes)


def write_peft(
    adapters: Checkpoint,
    folder: Path,
    base_model: str | None,
    dtype: torch.dtype | None = None,
    sink: Sink = NO_SINK,
) -> list[FileRecord]:
    """Write the PEFT adapter files of `adapters` (an adapter checkpoint of any layout) into
    `folder` (a staging folder): the full A and B of every layer, gathered one at a time and
    streamed into `adapter_model.safetensors` under peft's names, and `adapter_config.json` naming
    `base_model`. `dtype`: cast the adapters (default: as stored); `sink`: the output's, which
    the adapter file is handed to once written (`io.safety.sinks`)."""
    settings = settings_of(adapters)
    if settings is None:
        raise ConfigMismatchError(f"{adapters.root} holds full weights, not LoRA adapters")
    shapes = adapters.full_shapes
    dtype = dtype or adapters.dtype()
    specs = [TensorSpec(PEFT_PREFIX + n, tuple(s), dtype) for n, s in shapes.items()]
    reader = SourceReader(adapters)
    try:
        writer = SafetensorsWriter(folder / ADAPTER_FILE, folder, specs, digests=Recording.NONE, sink=sink)
        try:
            for name in shapes:
                writer.write(PEFT_PREFIX + name, reader.read_piece(_whole_piece(adapters, name)).to(dtype).contiguous())
        except BaseException:
            writer.abort()
            raise
        records = writer.close()
    finally:
        reader.close()
    text = json.dumps(peft_config(settings, base_model), indent=2) + "\n"
    write_text(folder / ADAPTER_CONFIG, text, fsync=False)
    return [*records, FileRecord(ADAPTER_CONFIG, len(text.encode()), None)]


def export_peft(
    adapters: Checkpoint,
    dst: str | Path,
    base_model: str | None,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    verify_hashes: bool = True,
    job: Job | None = None,
    sink: Sink = NO_SINK,
) -> list[FileRecord]:
    """The PEFT adapter folder of the adapter checkpoint tag `adapters` as the new folder `dst`
    (written by the job's leader through a staged output; the tag is checked against its manifest
    and for changes before the commit; `sink`: where its finished files go, `io.safety.sinks`)."""
    job = job or current_job()
    tag_dir = adapters.root
    records: list[FileRecord] = []
    with staged_output(dst, sources=[tag_dir], overwrite=overwrite, what="ckpt export", job=job, sink=sink) as out:

        def write() -> None:
            if job.leader:
                check = tag_check(tag_dir, verify_hashes, adapters.store)
                try:
                    records.extend(write_peft(adapters, out.path, base_model, dtype, out.sink))
                except BaseException:
                    check.stop()
                    raise
                check.finish()

        job.run_all_or_none(write)
        commit_all(out, job)
    return records


# ---- the base model with the adapters merged in -----------------------------------------------------


class _Adapters:
    """The full A and B of the adapted modules, read on first use from the adapter checkpoint and
    kept for the last ADAPTER_CACHE modules (shared by the view's readers, one thread at a time)."""

    def __init__(self, adapters: Checkpoint, settings: LoraSettings):
        self.ckpt, self.scale = adapters, settings.scale
        self.modules = adapted_weights(adapters.family, settings, adapters.dims.num_layers)
        self._held: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if module in self._held:
                self._held.move_to_end(module)
                return self._held[module]
            reader = SourceReader(self.ckpt)
            try:
                a, b = (reader.read_piece(_whole_piece(self.ckpt, f"{module}.lora_{x}.weight")).float() for x in "AB")
            finally:
                reader.close()
            self._held[module] = (a, b)
            if len(self._held) > ADAPTER_CACHE:
                self._held.popitem(last=False)
            return a, b

    def delta(self, piece: Piece, dim: int, start: int | None, stop: int | None) -> torch.Tensor | None:
        """scale * B A over the part [start, stop) along `dim` of a 2-D piece (its segments'
        rows or columns of their weights; zero where a segment's weight is not adapted), or None
        when the piece holds no adapted weight."""
        if piece.stacked or piece.transposed or not any(s.source in self.modules for s in piece.segments):
            return None
        cat = piece.cat_dim
        lo, hi = start or 0, piece.shape[dim] if stop is None else stop
        parts, offset = [], 0
        for seg in piece.segments:
            span = (seg.start, seg.stop)  # along cat, in the weight's coordinates
            other = (0, piece.shape[1 - cat])  # the other axis: whole in every segment
            if dim == cat:
                first, offset = offset, offset + seg.length
                a, b = max(lo, first), min(hi, offset)
                if a >= b:
                    continue
                span = (seg.start + a - first, seg.start + b - first)
            else:
                other = (lo, hi)
            rows, cols = (span, other) if cat == 0 else (other, span)
            parts.append(self._block(seg.source, rows, cols))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=cat)

    def _block(self, source: str, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        module = self.modules.get(source)
        if module is None:
            return torch.zeros(rows[1] - rows[0], cols[1] - cols[0])
        A, B = self.pair(module)
        return (self.scale * B[rows[0] : rows[1]]) @ A[:, cols[0] : cols[1]]


class _MergedFile:
    """A base file whose adapted weights read as W + scale * B A (added in fp32, cast back)."""

    def __init__(self, base: TensorFile, pieces: Mapping[str, Piece], adapters: _Adapters):
        self.base, self.pieces, self.adapters, self.path = base, pieces, adapters, base.path

    def keys(self) -> list[str]:
        return self.base.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.base.dtype(name)

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor = self.base.read(name, dim, start, stop)
        piece = self.pieces.get(name)
        delta = self.adapters.delta(piece, dim, start, stop) if piece is not None else None
        return tensor if delta is None else (tensor.float() + delta).to(tensor.dtype)

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        return False

    def watch(self) -> Any:
        """The base file's stamp (a base changed while the merge reads it is refused)."""
        watch = getattr(self.base, "watch", None)
        return watch() if watch is not None else None

    def close(self) -> None:
        self.base.close()


class _MergedCheckpoint(Checkpoint):
    adapters: _Adapters

    def open(self, key: str) -> _MergedFile:
        return _MergedFile(super().open(key), {p.name: p for p in self.holdings[key]}, self.adapters)


def merged_view(base: Checkpoint, adapters: Checkpoint) -> Checkpoint:
    """`base` (the model the adapters were trained on, any layout) as a Checkpoint whose adapted
    weights read merged: what `merge` writes as the merged Hugging Face model. Refused when `base`
    is not the model the adapter checkpoint records (its family or dimensions differ)."""
    settings = settings_of(adapters)
    if settings is None:
        raise ConfigMismatchError(f"{adapters.root} holds full weights, not LoRA adapters")
    want = ModelDims.from_config(base_config(adapters.config))
    if base.dims != want:  # (model_type included)
        field = next(f for f in want.__dataclass_fields__ if getattr(want, f) != getattr(base.dims, f))
        raise ConfigMismatchError(
            f"{base.root} is not the model the adapters were trained on ({field} {getattr(base.dims, field)!r}, "
            f"the adapters' model has {getattr(want, field)!r}): pass that model with --base"
        )
    view = _MergedCheckpoint(**base.__dict__)
    view.store = joined(base.store, adapters.store)
    view.adapters = _Adapters(adapters, settings)
    return view
