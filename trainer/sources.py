"""The data users have, read as documents for the tokenizer (trainer/tokenizing.py).

`--data` / `--eval-data` (and scripts/prepare_data.py) name a local path or an `s3://bucket/key`:

| kind | what it is | a document |
| --- | --- | --- |
| `.txt` | UTF-8 text | the whole file (tokenized in pieces of TXT_PIECE characters cut after a newline) |
| `.jsonl` | one JSON object per line | a row |
| `.csv` | a header, then rows (quoted values may span lines) | a row |
| `.parquet` | a Parquet file | a row |
| folder | a Hugging Face `datasets` `save_to_disk` folder (one split) | a row |
| anything else | a token file (`.bin`, `.npy`: trainer/data.py) | - |

A row's text is its `--text-column` (default `text`). A row without that column, but with `prompt`
and `completion` columns, or with a `messages` column (a list of {role, content}), is instruction
data: only the completion (the assistant's turns) is trained on. The columnar formats are read
by pyarrow (and `datasets` for its folders), imported here only when such data is given, in
record batches of about BATCH_ROWS rows, so a file of any size is read in bounded memory.

Bad data is one line (DataError, exit 2): an empty file, a missing column (the ones that exist
are named), a row that does not parse or holds no text (its line for .jsonl and .csv, found by
reading the file again with the standard library once pyarrow has refused it).

An object in S3 is read through shardkit's mirrors (io.objects.remote): its identity is its ETag and
size, so a cached tokenization is found without fetching the object; the bytes are fetched
only to tokenize it (or whole, for a token file).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.io.data.digest import file_digests
from shardkit.io.location import RemoteLocation, remote
from shardkit.io.store import ObjectInfo, Store, prefix
from shardkit.paths import regular_file

from .errors import DataError

log = logging.getLogger("trainer")

SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}
TEXT_KINDS = ("txt", "jsonl", "csv", "parquet", "datasets")
BATCH_ROWS = 1024
BLOCK_BYTES = 16 << 20  # pyarrow's read block for .jsonl and .csv (a row may not be larger)
TXT_PIECE = 8 << 20
INSTRUCTION = ("prompt", "completion")
MESSAGES = "messages"
EXTRA = "pip install 'shardkit[data]'"


@dataclass
class Source:
    """A data location resolved: `path` is local (a mirror file or folder for s3://)."""

    shown: str  # as the user gave it
    kind: str  # one of TEXT_KINDS, or "tokens"
    path: Path | None  # None: an S3 object not fetched yet (`fetch`)
    loc: RemoteLocation | None = None
    objects: tuple[ObjectInfo, ...] = ()
    store: Store | None = field(default=None, repr=False)  # an S3 source's, once fetched

    @property
    def is_text(self) -> bool:
        return self.kind in TEXT_KINDS

    def fetch(self) -> Path:
        """The local path, every byte fetched (an S3 object or folder: through a mirror)."""
        if self.path is None:
            assert self.loc is not None  # `locate` gives an S3 source its location
            base = self.loc if self.kind == "datasets" else self.loc.parent
            self.store = prefix(base).mirror(list(self.objects))
            self.path = self.store.root if self.kind == "datasets" else self.store.root / self.loc.name
            for name in (o.name for o in self.objects):
                self.store.ensure(self.store.root / name)
        return self.path

    def release(self) -> None:
        """Drop the local copy of an S3 text source once it is tokenized (its mirror closed)."""
        if self.store is not None and self.is_text:
            self.store.close()
            self.store = self.path = None

    def stamp(self) -> list[tuple[int, ...]]:
        """The stat identity of a local source's files (`Store.stamp`: device, inode, size and
        times); [] for S3 (its reads are pinned to the listed ETag)."""
        if self.loc is not None or self.path is None:
            return []
        files = sorted(p for p in self.path.iterdir() if p.is_file()) if self.path.is_dir() else [self.path]
        local = Store(self.path)
        return [local.stamp(os.stat(f)) for f in files]

    def check_unchanged(self, before: list[tuple[int, ...]]) -> None:
        """Refuse (one line) a source whose files changed since `before` (while it was read)."""
        if self.stamp() != before:
            raise DataError(f"{self.shown} changed while it was read: run again once it is complete (nothing was kept)")

    def identity(self) -> str:
        """What the data is: an S3 object's URL, size and ETag; a local file's or folder's contents
        (xxh3-128 of every byte: a cache hit must not depend on times a copy changes)."""
        if self.loc is not None:
            listed = [(o.name, o.size, o.etag) for o in self.objects]
            return _digest(json.dumps([str(self.loc), listed]))
        assert self.path is not None  # a local source has its path
        files = sorted(p for p in self.path.iterdir() if p.is_file()) if self.path.is_dir() else [self.path]
        parts = [(f.name if self.path.is_dir() else "", file_digests(f)[1]) for f in files]
        return _digest(json.dumps(parts))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def kind_of(path: str) -> str:
    """The kind a local file name says (a folder is `datasets`); anything else is a token file."""
    return SUFFIXES.get(os.path.splitext(path)[1].lower(), "tokens")


def locate(text: str, what: str) -> Source:
    """`text` (--data / --eval-data) resolved: a local path, or an S3 object or folder (listed,
    not fetched). A missing path is one line."""
    loc = remote(text, what)
    if loc is None:
        path = Path(text)
        if path.is_dir():
            return Source(text, "datasets", path)
        if path.exists():
            regular_file(path, f"{what}")  # a FIFO or device would hang or never end
        elif kind_of(text) in TEXT_KINDS:
            raise DataError(f"{what} {text} does not exist: give a .txt, .jsonl, .csv or .parquet file")
        return Source(text, kind_of(text), path)
    objects = prefix(loc)
    head = objects.head() if loc.prefix else None
    if head is not None:
        source = Source(text, kind_of(loc.name), None, loc, (head,))
        if source.kind == "tokens":  # read by mapping: fetched whole now
            source.fetch()
        return source
    inside = objects.listing()
    if inside:
        return Source(text, "datasets", None, loc, tuple(inside))
    objects.check_bucket()
    raise DataError(f"{what} {text}: no such object in S3 (nor a folder of objects under it): check the key")


# ---- columns ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Columns:
    """Which columns make a document: `text` alone, or instruction data (`prompt` and
    `completion`, or `messages`)."""

    mode: str  # "text", "prompt", "messages"
    names: tuple[str, ...]

    @property
    def masked(self) -> bool:
        return self.mode != "text"

    def describe(self) -> str:
        if self.mode == "text":
            return f"column {self.names[0]!r}"
        return "instruction columns " + " / ".join(repr(n) for n in self.names)


def choose_columns(names: list[str], text_column: str, shown: str) -> Columns:
    """The columns to read from a table with columns `names`."""
    if text_column in names:
        return Columns("text", (text_column,))
    if all(n in names for n in INSTRUCTION):
        return Columns("prompt", INSTRUCTION)
    if MESSAGES in names:
        return Columns("messages", (MESSAGES,))
    have = ", ".join(repr(n) for n in names) or "none"
    raise DataError(
        f"{shown} has no column {text_column!r} (its columns: {have}): pass --text-column NAME, or give "
        "instruction data as 'prompt' and 'completion' columns or a 'messages' column"
    )


# ---- reading documents --------------------------------------------------------------------------------


def _need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading this data needs {module.split('.')[0]}: {EXTRA}") from None


def open_rows(path: Path, kind: str, text_column: str, shown: str) -> tuple[Columns, Iterator[Any], int | None]:
    """(the columns chosen, an iterator of pyarrow tables or record batches holding them, the
    number of rows when known) of a columnar source."""
    if kind != "datasets" and path.stat().st_size == 0:
        raise DataError(f"{shown} is empty: it holds no documents")
    if kind == "jsonl":
        return _jsonl(path, text_column, shown)
    if kind == "csv":
        return _csv(path, text_column, shown)
    if kind == "parquet":
        pq = _need("pyarrow.parquet")
        try:
            file = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors: not a Parquet file, truncated
            raise DataError(f"{shown} is not a readable Parquet file ({first_line(e)})") from None
        columns = choose_columns(file.schema_arrow.names, text_column, shown)
        check_types(file.schema_arrow, columns, shown)
        batches = file.iter_batches(batch_size=BATCH_ROWS, columns=list(columns.names))
        return columns, batches, file.metadata.num_rows
    return _datasets_folder(path, text_column, shown)


def _jsonl(path: Path, text_column: str, shown: str) -> tuple[Columns, Iterator[Any], int | None]:
    pa, pj = _need("pyarrow"), _need("pyarrow.json")
    first = _first_json_row(path, shown)
    columns = choose_columns(list(first), text_column, shown)
    schema = pa.schema([(n, _arrow_type(pa, columns.mode)) for n in columns.names])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")

    def batches() -> Iterator[Any]:
        try:
            yield from pj.open_json(path, read_options=pj.ReadOptions(block_size=BLOCK_BYTES), parse_options=options)
        except ValueError as e:  # pyarrow.ArrowInvalid: find the line
            raise DataError(
                _jsonl_problem(path, columns, shown) or f"{shown} does not parse: {first_line(e)}"
            ) from None

    return columns, batches(), None


def json_objects(path: Path, shown: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a .jsonl file (a line that is not a JSON
    object: one DataError naming it)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{shown} line {number} is not JSON ({e}): one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{shown} line {number} is not a JSON object: one object per line")
            yield number, row


def _first_json_row(path: Path, shown: str) -> dict[str, Any]:
    for _, row in json_objects(path, shown):
        return row
    raise DataError(f"{shown} is empty: it holds no documents")


def _arrow_type(pa: Any, mode: str) -> Any:
    if mode == "messages":
        return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    return pa.string()


def _jsonl_problem(path: Path, columns: Columns, shown: str) -> str | None:
    """The first line of a .jsonl file that is not an object holding the columns (as text, or
    messages), said in one line; None when every line is."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                return f"{shown} line {number} is not UTF-8 text: convert the file to UTF-8"
            try:
                row = json.loads(text)
            except ValueError as e:
                return f"{shown} line {number} is not JSON ({e}): one JSON object per line"
            if not isinstance(row, dict):
                return f"{shown} line {number} is not a JSON object: one object per line"
            problem = row_problem(row, columns)
            if problem:
                return f"{shown} line {number}: {problem}"
    return None


def row_problem(row: dict[str, Any], columns: Columns) -> str | None:
    """What is wrong with one row's values for `columns` (None: nothing)."""
    for name in columns.names:
        value = row.get(name)
        if name not in row:
            have = ", ".join(repr(n) for n in row) or "none"
            return f"no column {name!r} (this row's columns: {have})"
        if columns.mode == "messages":
            if not isinstance(value, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value
            ):
                return f"{name!r} is not a list of {{'role': text, 'content': text}} messages"
        elif not isinstance(value, str):
            return f"{name!r} holds {type(value).__name__ if value is not None else 'null'}, not text"
    return None


def check_types(schema: Any, columns: Columns, shown: str) -> None:
    """Refuse columns of a typed table (Parquet, datasets) that cannot hold what they are read as."""
    pa = _need("pyarrow")

    def text(t: Any) -> bool:
        return bool(
            pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)
        )

    for name in columns.names:
        kind = schema.field(name).type
        if columns.mode == "messages":
            item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
            fields = (
                {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
                if item is not None and pa.types.is_struct(item)
                else {}
            )
            if not (text(fields.get("role", pa.null())) and text(fields.get("content", pa.null()))):
                raise DataError(f"{shown}: column {name!r} holds {kind}, not a list of {{role, content}} messages")
        elif not text(kind):
            raise DataError(f"{shown}: column {name!r} holds {kind} values, not text: give the column of the text")


def _csv(path: Path, text_column: str, shown: str) -> tuple[Columns, Iterator[Any], int | None]:
    pa, pc = _need("pyarrow"), _need("pyarrow.csv")
    parse = pc.ParseOptions(newlines_in_values=True)
    read = pc.ReadOptions(block_size=BLOCK_BYTES)
    try:
        names = pc.open_csv(path, read_options=read, parse_options=parse).schema.names
    except ValueError as e:
        raise DataError(_csv_problem(path, shown) or f"{shown} does not parse as CSV: {first_line(e)}") from None
    columns = choose_columns(names, text_column, shown)
    if columns.mode == "messages":
        raise DataError(f"{shown}: a 'messages' column cannot be read from CSV: give .jsonl or .parquet")
    convert = pc.ConvertOptions(
        include_columns=list(columns.names), column_types={n: pa.string() for n in columns.names}
    )

    def batches() -> Iterator[Any]:
        try:
            yield from pc.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
        except ValueError as e:
            raise DataError(_csv_problem(path, shown) or f"{shown} does not parse as CSV: {first_line(e)}") from None

    return columns, batches(), None


def _csv_problem(path: Path, shown: str) -> str | None:
    """The first record of a CSV file whose number of fields is not the header's, or the first
    line that is not UTF-8, with its line."""
    bad: list[int] = []

    def lines(f: Any) -> Iterator[str]:
        for number, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(number)
                return

    with open(path, "rb") as f:
        reader = csv.reader(lines(f))
        try:
            header = next(reader, None)
            for record in reader if header is not None else ():
                if header is not None and len(record) != len(header):
                    return (
                        f"{shown} line {reader.line_num} has {len(record)} fields, the header {len(header)}: "
                        "quote values that hold commas"
                    )
        except csv.Error as e:
            return f"{shown} line {reader.line_num} does not parse as CSV ({e})"
    if bad:
        return f"{shown} line {bad[0]} is not UTF-8 text: convert the file to UTF-8"
    return None if header is not None else f"{shown} is empty: it holds no documents"


def _datasets_folder(path: Path, text_column: str, shown: str) -> tuple[Columns, Iterator[Any], int | None]:
    datasets = _need("datasets")
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataError(
            f"{shown} holds several splits ({', '.join(splits)}): give one split's folder, e.g. {shown}/{splits[0]}"
            if splits
            else f"{shown} is a DatasetDict without splits"
        )
    if not (path / "state.json").is_file():
        raise DataError(
            f"{shown} is a folder but not a datasets save_to_disk folder (no state.json): give a file "
            "(.txt, .jsonl, .csv, .parquet, a token file) or the folder Dataset.save_to_disk wrote"
        )
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets' and pyarrow's errors for a damaged folder
        raise DataError(f"{shown} is not a readable datasets folder ({first_line(e)})") from None
    columns = choose_columns(list(data.column_names), text_column, shown)
    check_types(data.data.schema, columns, shown)
    table = data.select_columns(list(columns.names)).with_format("arrow")
    return columns, table.iter(batch_size=BATCH_ROWS), len(data)


def first_line(error: BaseException) -> str:
    """`error`'s first line (for a message of ours that quotes it)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def rows_of(batch: Any, columns: Columns, source: Source, first: int) -> list[Any]:
    """A table / record batch's values of `columns` (its first row is row `first` of `source`):
    per row, the text, (prompt, completion) or messages."""
    try:
        values = [batch.column(n).to_pylist() for n in columns.names]
    except UnicodeDecodeError:
        raise row_error(source, columns, first, "not UTF-8 text") from None
    return list(zip(*values)) if columns.mode == "prompt" else values[0]


def text_pieces(path: Path, shown: str) -> Iterator[str]:
    """A .txt file's text: whole when it is at most TXT_PIECE characters, else in pieces of about
    that many, each cut after a newline (bounded memory; a text without newlines in pieces of at
    most 4 x TXT_PIECE)."""
    try:
        with open(path, encoding="utf-8") as f:
            pending = f.read(TXT_PIECE)
            while pending:
                more = f.read(TXT_PIECE)
                if not more:
                    yield pending
                    return
                cut = pending.rfind("\n") + 1
                if cut == 0 and len(pending) < 4 * TXT_PIECE:
                    pending += more  # no newline yet: read on
                    continue
                cut = cut or len(pending)
                yield pending[:cut]
                pending = pending[cut:] + more
    except UnicodeDecodeError as e:
        raise DataError(
            f"{shown} is not UTF-8 text ({e.reason} near byte {e.start} of a piece): convert it to UTF-8"
        ) from None


def row_error(source: Source, columns: Columns, index: int, problem: str) -> DataError:
    """The one-line error for row `index` (0-based) of `source`: for .jsonl the file is read again
    to name the first line that is wrong; for the other kinds the row is named."""
    assert source.path is not None  # rows are read from a fetched source
    if source.kind == "jsonl":
        found = _jsonl_problem(source.path, columns, source.shown)
        if found:
            return DataError(found)
    return DataError(f"{source.shown} row {index + 1}: {problem}")
