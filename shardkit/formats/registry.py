"""The one table of tensor-file formats: every caller (engine, training checkpoints, NxD file
naming and detection, the CLI's choices, the trainer's config, the model card) reads it.

A format is a name, the suffix of its rank files, how to recognise one of its files, its reader
and writer, and what its writer can do (`Abilities`, declared here, never probed). Adding a
format is one module with a reader and a writer that follow `base.TensorFile` /
`base.TensorFileWriter` (and the protocols of the abilities it declares), plus one entry in
`FORMATS`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ..errors import ShardkitError
from ..io.data.digest import Recording
from ..io.safety.sinks import Sink
from ..placements import Piece
from . import dcp, dcp_files, optimum_neuron
from .base import ChunkedWriter, CopyingWriter, RowStreamingWriter, TensorFile, TensorFileWriter, TensorSpec
from .safetensors_io import SafetensorsFile, SafetensorsWriter
from .torch_io import TorchFile, TorchWriter
from .xser import XserFile, XserWriter, info_path, tensors_dir

WriterFactory = Callable[
    [Path, Path, Sequence[TensorSpec], Collection[str], Recording, bool, Sink, "str | None"], TensorFileWriter
]
"""writer(path, root, specs, expert_names, digests, direct, sink, archive): a writer of one rank
file under `root` (`digests`: what its records carry, see `io.data.digest.Recording`; `direct`:
written around the page cache, see `io.data.direct.DirectFile`; `sink`: where each file it closes
goes, the output's, see `io.safety.sinks`; `archive`: for torch.save files, the folder their zip
records are under, see `torch_io.archive_folder`; other formats ignore it)."""


ObjectWriterFactory = Callable[..., TensorFileWriter]
"""objects(path, root, specs, data_pkl, refs, info, digests, direct, sink, archive): a writer of
one object file, its tensors named by `specs` in the order they are written; torch.save's data.pkl
of the object with its tensors stubbed (torch files), or its reference object and `.info.pt`
(xser). The other arguments are `WriterFactory`'s."""


@dataclass(frozen=True)
class Abilities:
    """What a format's writer takes besides whole tensors (`write`). A writer whose format
    declares an ability follows its protocol; where the ability also depends on the file (torch's
    own zip writer, used for archives of 4 GiB or more, can neither copy nor stream rows), the
    writer answers per file (`can_copy`, `can_stream_rows`)."""

    kernel_copies: bool = False
    """Takes a tensor as source byte ranges the kernel copies (`base.CopyingWriter`): formats that
    store a tensor's bytes as they are, in one run."""
    row_streaming: bool = False
    """Takes a matrix as blocks of rows handed over one at a time, with other files written in
    between (`base.RowStreamingWriter`): the files of a group built together."""
    chunked_writes: bool = False
    """Takes a tensor as consecutive blocks of rows from one iterable (`base.ChunkedWriter`),
    never assembled whole."""


@dataclass(frozen=True)
class Format:
    """One tensor-file format and what it can do."""

    name: str
    suffix: str
    label: str
    """How people call it (model cards, reports)."""
    summary: str
    reader: Callable[..., TensorFile]
    """reader(path, store=None): a reader of one file, read through `store` (`io.store.Store`;
    default: a local folder)."""
    writer: WriterFactory
    detect: Callable[[Path], bool] = lambda path: True
    """True when the rank file at this path (with this format's suffix) is of this format
    (default: every file with the suffix)."""
    abilities: Abilities = Abilities()
    """What its writer takes besides whole tensors."""
    companions: Callable[[Path], list[Path]] = lambda path: []
    """Other files and folders that belong to a rank file (xser's tensor files)."""
    plan: Callable[..., list[tuple[str, list[Piece], tuple[int, int, int]]]] | None = None
    """For a format that lays out its own files instead of NxD's rank files:
    plan(family, dims, layout, convention) -> (file, pieces, rank) per data file (DCP: a file per
    rank, each holding chunks of full tensors under a naming convention's names)."""
    finish: Callable[..., list[Path]] | None = None
    """Files such a format adds once every data file is written: finish(folder, records, family,
    dims, layout) (DCP's `.metadata`; optimum-neuron's metadata and markers)."""
    objects: ObjectWriterFactory | None = None
    """A writer of a file holding any object of tensors (a ZeRO-1 optimizer shard), not a state
    dict; None when the format holds state dicts only."""

    def files_of(self, path: Path) -> list[Path]:
        """The rank file and every file that belongs to it."""
        return [path, *self.companions(path)]

    def copying(self, writer: TensorFileWriter) -> CopyingWriter | None:
        """`writer` (of this format) as a writer of kernel copies, when the format declares them and
        its file takes them; else None."""
        if not self.abilities.kernel_copies:
            return None
        copying = cast(CopyingWriter, writer)
        return copying if copying.can_copy() else None

    def streaming(self, writer: TensorFileWriter) -> RowStreamingWriter | None:
        """`writer` (of this format) as a writer of rows handed over one block at a time, when the
        format declares it and its file allows it; else None."""
        if not self.abilities.row_streaming:
            return None
        streaming = cast(RowStreamingWriter, writer)
        return streaming if streaming.can_stream_rows() else None

    def chunked(self, writer: TensorFileWriter) -> ChunkedWriter | None:
        """`writer` (of this format) as a writer of chunked tensors, when the format declares it."""
        return cast(ChunkedWriter, writer) if self.abilities.chunked_writes else None


def _xser_companions(path: Path) -> list[Path]:
    folder = tensors_dir(path)
    tensors = sorted(folder.iterdir()) if folder.is_dir() else []
    return [p for p in (info_path(path),) if p.is_file()] + tensors


def _plain(writer: Callable[..., TensorFileWriter], zip_archive: bool = False) -> WriterFactory:
    """The factory of a writer that keeps no list of expert tensors (`zip_archive`: it takes the
    folder of a torch.save file's records)."""
    return lambda path, root, specs, expert, digests, direct, sink, archive: writer(
        path, root, specs, digests=digests, direct=direct, sink=sink, **({"archive": archive} if zip_archive else {})
    )


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        # Order matters for detection: the most specific first (xser files are also .pt files).
        Format(
            "xser",
            ".pt",
            "NxD xser",
            "torch-xla's xser: each tensor in its own file under <file>.tensors/",
            reader=XserFile,
            writer=lambda path, root, specs, expert, digests, direct, sink, archive: XserWriter(
                path, root, specs, list(expert), digests, direct, sink, archive
            ),
            # a model file NxD saved without tensor data has its .info.pt but no tensor folder
            detect=lambda path: tensors_dir(path).is_dir() or info_path(path).is_file(),
            abilities=Abilities(kernel_copies=True, row_streaming=True),
            companions=_xser_companions,
            objects=lambda path, root, specs, data_pkl, refs, info, digests, direct, sink, archive: XserWriter(
                path, root, specs, (), digests, direct, sink, archive, refs=refs, info=info
            ),
        ),
        Format(
            "torch",
            ".pt",
            "NxD torch",
            "torch.save state dicts, NxD's own rank files",
            TorchFile,
            _plain(TorchWriter, zip_archive=True),
            abilities=Abilities(kernel_copies=True, row_streaming=True),
            objects=lambda path, root, specs, data_pkl, refs, info, digests, direct, sink, archive: TorchWriter(
                path, root, specs, digests, direct, data_pkl, archive, sink
            ),
        ),
        Format(
            "safetensors",
            ".safetensors",
            "safetensors",
            "safetensors files: no pickle, fast to read",
            SafetensorsFile,
            _plain(SafetensorsWriter),
            abilities=Abilities(kernel_copies=True, row_streaming=True, chunked_writes=True),
        ),
        Format(
            "dcp",
            dcp_files.SUFFIX,
            "PyTorch DCP",
            "torch.distributed.checkpoint folders: .metadata and a data file per rank, tensors in chunks",
            dcp.DcpFile,
            lambda path, root, specs, expert, digests, direct, sink, archive: dcp.DcpWriter(
                path, root, specs, digests, direct, sink
            ),
            detect=lambda path: (path.parent / dcp_files.METADATA).is_file(),
            abilities=Abilities(kernel_copies=True, chunked_writes=True),
            plan=dcp.plan_outputs,
            finish=lambda folder, records, *model: dcp_files.finish_folder(folder, records),
        ),
        Format(
            "optimum-neuron",
            ".pt",
            "optimum-neuron",
            "optimum-neuron's training checkpoints: NxD rank files under shards/, mp_metadata_pp_rank_<P>.json beside",
            TorchFile,
            _plain(TorchWriter),
            detect=optimum_neuron.is_rank_file,
            abilities=Abilities(kernel_copies=True, row_streaming=True),
            plan=optimum_neuron.plan_outputs,
            finish=optimum_neuron.finish_folder,
        ),
    )
}

DEFAULT_FORMAT = "torch"
SUFFIXES = tuple(sorted({f.suffix for f in FORMATS.values() if f.plan is None}))


def format_names() -> list[str]:
    """The formats of NxD rank files (training checkpoints, the trainer's shards), the default first."""
    return [DEFAULT_FORMAT, *(n for n, f in FORMATS.items() if n != DEFAULT_FORMAT and f.plan is None)]


def output_format_names() -> list[str]:
    """Every format convert and reshard write (rank files, and formats with their own layout: DCP)."""
    return [*format_names(), *(n for n, f in FORMATS.items() if f.plan is not None)]


def get_format(name: str) -> Format:
    """The format called `name`, or a one-line error listing the known ones."""
    if name not in FORMATS:
        raise ShardkitError(f"format {name!r} is unknown: use one of {', '.join(format_names())}")
    return FORMATS[name]


def detect_format(path: Path) -> Format:
    """The format of one rank file, from its suffix and what lies beside it."""
    for fmt in FORMATS.values():
        if path.suffix == fmt.suffix and fmt.detect(path):
            return fmt
    raise ShardkitError(f"{path} is not a rank file of a known format ({', '.join(SUFFIXES)})")


def format_of_file(path: Path, default: str) -> Format:
    """The format a checkpoint file is read with: the first whose suffix and detection match
    (a .safetensors file among .bin files, an xser file), else the checkpoint's `default`
    (Hugging Face `pytorch_model.bin` files are torch files)."""
    for fmt in FORMATS.values():
        if path.suffix == fmt.suffix and fmt.detect(path):
            return fmt
    return get_format(default)
