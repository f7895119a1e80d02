#!/usr/bin/env python
"""Tokenize text into a token file for the trainer (`--data`).

    python scripts/prepare_data.py fixtures/tiny-corpus.txt --out tokens.bin
    python scripts/prepare_data.py ./texts/ --tokenizer ./Llama-2-7b-hf --out tokens.bin
    python scripts/prepare_data.py s3://bucket/sst2/train.jsonl --tokenizer ./Mixtral --out train.bin

One input of any kind the trainer's --data takes (a .txt, .jsonl, .csv or .parquet file, a
datasets save_to_disk folder, local or s3://; `--text-column`, instruction data with
prompt/completion or messages columns: trainer/sources.py) is written exactly as the trainer's
token cache holds it (trainer/tokenizing.py), streamed in bounded memory. Several inputs, or
folders of *.txt, are text files, each one document. With `--tokenizer DIR` (any local Hugging
Face tokenizer, e.g. the model directory) documents are encoded and each followed by the
tokenizer's end-of-sequence id; without it, text files are taken as UTF-8 bytes (vocabulary 256),
which any model with at least 256 ids can train on. The output format is described in
trainer/data.py (a 32-byte header, then uint16/uint32 ids, then the loss mask of instruction
data); nothing is downloaded. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shardkit.errors import ShardkitError  # noqa: E402
from shardkit.io.safety.overlap import overlaps  # noqa: E402
from trainer.data import TokenFile, bits, write_tokens  # noqa: E402
from trainer.errors import DataError  # noqa: E402
from trainer.sources import Source, locate, text_pieces  # noqa: E402
from trainer.tokenizing import DataOptions, Tokenizer, load_tokenizer, txt_ids, write_prepared  # noqa: E402

log = logging.getLogger("prepare_data")


def is_text_folder(path: Path) -> bool:
    """A folder of *.txt files (not a datasets save_to_disk folder)."""
    return path.is_dir() and not (path / "state.json").exists() and not (path / "dataset_dict.json").exists()


def text_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if is_text_folder(path):
            files += sorted(p for p in path.rglob("*.txt") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(
                f"{path} does not exist" if not path.exists() else f"{path} is a datasets folder: give it alone"
            )
    if not files:
        raise DataError("no text files found: give .txt files or folders holding them")
    return files


def several_texts(files: list[Path], tok: Tokenizer | None) -> tuple[np.ndarray, int, str]:
    """Text files, each one document: as UTF-8 bytes without a tokenizer, else tokenized."""
    if tok is None:
        data = b"".join(f.read_bytes() for f in files)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64), 256, "bytes"
    ids: list[int] = []
    for f in files:
        ids += txt_ids(tok, text_pieces(f, str(f)))
    return np.asarray(ids, dtype=np.int64), tok.vocab_size, f"tokenizer {tok.directory}"


def unigram_entropy_of(tokens: np.ndarray, block: int = 1 << 24) -> float:
    """Entropy (nats per token) of the token frequencies, counted in blocks (bounded memory)."""
    counts = np.zeros(0, dtype=np.int64)
    for start in range(0, len(tokens), block):
        part = np.bincount(np.asarray(tokens[start : start + block], dtype=np.int64))
        counts = np.pad(counts, (0, max(0, len(part) - len(counts))))
        counts[: len(part)] += part
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())


def prepare(args: argparse.Namespace) -> tuple[TokenFile, str]:
    """Write the token file; (it, how the text became tokens)."""
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    source: Source | None = None
    if len(args.inputs) == 1 and not is_text_folder(Path(args.inputs[0])):
        source = locate(args.inputs[0], "input")
        if not source.is_text:  # any other file is text, as it always was here
            source = Source(source.shown, "txt", source.fetch())
        if tok is None and source.kind != "txt":
            raise DataError(
                f"{args.inputs[0]} is tokenized with a tokenizer: pass --tokenizer DIR (the model's folder)"
            )
    if source is not None and tok is not None:
        options = DataOptions(args.text_column, args.tokenizer, None, sys.stderr.isatty())
        tokens, documents = write_prepared(source, tok, options, args.out)
        how = f"tokenizer {tok.directory}, {documents}"
        if args.repeat > 1:
            mask = None if tokens.mask is None else np.tile(tokens.mask, args.repeat)
            write_tokens(args.out, np.tile(tokens.tokens, args.repeat), tok.vocab_size, mask)
        return TokenFile(args.out), how
    files = [source.fetch()] if source is not None else text_files(args.inputs)
    for f in files:
        if overlaps(args.out, f):
            raise DataError(f"--out {args.out} is the input {f}: write the token file elsewhere")
    ids, vocab, how = several_texts(files, tok)
    write_tokens(args.out, np.tile(ids, args.repeat) if args.repeat > 1 else ids, vocab)
    return TokenFile(args.out), how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="one input of any --data kind, or text files / folders of *.txt")
    parser.add_argument("--out", required=True, help="token file to write (.bin)")
    parser.add_argument("--tokenizer", default=None, help="local Hugging Face tokenizer directory (default: bytes)")
    parser.add_argument("--text-column", default="text", help="the column of rows that holds the text (default: text)")
    parser.add_argument("--repeat", type=int, default=1, help="repeat the data this many times (tiny corpora)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="prepare_data: %(message)s")
    try:
        tokens, how = prepare(args)
    except ShardkitError as e:
        text = str(e).strip()
        print(f"prepare_data: error: {text.splitlines()[0] if text else type(e).__name__}", file=sys.stderr)
        return 2
    h = unigram_entropy_of(tokens.tokens)
    masked = "" if tokens.mask is None else f", {int(np.count_nonzero(tokens.mask)):,} of them trained on (loss mask)"
    print(
        f"prepare_data: {len(tokens):,} tokens{masked} ({how}, vocabulary {tokens.vocab_size}) -> {args.out}; "
        f"unigram entropy {h:.3f} nats ({bits(h):.2f} bits) per token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
