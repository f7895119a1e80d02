"""Labelled rows for the encoder tasks (trainer/tasks.py): named columns of a table, read in batches.

The data is what `--data` / `--eval-data` name for text (trainer/sources.py locates it, local or
s3://, and fetches it): a `.csv` file (a header, then rows; values are text, quoted values may
span lines), a `.jsonl` file (one JSON object per line), a `.parquet` file or a `datasets`
save_to_disk folder. CSV (UTF-8, a byte-order mark
skipped, as spreadsheets write it) and Parquet are read by pyarrow, a datasets folder by `datasets`, JSON
lines by the standard library (each line one object: its line number comes for free), all in
batches of `sources.BATCH_ROWS` rows, so the reading itself holds one batch at a time.

Bad data is one line (DataError, exit 2): an empty file, a column that is not there (the ones that
are, named), a row that does not parse (its line), a value that is missing (its line for .csv and
.jsonl, found by reading the file again with the standard library; its row otherwise).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import sources
from .errors import DataError

KINDS = ("csv", "jsonl", "parquet", "datasets")


@dataclass
class Table:
    """A located table: its columns, and where its rows are."""

    source: sources.Source
    path: Path
    columns: list[str]

    @property
    def shown(self) -> str:
        return self.source.shown

    def where(self, index: int) -> str:
        """Row `index` (0-based, in file order) as a user finds it: `line N` of a .csv or .jsonl
        file, else `row N`."""
        line = _line_of(self.path, self.source.kind, index)
        return f"line {line}" if line is not None else f"row {index + 1}"

    def error(self, index: int, problem: str) -> DataError:
        return DataError(f"{self.shown} {self.where(index)}: {problem}")


def open_table(text: str, what: str) -> Table:
    """The table `text` names (`what`: the option, for messages), fetched when in S3, with its columns."""
    source = sources.locate(text, what)
    if source.kind not in KINDS:
        raise DataError(
            f"{what} {text}: labelled rows are read from .csv, .jsonl, .parquet or a datasets folder, not "
            f"{'a token file' if source.kind == 'tokens' else source.kind}: give the rows as one of those"
        )
    path = source.fetch()
    if source.kind != "datasets" and path.stat().st_size == 0:
        raise DataError(f"{text} is empty: it holds no rows")
    return Table(source, path, _column_names(path, source.kind, text))


def require(table: Table, name: str, hint: str) -> None:
    """Refuse a table without column `name`, naming the columns it has; `hint`: what to do."""
    if name not in table.columns:
        have = ", ".join(repr(c) for c in table.columns) or "none"
        raise DataError(f"{table.shown} has no column {name!r} (its columns: {have}): {hint}")


def batches(table: Table, names: Sequence[str]) -> Iterator[dict[str, list[Any]]]:
    """The values of columns `names` (all present), a batch of rows at a time, in file order."""
    kind, path = table.source.kind, table.path
    if kind == "jsonl":
        yield from _jsonl_batches(path, names, table.shown)
    elif kind == "csv":
        yield from _csv_batches(path, names, table.shown)
    elif kind == "parquet":
        pq = _need("pyarrow.parquet")
        for batch in pq.ParquetFile(path).iter_batches(batch_size=sources.BATCH_ROWS, columns=list(names)):
            yield {n: batch.column(n).to_pylist() for n in names}
    else:
        data = _datasets(path, table.shown).select_columns(list(names)).with_format("arrow")
        for batch in data.iter(batch_size=sources.BATCH_ROWS):
            yield {n: batch.column(n).to_pylist() for n in names}


# ---- the kinds ------------------------------------------------------------------------------------------


def _need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading this data needs {module.split('.')[0]}: {sources.EXTRA}") from None


def _column_names(path: Path, kind: str, shown: str) -> list[str]:
    if kind == "jsonl":
        return list(_first_object(path, shown))
    if kind == "csv":
        with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
            try:
                header = next(csv.reader(f), None)
            except csv.Error as e:
                raise DataError(f"{shown} line 1 does not parse as CSV ({e})") from None
        if not header:
            raise DataError(f"{shown} is empty: it holds no rows")
        return header
    if kind == "parquet":
        pq = _need("pyarrow.parquet")
        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors: not a Parquet file, truncated
            raise DataError(f"{shown} is not a readable Parquet file ({sources.first_line(e)})") from None
    return list(_datasets(path, shown).column_names)


def _datasets(path: Path, shown: str) -> Any:
    datasets = _need("datasets")
    if not (path / "state.json").is_file():
        raise DataError(
            f"{shown} is a folder but not one split of a datasets save_to_disk folder (no state.json): give "
            "a .csv, .jsonl or .parquet file, or the folder of one split"
        )
    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets' and pyarrow's errors for a damaged folder
        raise DataError(f"{shown} is not a readable datasets folder ({sources.first_line(e)})") from None


def _first_object(path: Path, shown: str) -> dict[str, Any]:
    for _, row in sources.json_objects(path, shown):
        return row
    raise DataError(f"{shown} is empty: it holds no rows")


def _jsonl_batches(path: Path, names: Sequence[str], shown: str) -> Iterator[dict[str, list[Any]]]:
    batch: dict[str, list[Any]] = {n: [] for n in names}
    for number, row in sources.json_objects(path, shown):
        for n in names:
            if n not in row:
                have = ", ".join(repr(k) for k in row) or "none"
                raise DataError(f"{shown} line {number} has no column {n!r} (its columns: {have})")
            batch[n].append(row[n])
        if len(batch[names[0]]) >= sources.BATCH_ROWS:
            yield batch
            batch = {n: [] for n in names}
    if batch[names[0]]:
        yield batch


def _csv_batches(path: Path, names: Sequence[str], shown: str) -> Iterator[dict[str, list[Any]]]:
    pa, pc = _need("pyarrow"), _need("pyarrow.csv")
    options = {
        "read_options": pc.ReadOptions(block_size=sources.BLOCK_BYTES),
        "parse_options": pc.ParseOptions(newlines_in_values=True),
        "convert_options": pc.ConvertOptions(
            include_columns=list(names), column_types={n: pa.string() for n in names}, strings_can_be_null=False
        ),
    }
    try:
        for batch in pc.open_csv(path, **options):
            yield {n: batch.column(n).to_pylist() for n in names}
    except ValueError as e:  # pyarrow.ArrowInvalid: find the record with the standard library
        raise DataError(
            _csv_problem(path, shown) or f"{shown} does not parse as CSV: {sources.first_line(e)}"
        ) from None


def _csv_problem(path: Path, shown: str) -> str | None:
    """The first record of a CSV file that does not parse or whose number of fields is not the
    header's, with its line."""
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, [])
            for record in reader:
                if len(record) != len(header):
                    return (
                        f"{shown} line {reader.line_num} has {len(record)} fields, the header {len(header)}: "
                        "quote values that hold commas"
                    )
        except csv.Error as e:
            return f"{shown} line {reader.line_num} does not parse as CSV ({e})"
    return None


def _line_of(path: Path, kind: str, index: int) -> int | None:
    """The line where row `index` of a .csv (its record's last line) or .jsonl file is; None for
    the other kinds."""
    if kind == "jsonl":
        for i, (number, _) in enumerate(sources.json_objects(path, str(path))):
            if i == index:
                return number
    elif kind == "csv":
        with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
            reader = csv.reader(f)
            next(reader, None)
            for i, _ in enumerate(reader):
                if i == index:
                    return reader.line_num
    return None
