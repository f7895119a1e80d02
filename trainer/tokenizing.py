"""Text data (trainer/sources.py) tokenized into the trainer's token file, once, in a cache.

Each document is encoded with the tokenizer (the model folder's, or `--tokenizer DIR`) and
followed by its end-of-sequence id (unless it already ends with it); the documents are packed one
after the other into one token file (trainer/data.py's format), which is read in windows of
`--seq-len` + 1 tokens like any token file: a .jsonl file and the token file of its documents
train identically. Instruction data keeps a loss mask beside the ids (format version 2): 0 on a
prompt's tokens, 1 on a completion's and its end-of-sequence id. Which tokens are the completion's
follows TRL's SFT: the tokens of the whole text that the prompt alone already gives (their common
prefix) are the prompt's, the rest the completion's; a `messages` row is rendered with the
tokenizer's chat template, and each assistant turn (from the end of the prompt that
`add_generation_prompt` renders before it to the end of the rendered turn) is trained on.

The cache (`--data-cache DIR`, default `$SHARDKIT_CACHE/tokens`, else `~/.cache/shardkit/tokens`)
holds one folder per (source contents, tokenizer files, columns): `<key>/tokens.bin`. It is
produced as a staged output of shardkit's I/O core (the folder's lock, written in a staging folder
beside it, renamed into place when complete; a killed run's staging folder is removed by the next
run), so two runs tokenizing the same data at once never mix: the second waits for the first's
lock, then reads its result. Every rank of a job does the same (the first one tokenizes, the
others wait). scripts/prepare_data.py writes the same bytes to a file the user names.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from shardkit.distributed import Job
from shardkit.formats.hf import SIDE_FILES
from shardkit.io.location import as_local
from shardkit.io.safety.lock import FolderInUseError
from shardkit.io.safety.overlap import overlaps
from shardkit.io.safety.small import COPY_LIMIT, read_json, read_small
from shardkit.io.safety.transaction import commit_all, scratch_folder, staged_output, write_file

from . import sources
from .data import HEADER, TokenFile, header, token_dtype
from .errors import DataError
from .sources import Columns, Source

log = logging.getLogger("trainer")

TOKENS = "tokens.bin"
ABOUT = "about.json"  # what a cache folder holds, for people
FORMAT = 1  # of the cache's key: a change in how documents become tokens makes new keys
TOKENIZER_FILES = tuple(n for n in SIDE_FILES if n != "generation_config.json")
WAIT_S = 0.5
COPY_BLOCK = 16 << 20
_BUILDING = threading.Lock()  # ranks that are threads of one process tokenize one at a time
LOADING = threading.Lock()  # ... and load tokenizers one at a time: transformers' lazy imports are not thread-safe


@dataclass
class Tokenizer:
    """A loaded tokenizer, the folder it came from and the digest of its files."""

    tok: Any
    directory: Path
    identity: str

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def eos(self) -> int | None:
        return self.tok.eos_token_id


def default_cache() -> Path:
    """`$SHARDKIT_CACHE/tokens`, else `~/.cache/shardkit/tokens`."""
    base = os.environ.get("SHARDKIT_CACHE")
    return Path(base) / "tokens" if base else Path.home() / ".cache" / "shardkit" / "tokens"


def has_tokenizer(directory: Path) -> bool:
    return any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_tokenizer(directory: str | Path, what: str = "--tokenizer") -> Tokenizer:
    """The tokenizer of a local folder (transformers' AutoTokenizer, nothing downloaded, no code
    run from the folder); a missing folder or one without a tokenizer is one line."""
    folder = as_local(str(directory), what)
    if not folder.is_dir():
        raise DataError(f"{what} {folder} does not exist or is not a folder: give the folder holding tokenizer.json")
    if not has_tokenizer(folder):
        raise DataError(
            f"{what} {folder} holds no tokenizer (no tokenizer.json, tokenizer_config.json or tokenizer.model): "
            "give the model's folder or its tokenizer's"
        )
    with LOADING:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers' many errors for a broken tokenizer folder
            raise DataError(f"{what} {folder}: its tokenizer does not load ({sources.first_line(e)})") from None
    digest = xxhash.xxh3_128(type(tok).__name__.encode())
    for name in TOKENIZER_FILES:
        if os.path.lexists(folder / name):
            digest.update(f"\0{name}\0".encode())
            digest.update(read_small(folder / name, "tokenizer file", COPY_LIMIT, within=folder))
    return Tokenizer(tok, folder, digest.hexdigest())


# ---- documents to ids and mask -------------------------------------------------------------------------

Segments = list[tuple[str, bool]]  # a document's text in pieces, each trained on or not


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def with_eos(ids: list[int], mask: list[int] | None, eos: int | None, trained: bool) -> None:
    """Append the end-of-sequence id (trained on as the last segment is) unless it ends `ids`."""
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
        if mask is not None:
            mask.append(int(trained))


def segments_ids(tok: Tokenizer, segments: Segments, special: bool) -> tuple[list[int], list[int]]:
    """The ids of the segments' text and their mask: the tokens of the whole text that the text up
    to a segment's end already gives belong to that segment and those before it."""
    full = "".join(text for text, _ in segments)
    ids = tok.tok(full, add_special_tokens=special)["input_ids"]
    mask, end, done = [0] * len(ids), 0, 0
    for i, (text, trained) in enumerate(segments):
        end += len(text)
        upto = (
            len(ids)
            if i == len(segments) - 1
            else _common_prefix(ids, tok.tok(full[:end], add_special_tokens=special)["input_ids"])
        )
        upto = max(upto, done)
        mask[done:upto] = [int(trained)] * (upto - done)
        done = upto
    with_eos(ids, mask, tok.eos, segments[-1][1])
    return ids, mask


def chat_segments(tok: Tokenizer, messages: list[dict[str, str]]) -> Segments:
    """A conversation rendered with the chat template, cut into segments: each assistant turn
    trained, the rest not."""
    if not getattr(tok.tok, "chat_template", None):
        raise DataError(
            f"a 'messages' column is rendered with the tokenizer's chat template, but {tok.directory} has none: "
            "give prompt/completion columns, or a tokenizer with a chat template"
        )

    def render(items: list[dict[str, str]], prompt: bool = False) -> str:
        if not items:
            return ""
        return str(tok.tok.apply_chat_template(items, tokenize=False, add_generation_prompt=prompt))

    full, segments, at = render(messages), [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1])
        if not (full.startswith(start) and full.startswith(end) and at <= len(start) <= len(end)):
            raise DataError(
                f"the chat template of {tok.directory} does not render a conversation's first messages as the "
                "start of the whole: its assistant turns cannot be told apart; give prompt/completion columns"
            )
        segments += [(full[at : len(start)], False), (full[len(start) : len(end)], True)]
        at = len(end)
    segments.append((full[at:], False))
    return [s for s in segments if s[0]] or [("", False)]


def text_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Plain documents: encoded (with the tokenizer's special tokens) and each followed by EOS."""
    encoded = tok.tok(texts, add_special_tokens=True)["input_ids"] if texts else []
    for ids in encoded:
        with_eos(ids, None, tok.eos, False)
    return encoded


# ---- writing the token file ---------------------------------------------------------------------------


class TokenWriter:
    """A token file written in a folder that the I/O core made for this run (a staging or scratch
    folder, nobody else's): the ids streamed after a placeholder header, the mask into a second
    file appended at the end, then the header."""

    def __init__(self, folder: Path, vocab_size: int, masked: bool):
        self.path, self.vocab_size, self.masked = folder / TOKENS, vocab_size, masked
        self.dtype = token_dtype(vocab_size)
        self.count = self.documents = self.trained = 0
        new = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a new file, never through a link
        self._ids = os.fdopen(os.open(self.path, new | os.O_WRONLY, 0o644), "wb")
        self._ids.write(bytes(HEADER.size))
        self._mask = None
        if masked:  # a file without a name once opened: nothing of it outlives the writer
            part = folder / "mask.part"
            self._mask = os.fdopen(os.open(part, new | os.O_RDWR, 0o600), "w+b")
            part.unlink()

    def add(self, ids: list[int], mask: list[int] | None = None) -> None:
        self._ids.write(np.asarray(ids, dtype=self.dtype).tobytes())
        if self._mask is not None:
            assert mask is not None and len(mask) == len(ids)
            self._mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
            self.trained += int(np.count_nonzero(mask))
        self.count += len(ids)
        self.documents += 1

    def finish(self) -> Path:
        if self._mask is not None:
            self._mask.seek(0)
            while block := self._mask.read(COPY_BLOCK):
                self._ids.write(block)
            self._mask.close()
        self._ids.seek(0)
        self._ids.write(header(self.count, self.vocab_size, self.masked))
        self._ids.close()
        return self.path

    def close(self) -> None:
        for f in (self._ids, self._mask):
            if f is not None and not f.closed:
                f.close()


def _progress(enabled: bool, total: int | None, what: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, unit=" docs", desc=f"tokenizing {what}", disable=not enabled, leave=False, dynamic_ncols=True
    )


def build(folder: Path, source: Source, text_column: str, tok: Tokenizer, progress: bool) -> tuple[TokenWriter, str]:
    """Tokenize `source` into `folder`/tokens.bin; (the writer, what the documents were)."""
    if tok.eos is None:
        log.warning(
            "the tokenizer of %s has no end-of-sequence token: documents follow each other unmarked", tok.directory
        )
    path = source.fetch()
    if source.kind == "txt":
        writer = TokenWriter(folder, tok.vocab_size, False)
        try:
            with _progress(progress, None, source.shown) as bar:
                writer.add(txt_ids(tok, sources.text_pieces(path, source.shown)))
                bar.update(1)
            writer.finish()
        finally:
            writer.close()
        return writer, "one document"
    columns, batches, total = sources.open_rows(path, source.kind, text_column, source.shown)
    writer = TokenWriter(folder, tok.vocab_size, columns.masked)
    try:
        with _progress(progress, total, source.shown) as bar:
            for rows in _row_batches(batches, columns, source):
                _add_rows(writer, tok, source, columns, rows)
                bar.update(len(rows))
        if writer.documents == 0:
            raise DataError(f"{source.shown} holds no rows: no documents to train on")
        if columns.masked and not writer.trained:
            raise DataError(
                f"{source.shown} has no completion tokens to train on (instruction data is trained on completions, "
                "or the assistant's turns of messages)"
            )
        writer.finish()
    finally:
        writer.close()
    return writer, f"{writer.documents} documents from {columns.describe()}"


def txt_ids(tok: Tokenizer, pieces: Iterable[str]) -> list[int]:
    """A .txt file as one document: its pieces encoded (special tokens with the first), then EOS."""
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += tok.tok(piece, add_special_tokens=i == 0)["input_ids"]
    with_eos(ids, None, tok.eos, False)
    return ids


def _row_batches(batches: Iterator[Any], columns: Columns, source: Source) -> Iterator[list[Any]]:
    done = 0
    for batch in batches:
        rows = sources.rows_of(batch, columns, source, done)
        done += len(rows)
        if rows:
            yield rows


def _add_rows(writer: TokenWriter, tok: Tokenizer, source: Source, columns: Columns, rows: list[Any]) -> None:
    first = writer.documents
    for i, row in enumerate(rows):
        values = row if columns.mode == "prompt" else (row,)
        if any(v is None for v in values):
            raise sources.row_error(source, columns, first + i, f"{columns.describe()} hold no value (null)")
    if columns.mode == "text":
        for ids in text_ids(tok, rows):
            writer.add(ids)
    elif columns.mode == "prompt":
        for prompt, completion in rows:
            writer.add(*segments_ids(tok, [(prompt, False), (completion, True)], special=True))
    else:
        for i, messages in enumerate(rows):
            problem = sources.row_problem({sources.MESSAGES: messages}, columns)
            if problem:
                raise sources.row_error(source, columns, first + i, problem)
            writer.add(*segments_ids(tok, chat_segments(tok, messages), special=False))


# ---- the cache -----------------------------------------------------------------------------------------


@dataclass
class DataOptions:
    """How text data becomes tokens (the trainer's --text-column, --tokenizer, --data-cache)."""

    text_column: str = "text"
    tokenizer: str | None = None
    cache: str | None = None
    progress: bool = True


def cache_key(source: Source, text_column: str, tok: Tokenizer) -> str:
    """The cache folder's name: the source's contents, the tokenizer's files and the column option
    (the columns read follow from them)."""
    described = {
        "format": FORMAT,
        "source": source.identity(),
        "tokenizer": tok.identity,
        "read": ["txt", sources.TXT_PIECE] if source.kind == "txt" else ["rows", text_column],
    }
    return xxhash.xxh3_128(json.dumps(described, sort_keys=True).encode()).hexdigest()


def cached_tokens(source: Source, tok: Tokenizer, options: DataOptions, what: str) -> TokenFile:
    """The token file of text `source`: from the cache, or tokenized into it now; one log line
    names the cache file either way."""
    cache = as_local(options.cache, "--data-cache") if options.cache else default_cache()
    if cache.exists() and not cache.is_dir():
        raise DataError(f"--data-cache {cache} is a file: give a folder")
    if source.loc is None and source.path is not None and overlaps(cache, source.path):
        raise DataError(
            f"--data-cache {cache} overlaps the data {source.shown}: keep the cache out of the data (and the data "
            "out of the cache)"
        )
    before = source.stamp()
    key = cache_key(source, options.text_column, tok)

    def make(folder: Path) -> None:
        writer, documents = build(folder, source, options.text_column, tok, options.progress)
        source.check_unchanged(before)  # the key was its contents before it was read
        about = {"source": source.shown, "read": documents, "tokenizer": str(tok.directory), "tokens": writer.count}
        write_file(folder / ABOUT, [json.dumps(about, indent=1).encode()], what="token cache note")

    with _BUILDING:
        try:
            path, built = _cached_entry(cache / key, make)
        finally:
            source.release()
    tokens = TokenFile(path, identity=key, shown=source.shown)
    try:
        read = read_json(path.parent / ABOUT, "token cache note").get("read", "?")
    except Exception:  # noqa: BLE001 - a note is only for this line
        read = "?"
    log.info(
        "%s %s: %s, %d tokens%s (tokenizer %s) %s %s",
        what,
        source.shown,
        read,
        len(tokens),
        " with a loss mask" if tokens.mask is not None else "",
        tok.directory,
        "tokenized into" if built else "from the token cache:",
        path,
    )
    return tokens


def _cached_entry(entry: Path, make: Any) -> tuple[Path, bool]:
    """`entry`/tokens.bin, made by `make(staging folder)` unless it is there (a run producing it
    now is waited for); (its path, whether this call made it)."""
    tokens, waited = entry / TOKENS, False
    job = Job()  # this process alone: the ranks are not a job yet, each takes the lock itself
    while True:
        if _complete(tokens):
            return tokens, False
        try:
            with staged_output(entry, overwrite=True, what="tokenize data", job=job) as out:
                if _complete(tokens):  # made while this run waited for the lock
                    return tokens, False
                if tokens.is_file():
                    log.warning("the token cache's %s is damaged: tokenizing again", tokens)
                make(out.path)
                commit_all(out, job)
            return tokens, True
        except FolderInUseError as e:
            if not waited:
                log.info("waiting for the token cache: %s", e)
                waited = True
            time.sleep(WAIT_S)


def _complete(tokens: Path) -> bool:
    """Whether a cache folder's token file is there and whole."""
    if not tokens.is_file():
        return False
    try:
        TokenFile(tokens)
    except DataError:
        return False
    return True


def write_prepared(source: Source, tok: Tokenizer, options: DataOptions, out: str | Path) -> tuple[TokenFile, str]:
    """scripts/prepare_data.py: the token file the cache would hold, written to `out` (made in a
    scratch folder beside it, then written through the I/O core); (it, what the documents were)."""
    if source.loc is None and source.path is not None and overlaps(out, source.path):
        raise DataError(f"--out {out} overlaps the input {source.shown}: write the token file elsewhere")
    before = source.stamp()
    with scratch_folder(out, job=Job()) as folder:
        try:
            writer, documents = build(folder, source, options.text_column, tok, options.progress)
            source.check_unchanged(before)
        finally:
            source.release()

        def chunks() -> Iterator[bytes]:
            with open(writer.path, "rb") as f:
                while block := f.read(COPY_BLOCK):
                    yield block

        write_file(out, chunks(), what="token file")
    return TokenFile(out, shown=str(out)), documents


def find_tokenizer(options: DataOptions, folders: Sequence[Path], what: str, shown: str) -> Tokenizer:
    """--tokenizer, else the first of `folders` (the model's) that holds a tokenizer."""
    if options.tokenizer:
        return load_tokenizer(options.tokenizer)
    for folder in folders:
        if folder.is_dir() and has_tokenizer(folder):
            return load_tokenizer(folder, "the model's tokenizer")
    where = ", ".join(str(f) for f in folders) or "no model folder (--model-config / --resume only)"
    raise DataError(
        f"{what} {shown} is text, tokenized with the model's tokenizer, but there is none in {where}: "
        "pass --tokenizer DIR (a folder holding tokenizer.json), or give a token file"
    )


def open_data(text: str, what: str, options: DataOptions, folders: Sequence[Path]) -> TokenFile:
    """--data / --eval-data: a token file as it is; text (trainer/sources.py) as its cached tokens."""
    source = sources.locate(text, what)
    if not source.is_text:
        return TokenFile(source.fetch(), shown=text)
    tok = find_tokenizer(options, folders, what, text)
    return cached_tokens(source, tok, options, what)
