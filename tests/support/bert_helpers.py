"""Helpers of the BERT tests (tests/unit/trainer/test_trainer_bert.py, test_trainer_xla.py,
tests/system/newcomer/test_readme.py): the tweets fixture, a tiny WordPiece tokenizer, a tiny BERT
model folder, and the evaluation records of a metrics file."""

from __future__ import annotations

import collections
import csv
import json
import re
import shutil
from pathlib import Path

from shardkit.testing import fixture_config, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


TWEETS = ROOT / "fixtures" / "tweets-tiny.csv"


CLS = ["--task", "sequence-classification", "--text-column", "text", "--label-column", "sentiment", "--num-labels", "3"]


def tweets() -> list[dict]:
    with open(TWEETS, newline="") as f:
        return list(csv.DictReader(f))


def write_vocab(folder: Path) -> Path:
    """A BERT WordPiece tokenizer of 64 ids: the specials, then the most common words of the tweets."""
    from transformers import BertTokenizerFast

    words = collections.Counter(w for r in tweets() for w in re.findall(r"\w+|[^\w\s]", r["text"].lower()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in words.most_common(59)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(folder)  # beside vocab.txt
    return folder


def bert_model(work: Path, name: str, tok_dir: Path, arch: str, **changes) -> Path:
    """The tiny BERT of fixtures/bert-tiny.json as `arch` (seed 3), the tokenizer in its folder."""
    out = work / name
    if not out.exists():
        make_tiny_model({**fixture_config("bert-tiny"), "architectures": [arch], **changes}, out, seed=3)
        for f in tok_dir.iterdir():
            shutil.copy(f, out / f.name)
    return out


def eval_records(metrics: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in metrics.read_text().splitlines()) if r.get("event") == "eval"]
