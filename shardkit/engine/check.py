"""inspect (what is this checkpoint?) and verify (do two checkpoints hold the same weights?).

Both take opened checkpoints of any kind (the api layer resolves paths and Hub repo ids) and
stream one tensor at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError, ShardkitError
from ..formats import Checkpoint, SourceReader
from ..formats.manifest import MANIFEST
from ..formats.registry import format_of_file
from ..io.data.buffers import one_torch_thread
from ..io.data.digest import FAST_DIGEST, file_digests, has_digest
from ..io.store import Store
from ..layout import Layout
from ..paths import UnsafePathError, inside, regular_file
from ..placements import Segment, SegmentIndex

log = logging.getLogger(__name__)


def _layout_from(ckpt: Checkpoint) -> str:
    if ckpt.format == "dcp":
        return "DCP chunks (each a slice of a full tensor)"
    if ckpt.format == "optimum-neuron":
        return "optimum-neuron's mp_metadata"
    return "manifest" if ckpt.manifest else ("full model" if ckpt.kind == "hf" else "inferred from files")


def _files_beside(ckpt: Checkpoint) -> int:
    """The files that belong to the rank files (xser's tensor and info files), counted apart."""
    if ckpt.kind != "sharded":
        return 0
    return sum(len(format_of_file(p, ckpt.format).files_of(p)) - 1 for p in ckpt.files.values())


def inspect_checkpoint(
    ckpt: Checkpoint, check_data: bool = False, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Describe a checkpoint: kind, format, family, layout, stages, files, tensors and problems.

    With `check_data`, also re-hash files against the manifest and compare every replicated
    copy of every slice (reads the whole checkpoint); the report's "checked" then says how many
    files were hashed and how many groups of copies were compared, and `progress(bytes_done,
    bytes_total)` follows the bytes read."""
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
        "convention": ckpt.convention,
        "family": ckpt.family.name,
        "model": {
            "model_type": dims.model_type,
            "layers": dims.num_layers,
            "hidden_size": dims.hidden_size,
            "heads": dims.num_heads,
            "kv_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "intermediate_size": dims.intermediate_size,
            "vocab_size": dims.vocab_size,
            "tied_embeddings": dims.tie_word_embeddings,
            "parameters": sum(_numel(s) for s in ckpt.full_shapes.values()),
        },
        "layout": ckpt.layout.to_dict(),
        "layout_from": _layout_from(ckpt),
        "dtype": str(ckpt.dtype()).replace("torch.", "") if not problems else None,
        "files": len(ckpt.files),
        "files_beside": _files_beside(ckpt),
        "bytes": ckpt.total_bytes(),
        "stages": _stages(ckpt.layout, dims.num_layers),
        "tensors": {n: list(s) for n, s in ckpt.full_shapes.items()},
        "problems": problems,
    }
    if check_data:
        # the files are hashed whatever else is wrong; copies are compared only when every file
        # holds what the layout says (else the slices cannot be located)
        index = ckpt.index() if not problems else None
        entries, bad = _manifest_entries(ckpt)
        problems += bad
        groups = _replica_groups(ckpt, index) if index is not None else []
        hash_bytes = sum(size for _, _, size, _ in entries)
        total = hash_bytes + sum(nbytes for _, _, nbytes in groups)
        tick = _Progress(progress, total)
        found, hashed, mismatched = _check_manifest_hashes(entries, tick, ckpt.store)
        problems += found
        found, differ = _check_replicas(ckpt, index, groups, tick) if index is not None else ([], 0)
        problems += found
        report["checked"] = {
            "files_hashed": hashed,
            "hash_mismatches": mismatched,
            "replica_groups": len(groups),
            "replica_mismatches": differ,
        }
    return report


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Progress:
    """Cumulative progress(bytes_done, bytes_total), or nothing."""

    def __init__(self, callback: Callable[[int, int], None] | None, total: int):
        self.callback, self.total, self.done = callback, total, 0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.callback:
            self.callback(self.done, self.total)


def _manifest_entries(ckpt: Checkpoint) -> tuple[list[tuple[str, Path, int, dict]], list[str]]:
    """The manifest's file entries as (name, path inside the folder, size, entry), and a problem
    line for every entry that is malformed, names a path outside the folder, or is missing."""
    if ckpt.manifest is None:
        return [], []
    files = ckpt.manifest.get("files") if isinstance(ckpt.manifest, dict) else None
    if not isinstance(files, list):
        return [], [f"{MANIFEST}: 'files' is not a list of files: the files cannot be checked (re-create the shards)"]
    entries, problems = [], []
    for i, entry in enumerate(files):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), str)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry.get("size"), bool)
            and has_digest(entry)
        ):
            problems.append(
                f"{MANIFEST}: files[{i}] is not {{path: str, size: int, xxh3_128 or sha256: str}}: it cannot be checked"
            )
            continue
        name = entry["path"]
        try:
            path = inside(ckpt.root, name, "manifest entry")
        except UnsafePathError as e:
            problems.append(str(e))
            continue
        if not path.exists():
            problems.append(f"{name} is listed in the manifest but missing")
            continue
        try:
            regular_file(path, "manifest entry")
        except ShardkitError as e:
            problems.append(str(e))
            continue
        entries.append((name, path, entry["size"], entry))
    return entries, problems


def _check_manifest_hashes(entries, tick: _Progress, store: Store | None = None) -> tuple[list[str], int, int]:
    """Re-hash every listed file (read through `store`) against every digest its entry lists
    (xxh3-128, sha256), in one read: (problems, files checked, files that differ from the manifest)."""
    problems, hashed, mismatched = [], 0, 0
    for name, path, size, entry in entries:
        hashed += 1
        same = path.stat().st_size == size
        if same:
            sha256, fast = file_digests(path, sha256=isinstance(entry.get("sha256"), str), store=store)
            same = entry.get("sha256", sha256) == sha256 and entry.get(FAST_DIGEST, fast) == fast
        if not same:
            mismatched += 1
            problems.append(
                f"{name} does not match its size and digests in the manifest: the file changed or is corrupt"
            )
        tick(size)
    return problems, hashed, mismatched


def _replica_groups(ckpt: Checkpoint, index: SegmentIndex) -> list[tuple[str, list, int]]:
    """(source, holdings, bytes to read) for every slice of a full tensor held more than once
    (replicated norms, kv replicas, tied lm_head)."""
    shapes = ckpt.full_shapes
    reader = SourceReader(ckpt, index=index)
    groups = []
    try:
        for source in index.sources():
            by_range: dict[tuple[int, int], list] = {}
            for h in index.holdings(source):
                by_range.setdefault((h.start, h.stop), []).append(h)
            copies = [hs for hs in by_range.values() if len(hs) > 1]
            if not copies:
                continue
            shape = shapes.get(source, ())
            dim = index.dim_of(source)
            row = _numel(shape) // shape[dim] if shape and shape[dim] else 0
            itemsize = reader.dtype_of(source).itemsize
            for hs in copies:
                groups.append((source, hs, len(hs) * (hs[0].stop - hs[0].start) * row * itemsize))
    finally:
        reader.close()
    return groups


def _check_replicas(ckpt: Checkpoint, index: SegmentIndex, groups, tick: _Progress) -> tuple[list[str], int]:
    """Every copy of every slice must hold the same bits (NaN equal to NaN)."""
    problems, differ = [], 0
    reader = SourceReader(ckpt, index=index)
    try:
        for source, holdings, nbytes in groups:
            ref = reader.read(holdings[0].read())
            for h in holdings[1:]:
                data = reader.read(h.read())
                if not _same(ref, data):
                    h0 = holdings[0]
                    problems.append(f"copies of {source}[{h0.start}:{h0.stop}] disagree ({h.holder} differs)")
                    differ += 1
                    break
            tick(nbytes)
    finally:
        reader.close()
    return problems, differ


# ---- comparing blocks ------------------------------------------------------------------------------

VERIFY_BLOCK_BYTES = 4 << 20
"""verify compares tensors in blocks of rows of about this many bytes (counted in float32)."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _isnan(t: torch.Tensor) -> torch.Tensor:
    try:
        return torch.isnan(t)
    except (RuntimeError, NotImplementedError):  # float8 and friends
        return torch.isnan(t.float())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits, except that NaN equals NaN in the same place."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        return _same(torch.view_as_real(a), torch.view_as_real(b))
    if not a.is_floating_point() or a.element_size() not in _INT_OF_SIZE:
        return torch.equal(a, b)
    bits = _INT_OF_SIZE[a.element_size()]
    ia, ib = a.view(bits), b.view(bits)
    if torch.equal(ia, ib):
        return True
    return bool(((ia == ib) | (_isnan(a) & _isnan(b))).all())


def _worst(a: torch.Tensor, b: torch.Tensor, work: torch.dtype) -> float:
    """The largest |a - b| of two blocks in `work` precision: NaN against NaN and an infinity
    against the same infinity count as 0, NaN against anything else as infinite."""
    if not a.numel():
        return 0.0
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex64)), torch.view_as_real(b.to(torch.complex64))
    x, y = a.to(work), b.to(work)
    d = (x - y).abs_()
    worst = float(d.max())
    if worst == worst:  # no NaN anywhere (nor an infinity facing the same one): the common case
        return worst
    d.masked_fill_(x == y, 0.0)
    nx, ny = torch.isnan(x), torch.isnan(y)
    d.masked_fill_(nx & ny, 0.0)
    d.masked_fill_(nx ^ ny, math.inf)
    return float(d.max())


def _row_blocks(shape: tuple[int, ...], block_bytes: int):
    """[start, stop) ranges of dim 0 of about `block_bytes` each (counted in float32)."""
    if not shape:
        return
    row = _numel(shape[1:])
    rows = max(1, block_bytes // max(1, row * 4))
    for start in range(0, shape[0], rows):
        yield start, min(shape[0], start + rows)


@dataclass
class TensorDiff:
    name: str
    max_abs_diff: float | None  # None when shapes differ or the tensor is missing on one side
    equal: bool  # the values agree (bit-exact, or within atol)
    note: str = ""
    dtype_a: str = ""  # the tensor's dtype in A and in B ("" when it is missing or of another shape)
    dtype_b: str = ""

    @property
    def dtype_differs(self) -> bool:
        return bool(self.dtype_a and self.dtype_b) and self.dtype_a != self.dtype_b


@dataclass
class VerifyReport:
    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    ignore_dtype: bool = False
    """Whether tensors of equal values in different dtypes count as equal (else each is a mismatch)."""

    @property
    def mismatches(self) -> list[TensorDiff]:
        """Tensors whose values differ, and (unless `ignore_dtype`) those stored in different dtypes."""
        return [t for t in self.tensors if not t.equal or (t.dtype_differs and not self.ignore_dtype)]

    @property
    def dtype_differences(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.dtype_differs]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def dtype_summary(self, shown: int = 3) -> str:
        """The tensors stored in different dtypes, in one phrase ("" when there are none): their
        count, each pair of dtypes, and the first names of each."""
        pairs: dict[tuple[str, str], list[str]] = {}
        for t in self.dtype_differences:
            pairs.setdefault((t.dtype_a, t.dtype_b), []).append(t.name)
        if not pairs:
            return ""
        count = len(self.dtype_differences)
        parts = []
        for (da, db), names in pairs.items():
            more = f" and {len(names) - shown} more" if len(names) > shown else ""
            parts.append(f"{da} in A, {db} in B: {', '.join(names[:shown])}{more}")
        return f"{count} {'tensors differ' if count != 1 else 'tensor differs'} in dtype ({'; '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "ok": self.ok,
            "mismatches": len(self.mismatches),
            "dtype_differences": {
                "count": len(self.dtype_differences),
                "ignored": self.ignore_dtype,
                "tensors": {t.name: [t.dtype_a, t.dtype_b] for t in self.dtype_differences},
            },
            "tensors": [asdict(t) for t in self.tensors],
        }


def check_atol(atol: object) -> float:
    """`atol` as a float, if it is a finite number >= 0; else a one-line ShardkitError (NaN would
    call every tensor different, a negative one even equal tensors)."""
    try:
        value = float(atol)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(atol, bool) or not math.isfinite(value) or value < 0:
        raise ShardkitError(
            f"--atol {atol!r} is not a finite number >= 0: give the largest absolute difference to allow (0: bit-exact)"
        )
    return value


def verify_checkpoints(
    ca: Checkpoint,
    cb: Checkpoint,
    *,
    atol: float = 0.0,
    on_tensor: Callable[[TensorDiff], None] | None = None,
    names: tuple[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    ignore_dtype: bool = False,
) -> VerifyReport:
    """Compare two checkpoints (any formats and layouts) tensor by tensor in full-weight space;
    `names` are how the report calls them (default: their paths).

    Each tensor is read from both sides in blocks of rows (VERIFY_BLOCK_BYTES), never whole.
    With atol 0 and equal dtypes the blocks must hold the same bits (NaN equals NaN in the same
    place); otherwise they are compared in float32 (float64 when both are), and a tensor is
    equal when its largest |a - b| is at most `atol` (NaN must face NaN, an infinity the same
    infinity). A tensor stored in different dtypes is a mismatch unless `ignore_dtype` (the report
    names them either way). `progress(bytes_done, bytes_total)` counts the bytes of A's tensors."""
    atol = check_atol(atol)
    ca.check_files()
    cb.check_files()
    report = VerifyReport(*(names or (str(ca.root), str(cb.root))), ignore_dtype=ignore_dtype)
    shapes_a, shapes_b = ca.full_shapes, cb.full_shapes
    ra, rb = SourceReader(ca), SourceReader(cb)
    try:
        with one_torch_thread():  # blocks of a few MiB
            dtypes_a = {n: ra.dtype_of(n) for n in shapes_a}
            tick = _Progress(progress, sum(_numel(s) * dtypes_a[n].itemsize for n, s in shapes_a.items()))
            for name in list(shapes_a) + [n for n in shapes_b if n not in shapes_a]:
                if name not in shapes_b or name not in shapes_a:
                    diff = TensorDiff(name, None, False, f"only in {'a' if name in shapes_a else 'b'}")
                elif shapes_a[name] != shapes_b[name]:
                    diff = TensorDiff(name, None, False, f"shape {shapes_a[name]} vs {shapes_b[name]}")
                else:
                    diff = _compare_tensor(name, shapes_a[name], ra, rb, dtypes_a[name], rb.dtype_of(name), atol, tick)
                if name in shapes_a and diff.max_abs_diff is None:
                    tick(_numel(shapes_a[name]) * dtypes_a[name].itemsize)
                ra.forget()
                rb.forget()
                report.tensors.append(diff)
                if on_tensor:
                    on_tensor(diff)
    finally:
        ra.close()
        rb.close()
    return report


def _compare_tensor(
    name: str,
    shape: tuple[int, ...],
    ra: SourceReader,
    rb: SourceReader,
    da: torch.dtype,
    db: torch.dtype,
    atol: float,
    tick: _Progress,
) -> TensorDiff:
    exact = atol == 0 and da == db
    work = torch.float64 if da == db == torch.float64 else torch.float32
    equal, worst = True, 0.0
    blocks: Iterator[tuple[torch.Tensor, torch.Tensor]]
    if shape:
        blocks = (
            (ra.read_rows(name, start, stop), rb.read_rows(name, start, stop))
            for start, stop in _row_blocks(shape, VERIFY_BLOCK_BYTES)
        )
    else:
        whole = Segment(name, 0, 0, 1)
        blocks = iter([(ra.read_segment(whole), rb.read_segment(whole))])
    for ta, tb in blocks:
        if tuple(ta.shape) != tuple(tb.shape):
            raise FormatError(f"{name}: read blocks of shapes {tuple(ta.shape)} and {tuple(tb.shape)}")
        if not exact:
            worst = max(worst, _worst(ta, tb, work))
        elif not _same(ta, tb):
            equal = False
            worst = max(worst, _worst(ta, tb, work))
        tick(ta.numel() * ta.element_size())
        del ta, tb
    note = "" if da == db else f"dtype {da} vs {db}".replace("torch.", "")
    if exact and not equal and worst == 0:
        note = "same values, different bits (signed zeros)"
    return TensorDiff(name, worst, equal if exact else worst <= atol, note, _dtype_name(da), _dtype_name(db))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _stages(layout: Layout, num_layers: int) -> list[dict[str, Any]]:
    """Each pp rank's first and last layer; with virtual stages also each of its chunks' runs."""
    chunks = layout.chunk_layers(num_layers)
    out: list[dict[str, Any]] = []
    for stage, layers in enumerate(layout.stage_layers(num_layers)):
        entry: dict[str, Any] = {"stage": stage, "layers": [layers[0], layers[-1]] if layers else []}
        if layout.vpp > 1:
            entry["chunks"] = [[chunks[c][0], chunks[c][-1]] for c in layout.rank_chunks(stage) if len(chunks[c])]
        out.append(entry)
    return out
