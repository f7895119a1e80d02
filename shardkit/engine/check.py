"""inspect (what is this checkpoint?) and verify (do two checkpoints hold the same weights?).

Both take opened checkpoints of any kind (the api layer resolves paths and Hub repo ids) and
stream one tensor at a time.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..errors import ShardkitError
from ..formats import Checkpoint, SourceReader
from ..formats.manifest import file_sha256
from ..placements import Segment

log = logging.getLogger(__name__)


def inspect_checkpoint(ckpt: Checkpoint, check_data: bool = False) -> dict[str, Any]:
    """Describe a checkpoint: kind, format, family, layout, stages, files, tensors and problems.

    With `check_data`, also re-hash files against the manifest and compare every replicated
    copy of every slice (reads the whole checkpoint)."""
    problems: list[str] = []
    try:
        ckpt.check_files()
    except ShardkitError as e:
        problems.append(str(e))
    dims = ckpt.dims
    report: dict[str, Any] = {
        "path": str(ckpt.root),
        "kind": ckpt.kind,
        "format": ckpt.format,
        "naming": ckpt.naming,
        "family": ckpt.family.name,
        "model": {
            "model_type": dims.model_type, "layers": dims.num_layers, "hidden_size": dims.hidden_size,
            "heads": dims.num_heads, "kv_heads": dims.num_kv_heads, "head_dim": dims.head_dim,
            "intermediate_size": dims.intermediate_size, "vocab_size": dims.vocab_size,
            "tied_embeddings": dims.tie_word_embeddings,
            "parameters": sum(_numel(s) for s in ckpt.full_shapes.values()),
        },
        "layout": ckpt.layout.to_dict(),
        "layout_from": "manifest" if ckpt.manifest else ("full model" if ckpt.kind == "hf" else "inferred from files"),
        "dtype": str(ckpt.dtype()).replace("torch.", "") if not problems else None,
        "files": len(ckpt.files),
        "bytes": ckpt.total_bytes(),
        "stages": [
            {"stage": s, "layers": [r.start, r.stop - 1] if len(r) else []}
            for s, r in enumerate(ckpt.layout.stage_layers(dims.num_layers))
        ],
        "tensors": {n: list(s) for n, s in ckpt.full_shapes.items()},
        "problems": problems,
    }
    if check_data and not problems:
        problems += _check_manifest_hashes(ckpt)
        problems += _check_replicas(ckpt)
    return report


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_manifest_hashes(ckpt: Checkpoint) -> list[str]:
    problems = []
    for entry in (ckpt.manifest or {}).get("files", []):
        path = ckpt.root / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']} is listed in the manifest but missing")
            continue
        if path.stat().st_size != entry["size"] or file_sha256(path) != entry["sha256"]:
            problems.append(f"{entry['path']} does not match its sha256 in the manifest: the file changed or is corrupt")
    return problems


def _check_replicas(ckpt: Checkpoint) -> list[str]:
    """Every copy of every slice (replicated norms, kv replicas, tied lm_head) must agree."""
    problems = []
    index = ckpt.index()
    reader = SourceReader(ckpt)
    try:
        for source in index.sources():
            seen: dict[tuple[int, int], torch.Tensor] = {}
            for h in index.holdings(source):
                data = reader.read(h.read())
                ref = seen.setdefault((h.start, h.stop), data)
                if ref is not data and not torch.equal(ref, data):
                    problems.append(f"copies of {source}[{h.start}:{h.stop}] disagree ({h.holder} differs)")
                    break
    finally:
        reader.close()
    return problems


@dataclass
class TensorDiff:
    name: str
    max_abs_diff: float | None  # None when shapes differ or the tensor is missing on one side
    equal: bool
    note: str = ""


@dataclass
class VerifyReport:
    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def mismatches(self) -> list[TensorDiff]:
        return [t for t in self.tensors if not t.equal]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "ok": self.ok, "mismatches": len(self.mismatches),
                "tensors": [asdict(t) for t in self.tensors]}


def verify_checkpoints(
    ca: Checkpoint,
    cb: Checkpoint,
    *,
    atol: float = 0.0,
    on_tensor: Callable[[TensorDiff], None] | None = None,
    names: tuple[str, str] | None = None,
) -> VerifyReport:
    """Compare two checkpoints (any formats and layouts) tensor by tensor in full-weight space;
    `names` are how the report calls them (default: their paths)."""
    ca.check_files()
    cb.check_files()
    report = VerifyReport(*(names or (str(ca.root), str(cb.root))))
    shapes_a, shapes_b = ca.full_shapes, cb.full_shapes
    ra, rb = SourceReader(ca), SourceReader(cb)
    dims_a = ca.family.split_dims(ca.dims)
    try:
        for name in list(shapes_a) + [n for n in shapes_b if n not in shapes_a]:
            if name not in shapes_b or name not in shapes_a:
                diff = TensorDiff(name, None, False, f"only in {'a' if name in shapes_a else 'b'}")
            elif shapes_a[name] != shapes_b[name]:
                diff = TensorDiff(name, None, False, f"shape {shapes_a[name]} vs {shapes_b[name]}")
            else:
                dim = dims_a[name]
                seg = Segment(name, dim, 0, shapes_a[name][dim] if shapes_a[name] else 1)
                ta, tb = ra.read_segment(seg), rb.read_segment(seg)
                worst = (ta.double() - tb.double()).abs().max().item() if ta.numel() else 0.0
                note = "" if ta.dtype == tb.dtype else f"dtype {ta.dtype} vs {tb.dtype}".replace("torch.", "")
                equal = worst <= atol if atol > 0 or ta.dtype != tb.dtype else torch.equal(ta, tb)
                diff = TensorDiff(name, worst, equal, note)
            report.tensors.append(diff)
            if on_tensor:
                on_tensor(diff)
    finally:
        ra.close()
        rb.close()
    return report
