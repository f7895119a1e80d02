#!/usr/bin/env python
"""Tokenize text into a token file for the trainer (`--data`).

    python scripts/prepare_data.py fixtures/tiny-corpus.txt --out tokens.bin
    python scripts/prepare_data.py ./texts/ --tokenizer ./Llama-2-7b-hf --out tokens.bin

Inputs are text files or directories (every *.txt inside, sorted). With `--tokenizer DIR` (any
local Hugging Face tokenizer, e.g. the model directory) each file is one document, encoded and
followed by the tokenizer's end-of-sequence id; without it, the text is taken as UTF-8 bytes
(vocabulary 256), which any model with at least 256 ids can train on. The output format is
described in trainer/data.py (a 32-byte header, then uint16/uint32 ids); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainer.data import bits, unigram_entropy, write_tokens  # noqa: E402


def text_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.txt") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"prepare_data: error: {path} does not exist")
    if not files:
        raise SystemExit("prepare_data: error: no text files found")
    return files


def tokenize(files: list[Path], tokenizer_dir: str | None) -> tuple[np.ndarray, int, str]:
    if tokenizer_dir is None:
        data = b"".join(f.read_bytes() for f in files)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64), 256, "bytes"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids: list[int] = []
    for f in files:
        ids += tok(f.read_text(encoding="utf-8"), add_special_tokens=True)["input_ids"]
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int64), len(tok), f"tokenizer {tokenizer_dir}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="text files or directories of *.txt")
    parser.add_argument("--out", required=True, help="token file to write (.bin)")
    parser.add_argument("--tokenizer", default=None, help="local Hugging Face tokenizer directory (default: bytes)")
    parser.add_argument("--repeat", type=int, default=1, help="repeat the data this many times (tiny corpora)")
    args = parser.parse_args(argv)
    tokens, vocab, how = tokenize(text_files(args.inputs), args.tokenizer)
    if args.repeat > 1:
        tokens = np.tile(tokens, args.repeat)
    out = write_tokens(args.out, tokens, vocab)
    h = unigram_entropy(tokens)
    print(f"prepare_data: {len(tokens):,} tokens ({how}, vocabulary {vocab}) -> {out}; "
          f"unigram entropy {h:.3f} nats ({bits(h):.2f} bits) per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
