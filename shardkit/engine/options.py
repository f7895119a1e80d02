"""How an operation writes its output: one typed record (`WriteOptions`) that travels from the
operation (`operations.reshard_checkpoint`, `merge_checkpoint`) through staging to the executor.

The public operations take keyword arguments in their documented spellings (`WriteArgs`:
`verify_hashes=True`, `direct_io="auto"`, `workers="auto"`, `dtype="bf16"`, ...); they are
converted once, into enums and a torch dtype, where the record is made (`WriteOptions.from_args`),
and nothing below sees the old spellings.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from typing_extensions import TypedDict

from ..formats.base import parse_dtype
from ..formats.torch_zip import ARCHIVE
from ..io.data.digest import FAST, CheckMode, Recording, check_mode
from ..io.safety.sinks import NO_SINK, Sink

ProgressCallback = Callable[[int, int], None]
"""Called as progress(bytes_done_now, bytes_total) while output is written."""


class Auto(enum.Enum):
    """The choice left to shardkit (`workers`)."""

    AUTO = "auto"


AUTO = Auto.AUTO


class DirectIO(enum.Enum):
    """Whether output files are written around the page cache (O_DIRECT)."""

    OFF = "off"
    ON = "on"
    AUTO = "auto"
    """On when this host's processes write more than the kernel's dirty limit
    (`io.data.direct.direct_io_pays`)."""


def parse_direct_io(value: bool | str | DirectIO) -> DirectIO:
    """A `direct_io` argument: True/"on", False/"off", or "auto"."""
    if isinstance(value, DirectIO):
        return value
    if value is True or value is False:
        return DirectIO.ON if value else DirectIO.OFF
    if isinstance(value, str) and value in {d.value for d in DirectIO}:
        return DirectIO(value)
    raise ValueError(f"direct_io must be True, False or 'auto', not {value!r}")


def parse_workers(value: int | str | Auto | None) -> int | Auto:
    """A `workers` argument: a positive integer, or "auto" (None means auto)."""
    if value is None or value is AUTO or value == "auto":
        return AUTO
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"workers must be a positive integer or 'auto', not {value!r}") from None
    if count < 1 or isinstance(value, bool) or (isinstance(value, float) and value != count):
        raise ValueError(f"workers must be a positive integer or 'auto', not {value!r}")
    return count


class WriteArgs(TypedDict, total=False):
    """The keyword arguments of every writing operation (reshard, convert, merge, export), in the
    spellings users pass (converted once, by `WriteOptions.from_args`)."""

    dtype: str | torch.dtype | None
    """Cast weights to this dtype (bf16, fp16, fp32; default: keep the source's)."""
    workers: int | str
    """Output files built in parallel (threads); "auto" (the default): one per two CPU cores, at
    least 1 and at most 4, and fewer when the largest tensors of that many workers would not fit in
    256 MiB together."""
    overwrite: bool
    """Replace a destination that exists and is not empty (default False)."""
    replace_objects: Sequence[str]
    """With `overwrite` of an s3:// destination: globs (names relative to its prefix) of objects
    shardkit did not write that may be replaced too (`io.objects.upload.replaceable`); without them such
    objects, and any object at a bucket's root, are refused. Local destinations ignore it."""
    progress: ProgressCallback | None
    """Called as progress(bytes_done, bytes_total) while output is written."""
    direct_io: bool | str
    """Write the output around the page cache (O_DIRECT): True, False (the default), or "auto":
    when the output is larger than the kernel's dirty limit (see `io.data.direct.direct_io_pays`). It saves
    the kernel's copy into the page cache (dear on a VM) and leaves the output on the device when
    the call returns; whether it is faster depends on the storage, so it is off by default."""
    sha256: bool
    """Also record each output file's sha256 in the manifest (default False: xxh3-128 only, which
    catches any accidental change; sha256 is many times slower and is for manifests whose own hash
    is pinned elsewhere, see `io.data.digest`). Outputs without a manifest ignore it."""
    verify_hashes: bool | str | CheckMode
    """Check each source file against the digest its manifest lists before the output is
    committed: True or "fast" (the default) checks the fast xxh3-128 where the manifest has it and
    sha256 otherwise, "sha256" checks sha256 only, False or "none" skips the check."""
    extra_files: Mapping[str, str]
    """Small text files (name -> content) added to a merged output before it is committed (a
    marker saying which run wrote it, say); names are plain file names inside the output."""


@dataclass(frozen=True)
class WriteOptions:
    """How an operation writes its output files (see the module's docstring)."""

    fmt: str = "torch"
    """The output files' format (a name of `formats.registry.FORMATS`)."""
    dtype: torch.dtype | None = None
    """Cast weights to this dtype; None keeps the source's."""
    workers: int | Auto = AUTO
    """Output files built in parallel (threads); AUTO: see `planning.auto_workers`."""
    overwrite: bool = False
    """Replace a destination that exists and is not empty."""
    progress: ProgressCallback | None = None
    """Called as progress(bytes_done, bytes_total) in the calling thread while output is written."""
    verify_hashes: CheckMode = FAST
    """How the sources are checked against their manifest before the output is committed."""
    digests: Recording = Recording.FAST
    """What the output files' records carry: NONE for outputs no manifest lists."""
    direct_io: DirectIO = DirectIO.OFF
    """Whether the output files are written around the page cache."""
    archive: str | None = ARCHIVE
    """The folder torch.save files name their zip records' under: "archive/" (torch.save into a
    stream, shardkit's own files) or None: after each file (torch.save of a path, NxD's training
    checkpoints; kept by `ckpt reshard`). Other formats ignore it."""
    sink: Sink = NO_SINK
    """Where each output file goes once written (`io.safety.sinks`): the output's, handed down by
    the caller that opened it (an output bound for object storage uploads it; a local one: nothing)."""

    @classmethod
    def from_args(cls, args: WriteArgs, fmt: str, manifest: bool = True, sink: Sink = NO_SINK) -> WriteOptions:
        """The record of an operation's keyword arguments, for output files in `fmt`; `manifest`:
        whether a manifest lists them (else they are not hashed, and `sha256` is ignored); `sink`:
        the output's (not a user's argument: the caller that opened the output passes it)."""
        if not manifest:
            digests = Recording.NONE
        else:
            digests = Recording.SHA256 if args.get("sha256") else Recording.FAST
        return cls(
            fmt=fmt,
            dtype=parse_dtype(args.get("dtype")),
            workers=parse_workers(args.get("workers", AUTO)),
            overwrite=bool(args.get("overwrite", False)),
            progress=args.get("progress"),
            verify_hashes=check_mode(args.get("verify_hashes", True)),
            digests=digests,
            direct_io=parse_direct_io(args.get("direct_io", False)),
            sink=sink,
        )
