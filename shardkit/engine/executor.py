"""The streaming executor: build each output file from exactly the source slices it needs.

Sources are read positionally (nothing is memory-mapped), so memory stays near one output
tensor (torch, xser) or one block of rows (formats with chunked writes) per worker, whatever
the model size. Workers are threads over output files (copies and I/O release the GIL).
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import FormatError
from ..formats import Checkpoint, SourceReader, get_format
from ..formats.reader import HashCheck
from ..formats.base import FileRecord, TensorSpec, reused_buffers
from .outputs import OutputFile

ProgressCallback = Callable[[int, int], None]
"""Called as progress(bytes_done_now, bytes_total) while output is written."""


def execute(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    out_root: Path,
    fmt: str,
    dtype: torch.dtype | None = None,
    workers: int = 1,
    progress: ProgressCallback | None = None,
    verify_hashes: bool = True,
) -> list[FileRecord]:
    """Write every output file from `src`; returns the records of the files written.

    With `verify_hashes`, each source file the manifest lists is checked against its sha256 (once
    per file), in a background thread while the files are written, and before this returns: a
    mismatch raises FormatError and nothing is committed."""
    file_format = get_format(fmt)
    index = src.index()
    source_dtypes = check_dtypes(src)
    hashes = None
    if verify_hashes:  # only the files this process reads (under torchrun, its share of the outputs)
        needed = {r.holder for out in outputs for p in out.pieces for seg in p.segments for r in index.locate(seg)}
        hashes = HashCheck(src).start([key for key in src.files if key in needed])
    dtypes: dict[str, torch.dtype] = {}
    for out in outputs:
        for piece in out.pieces:
            source = piece.segments[0].source
            if source not in dtypes:
                if source not in source_dtypes:
                    raise FormatError(f"no file holds {source}")
                dtypes[source] = dtype or source_dtypes[source]
    total = sum(p.numel() * dtypes[p.segments[0].source].itemsize for o in outputs for p in o.pieces)
    done = 0
    lock = threading.Lock()

    def build(out: OutputFile) -> list[FileRecord]:
        with reused_buffers():  # every tensor read is written and dropped before the next read
            return build_file(out)

    def build_file(out: OutputFile) -> list[FileRecord]:
        nonlocal done
        specs = [TensorSpec(p.name, p.shape, dtypes[p.segments[0].source]) for p in out.pieces]
        writer = file_format.writer(out_root / out.path, out_root, specs, out.expert_parallel)
        reader = SourceReader(src, index=index, hashes=hashes)
        try:
            for piece, spec in zip(out.pieces, specs):
                blocks = reader.row_blocks(piece) if file_format.chunked_writes else None
                if blocks is not None:
                    writer.write_chunks(piece.name, blocks)
                else:
                    tensor = reader.read_piece(piece)
                    if tensor.dtype != spec.dtype:
                        tensor = tensor.to(spec.dtype)
                    if tuple(tensor.shape) != piece.shape:
                        raise FormatError(f"{piece.name}: read shape {tuple(tensor.shape)}, expected {piece.shape}")
                    writer.write(piece.name, tensor)
                    del tensor
                if progress:
                    with lock:
                        done += spec.nbytes
                        progress(done, total)
        finally:
            reader.close()
        return writer.close()

    records: list[FileRecord] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the work is copies; torch's intra-op threads only contend
    try:
        _write_all(build, outputs, workers, records)
        if hashes is not None:
            hashes.finish()  # before anything is committed: corrupt sources never reach the destination
    except KeyboardInterrupt:
        if hashes is not None:
            hashes.stop()
        raise
    except BaseException as e:
        mismatch = hashes.failure() if hashes is not None else None
        if mismatch is not None and mismatch is not e:
            raise mismatch from None
        raise
    finally:
        torch.set_num_threads(threads)
    return records


def _write_all(build, outputs, workers: int, records: list[FileRecord]) -> None:
    """Every output file, by `workers` threads; on an error or Ctrl-C the files not started are
    cancelled (not finished first)."""
    if workers <= 1:
        for out in outputs:
            records += build(out)
        return
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        for result in pool.map(build, outputs):
            records += result
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def check_dtypes(src: Checkpoint) -> dict[str, torch.dtype]:
    """The dtype of every full tensor, read from the files' headers (each file opened once); all
    pieces of one full tensor must share it, else FormatError naming the odd file and tensor."""
    seen: dict[str, list[tuple[torch.dtype, str, str]]] = {}
    for key, pieces in src.holdings.items():
        if not pieces:
            continue
        file = src.open(key)
        try:
            for piece in pieces:
                found = file.dtype(piece.name)
                for seg in piece.segments:
                    seen.setdefault(seg.source, []).append((found, key, piece.name))
        finally:
            file.close()
    overall = Counter(d for held in seen.values() for d, _, _ in held)
    dtypes: dict[str, torch.dtype] = {}
    for source, held in seen.items():
        counts = Counter(d for d, _, _ in held)
        if len(counts) > 1:
            common = max(counts, key=lambda d: (counts[d], overall[d]))
            odd, key, name = next(h for h in held if h[0] != common)
            raise FormatError(
                f"{key}: {name} is {str(odd).replace('torch.', '')} but the other pieces of {source} are "
                f"{str(common).replace('torch.', '')}: the shards are corrupt or mixed from different checkpoints")
        dtypes[source] = held[0][0]
    return dtypes
