"""Streamed sources (`io.objects.remote`). A merge reads all of its source once. Fetched whole into a
mirror on disk first, the source would need its own size of local disk, its bytes would be
written twice locally (the mirror, then the output) and the engine would wait for the last byte
before the first output byte. Instead, a source whose every file can be checked as it arrives
(its manifest lists block digests, see `io.data.digest.BLOCK_SIZE`, as every output shardkit writes to
object storage does; or it has no manifest, or is not to be checked) is streamed:

- its mirror lives in MEMORY_DIR (a memory file system) when that can punch holes and the source
  is at most a quarter of the available memory, else in the system's temporary folder; its
  tensor files' metadata is fetched as for Need.METADATA, but of a torch file's local headers
  only the first tensor record's: `formats.torch_zip` predicts the others' data offsets from the
  central directory and checks them against the real headers before the output is committed
  (`check_later`);
- a feeder fetches every part (PART bytes) in the order the engine's plan first reads them
  (`expect`, `order_parts`), then the rest, while fewer than STREAM_BUDGET bytes are held
  (fetched or on their way, not yet dropped); readers that reach bytes the feeder has not fetched
  get them on demand, outside the budget;
- each block is checked against its digest as soon as all its bytes are there (`check_blocks`);
- once read (`MirrorFile.after`, called by every read path of `io.data`), the bytes the plan reads exactly once are
  punched out of the file (whole pages, only in checked blocks), so the mirror holds a window of
  the source, never all of it;
- before the engine commits (`Mirror.verified`, through the source's store) every block has arrived and matched (else a
  one-line FormatError, nothing written) and every predicted torch offset agreed with its local
  header (else `Unpredicted`: the operation reads the source again, fetched whole first).

A streamed file's bytes are read into memory, never copied file to file by the kernel: an output
hashed as written reads kernel-copied bytes back, and would find them dropped. Other sources
(Need.EVERYTHING elsewhere: reshard, which reads some pieces more than once and reads copies back
to hash them; verify, export, `ckpt reshard`) are fetched whole.

Here: giving a file's bytes back (punching holes) and where such a mirror can live.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

PAGE = 4096
"""Holes are punched in whole pages."""

_BUFFERS = threading.local()


def check_buffer() -> memoryview:
    """This thread's buffer for reading a block back to check it."""
    view = getattr(_BUFFERS, "view", None)
    if view is None:
        view = _BUFFERS.view = memoryview(bytearray(1 << 20))
    return view


_FALLOC_PUNCH = 0x03  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def punch(fd: int, offset: int, length: int) -> bool:
    """Give the file's bytes [offset, offset + length) back (they read as zeros); False where the
    file system cannot."""
    fallocate = libc_fallocate()
    return fallocate is not None and fallocate(fd, _FALLOC_PUNCH, offset, length) == 0


_FALLOCATE: list[Any] = []


def libc_fallocate() -> Any:
    if not _FALLOCATE:
        import ctypes

        try:
            function = ctypes.CDLL(None, use_errno=True).fallocate
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            function.restype = ctypes.c_int
        except (OSError, AttributeError):  # not Linux
            function = None
        _FALLOCATE.append(function)
    return _FALLOCATE[0]


def memory_dir(folder: str, room: int, source: int) -> str | None:
    """`folder` when a streamed source of `source` bytes may have its mirror there: writable, with
    `room` bytes free, able to punch holes, and the source at most a quarter of the memory
    available, so that even a read that gave nothing back could not exhaust it (else None: the
    system's temporary folder holds it)."""
    from ..data.direct import meminfo

    available = meminfo("MemAvailable")
    try:
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < max(room, source) or not os.access(folder, os.W_OK):
            return None
        if available is None or source > available // 4:
            return None
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(bytes(2 * PAGE))
            probe.flush()
            return folder if punch(probe.fileno(), 0, PAGE) else None
    except OSError:
        return None
