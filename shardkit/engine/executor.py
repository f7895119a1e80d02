"""The streaming executor: build each output file from exactly the source slices it needs.

Sources are read positionally (nothing is memory-mapped), so memory stays near one output
tensor (torch, xser) or one block of rows (formats with chunked writes) per worker, whatever
the model size. Workers are threads over output files (copies and I/O release the GIL).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import FormatError
from ..formats import Checkpoint, SourceReader, get_format
from ..formats.base import FileRecord, TensorSpec
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
) -> list[FileRecord]:
    """Write every output file from `src`; returns the records of the files written."""
    file_format = get_format(fmt)
    index = src.index()
    probe = SourceReader(src, index=index)
    dtypes: dict[str, torch.dtype] = {}
    try:
        for out in outputs:
            for piece in out.pieces:
                source = piece.segments[0].source
                if source not in dtypes:
                    dtypes[source] = dtype or probe.dtype_of(source)
    finally:
        probe.close()
    total = sum(p.numel() * dtypes[p.segments[0].source].itemsize for o in outputs for p in o.pieces)
    done = 0
    lock = threading.Lock()

    def build(out: OutputFile) -> list[FileRecord]:
        nonlocal done
        specs = [TensorSpec(p.name, p.shape, dtypes[p.segments[0].source]) for p in out.pieces]
        writer = file_format.writer(out_root / out.path, out_root, specs, out.expert_parallel)
        reader = SourceReader(src, index=index)
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
        if workers <= 1:
            for out in outputs:
                records += build(out)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for result in pool.map(build, outputs):
                    records += result
    finally:
        torch.set_num_threads(threads)
    return records
