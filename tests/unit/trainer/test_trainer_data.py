"""The data users have (issue 51): --data / --eval-data / scripts/prepare_data.py read .txt, .jsonl,
.csv, .parquet and datasets save_to_disk folders, local or s3://, tokenized with the model's
tokenizer into a cached token file; instruction data (prompt/completion, messages) trains on its
completions only.

1. every kind trains exactly like the token file of the same documents (equal per-step losses);
2. instruction data: the first step's loss is transformers' cross-entropy over the completion
   tokens of the global batch, and dp2, tp2, pp2 and micro-batches of 2 give dp1's losses;
3. s3:// data (the moto server of tests/support/s3_fixtures.py);
4. resuming mid-epoch on another layout continues exactly; a changed file is said on resume;
5. bad data: one line, exit 2, nothing left in the cache;
6. prepare_data.py writes the bytes the cache holds; two runs tokenizing at once do not mix.

The tokenizer is built here, offline: a BPE of 200 ids trained on the bundled text (tokenizers),
saved with transformers beside a chat template.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import CORPUS, ROOT, check_ok, losses, rel_diff, run_args, run_inprocess, run_ranks

from shardkit.testing import make_tiny_model

CONFIG = "llama-trainer-tiny"  # vocab 256: the tokenizer's 200 ids fit
REL = 1e-5
SEED = 1234  # COMMON's seed (the trainer's default)


def make_tokenizer(folder: Path):
    """A fast BPE tokenizer of 200 ids (<unk>, <s> added in front, </s> the EOS) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=[*string.printable, "\u2581"],
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer-data")


@pytest.fixture(scope="module")
def tok_dir(work) -> Path:
    make_tokenizer(work / "tokenizer")
    return work / "tokenizer"


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


@pytest.fixture(scope="module")
def hf_model(work, tok_dir) -> Path:
    """The tiny model, with the tokenizer in its folder (where the trainer finds it)."""
    model = make_tiny_model(CONFIG, work / "hf", seed=3)
    for f in tok_dir.iterdir():
        shutil.copy(f, model / f.name)
    return model


@pytest.fixture(scope="module")
def bare_model(work) -> Path:
    """The tiny model without a tokenizer."""
    return make_tiny_model(CONFIG, work / "bare", seed=3)


DOCS = [p.strip() for p in CORPUS.read_text().split("\n\n") if p.strip()]


def packed(tok, docs: list[str]) -> np.ndarray:
    """The documents as the issue says: each tokenized (with <s>), followed by EOS, packed."""
    ids: list[int] = []
    for doc in docs:
        ids += tok(doc)["input_ids"] + [tok.eos_token_id]
    return np.asarray(ids)


@pytest.fixture(scope="module")
def reference(work, tok, hf_model):
    """The token file of DOCS written by hand, and the losses of 5 steps on it."""
    from trainer.data import write_tokens

    path = write_tokens(work / "reference.bin", packed(tok, DOCS), len(tok))
    check = run_inprocess(run_args(hf_model, path, work / "reference.jsonl"))
    assert check.steps == 5
    return path, losses(work / "reference.jsonl")


def write_rows(kind: str, path: Path, rows: list[dict]) -> Path:
    """`rows` as a .jsonl, .csv, .parquet file or a datasets save_to_disk folder."""
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def text_rows(docs: list[str] = DOCS) -> list[dict]:
    return [{"id": i, "text": d, "label": i % 2} for i, d in enumerate(docs)]


def cached(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/tokens.bin"))


# ---- 1. every kind trains like its token file ----------------------------------------------------------

KINDS = {"jsonl": "d.jsonl", "csv": "d.csv", "parquet": "d.parquet", "datasets": "d-saved"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_text_data_trains_exactly_like_its_token_file(kind, work, tok, hf_model, reference):
    """The same documents (among other columns) as .jsonl, .csv, .parquet or a datasets folder
    give the hand-packed token file's ids and per-step losses; a second run reads the cache."""
    from trainer.data import TokenFile

    data = write_rows(kind, work / KINDS[kind], text_rows())
    cache, metrics = work / f"cache-{kind}", work / f"{kind}.jsonl"
    run_inprocess(run_args(hf_model, data, metrics, "--data-cache", str(cache)))
    [tokens] = cached(cache)
    assert np.array_equal(np.asarray(TokenFile(tokens).tokens), np.asarray(TokenFile(reference[0]).tokens))
    assert TokenFile(tokens).mask is None and TokenFile(tokens).vocab_size == len(tok)
    assert losses(metrics) == reference[1]
    stamp = tokens.stat().st_mtime_ns
    run_inprocess(run_args(hf_model, data, work / f"{kind}-again.jsonl", "--data-cache", str(cache), "--steps", "1"))
    assert cached(cache) == [tokens] and tokens.stat().st_mtime_ns == stamp  # read, not written again
    assert losses(work / f"{kind}-again.jsonl") == reference[1][:1]


def test_txt_and_eval_data_and_tokenizer_option(work, tok, tok_dir, bare_model, reference, caplog):
    """A .txt file is one document (<s> text </s>); --tokenizer DIR tokenizes for a model folder
    without one; --eval-data takes the same kinds; one log line names the cache file."""
    from trainer.data import TokenFile
    from trainer.sources import TXT_PIECE

    text = CORPUS.read_text()
    assert len(text) < TXT_PIECE  # one piece: exactly the tokenizer's encoding of the whole text
    data = work / "corpus.txt"
    shutil.copy(CORPUS, data)
    evaluation = write_rows("jsonl", work / "eval.jsonl", text_rows(DOCS[:30]))
    cache, metrics = work / "cache-txt", work / "txt.jsonl"
    caplog.set_level(logging.INFO, logger="trainer")
    summary = run_inprocess(
        run_args(
            bare_model,
            data,
            metrics,
            "--tokenizer",
            str(tok_dir),
            "--data-cache",
            str(cache),
            "--eval-data",
            str(evaluation),
            "--steps",
            "2",
        )
    )
    assert summary.eval_loss is not None and np.isfinite(summary.eval_loss)
    files = {TokenFile(p).tokens.shape[0]: p for p in cached(cache)}
    expected = np.asarray(tok(text)["input_ids"] + [tok.eos_token_id])
    assert np.array_equal(np.asarray(TokenFile(files[len(expected)]).tokens), expected)
    lines = [r.getMessage() for r in caplog.records if "tokenized into" in r.getMessage()]
    assert len(lines) == 2 and all(str(cache) in line for line in lines), lines


def test_text_pieces_and_small_batches_change_nothing(work, tok_dir, monkeypatch):
    """Bounded memory: a .txt file is read in pieces cut after a newline, and rows in small
    batches and blocks give the same tokens as whole reads."""
    from trainer import sources
    from trainer.data import TokenFile
    from trainer.tokenizing import DataOptions, load_tokenizer, open_data

    monkeypatch.setattr(sources, "TXT_PIECE", 1000)
    pieces = list(sources.text_pieces(CORPUS, "corpus"))
    assert "".join(pieces) == CORPUS.read_text() and len(pieces) > 20
    assert all(p.endswith("\n") and len(p) <= 2000 for p in pieces[:-1])
    data = write_rows("jsonl", work / "batches.jsonl", text_rows())
    whole = open_data(str(data), "--data", DataOptions(cache=str(work / "cache-whole")), [tok_dir])
    monkeypatch.setattr(sources, "BATCH_ROWS", 5)
    monkeypatch.setattr(sources, "BLOCK_BYTES", 4096)
    small = open_data(str(data), "--data", DataOptions(cache=str(work / "cache-small")), [tok_dir])
    assert np.array_equal(np.asarray(whole.tokens), np.asarray(small.tokens))
    assert load_tokenizer(tok_dir).identity == load_tokenizer(tok_dir).identity
    assert isinstance(TokenFile(whole.path).identity, str)


# ---- 2. instruction data ---------------------------------------------------------------------------------


def instruction_rows() -> list[dict]:
    """A sentence as the prompt, the next as the completion: every window of 32 tokens holds both."""
    sentences = [s.strip() for doc in DOCS for s in doc.split(". ") if s.strip()]
    return [{"prompt": f"Question: {a}.", "completion": f" {b}."} for a, b in zip(sentences[::2], sentences[1::2])]


def completion_mask(tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """TRL's rule: the tokens of prompt + completion that the prompt alone gives are the prompt's."""
    ids = tok(prompt + completion)["input_ids"]
    alone = tok(prompt)["input_ids"]
    k = 0
    while k < min(len(ids), len(alone)) and ids[k] == alone[k]:
        k += 1
    return ids + [tok.eos_token_id], [0] * k + [1] * (len(ids) - k) + [1]


@pytest.fixture(scope="module")
def instruction(work, hf_model):
    """Instruction rows as .jsonl, and dp1's losses (5 steps)."""
    data = write_rows("jsonl", work / "sft.jsonl", instruction_rows())
    metrics = work / "sft-dp1.jsonl"
    run_inprocess(run_args(hf_model, data, metrics, *sft_options(work, data)))
    return data, losses(metrics), eval_losses(metrics)


def sft_options(work: Path, data: Path) -> list[str]:
    return ["--data-cache", str(work / "cache-sft"), "--eval-data", str(data), "--eval-steps", "2", "--eval-every", "2"]


def eval_losses(metrics: Path) -> list[float]:
    return [r["eval_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "eval"]


def test_instruction_loss_is_the_completions_only(work, tok, hf_model, instruction):
    """The first step's loss is transformers' model + cross-entropy over the completion tokens of
    the global batch (labels -100 on prompts), summed and divided by their count."""
    from transformers import AutoModelForCausalLM

    from trainer.data import TokenFile

    ids, mask = [], []
    for row in instruction_rows():
        i, m = completion_mask(tok, row["prompt"], row["completion"])
        ids, mask = ids + i, mask + m
    [path] = cached(work / "cache-sft")
    stored = TokenFile(path)
    assert np.array_equal(np.asarray(stored.tokens), ids) and np.array_equal(np.asarray(stored.mask), mask)
    tokens, flags, seq = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool), 32
    order = np.random.default_rng([SEED, 0]).permutation((len(ids) - 1) // seq)
    model = AutoModelForCausalLM.from_pretrained(hf_model, torch_dtype=torch.float32)
    total, count, unmasked = 0.0, 0, 0.0
    with torch.no_grad():
        for sample in order[:4]:  # the global batch of step 1
            start = int(sample) * seq
            window = tokens[start : start + seq + 1]
            labels = torch.where(flags[start + 1 : start + seq + 1], window[1:], torch.tensor(-100))
            logits = model(input_ids=window[None, :-1]).logits[0].float()
            total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
            unmasked += float(torch.nn.functional.cross_entropy(logits, window[1:]))
    expected = total / count
    assert abs(instruction[1][0] - expected) / expected < REL, (instruction[1][0], expected)
    assert abs(unmasked / 4 - expected) / expected > 1e-3  # the mask changes the loss


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "micro2"])
def test_instruction_loss_is_the_same_in_every_layout(layout, work, hf_model, instruction):
    """The mean over the unmasked tokens of the global batch, whatever holds them: dp2, tp2 (the
    vocab-parallel loss), pp2 (the pipeline's last stage) and micro-batches of 2 equal dp1."""
    data, expected, evaluated = instruction
    metrics = work / f"sft-{layout}.jsonl"
    args = run_args(hf_model, data, metrics, *sft_options(work, data))
    if layout == "micro2":
        run_inprocess([*args, "--micro-batch", "2"])
    else:
        check_ok(run_ranks(2, [*args, f"--{layout[:2]}", "2"]))
    assert rel_diff(losses(metrics), expected) < REL, (losses(metrics), expected)
    assert len(evaluated) == 3 and rel_diff(eval_losses(metrics), evaluated) < REL, (eval_losses(metrics), evaluated)


def test_messages_train_on_the_assistant_turns(work, tok, tok_dir):
    """A messages column is rendered with the chat template; only the assistant turns (and the
    EOS after the last) are trained on."""
    from trainer.tokenizing import DataOptions, open_data

    rows = [
        {
            "messages": [
                {"role": "user", "content": "where is the town"},
                {"role": "assistant", "content": "by the river"},
                {"role": "user", "content": "and the bread"},
                {"role": "assistant", "content": "in the oven"},
            ]
        },
    ] * 40
    data = write_rows("parquet", work / "chat.parquet", rows)
    tokens = open_data(str(data), "--data", DataOptions(cache=str(work / "cache-chat")), [tok_dir])
    assert tokens.mask is not None
    one = len(tokens) // 40
    ids, mask = np.asarray(tokens.tokens[:one]), np.asarray(tokens.mask[:one])
    rendered = tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert list(ids) == tok(rendered, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    trained = tok.decode(ids[mask == 1].tolist())
    assert "river" in trained and "oven" in trained and "town" not in trained and "bread" not in trained
    assert mask[-1] == 1


# ---- 3. s3:// --------------------------------------------------------------------------------------------


def test_s3_data_trains_like_the_local_file(work, hf_model, reference, bucket, caplog):
    """s3://bucket/key.jsonl (and a token file in S3) train like the local files; the second run
    finds its cache by the object's ETag; a missing key is one line."""
    from shardkit.io.objects import s3

    data = write_rows("jsonl", work / "s3.jsonl", text_rows())
    s3.client().put_object(Bucket=bucket, Key="sst2/train.jsonl", Body=data.read_bytes())
    s3.client().put_object(Bucket=bucket, Key="sst2/tokens.bin", Body=reference[0].read_bytes())
    cache = work / "cache-s3"
    for key in ("train.jsonl", "tokens.bin", "train.jsonl"):
        metrics = work / f"s3-{key}.jsonl"
        metrics.unlink(missing_ok=True)
        caplog.clear()
        caplog.set_level(logging.INFO, logger="trainer")
        run_inprocess(run_args(hf_model, f"s3://{bucket}/sst2/{key}", metrics, "--data-cache", str(cache)))
        assert losses(metrics) == reference[1], key
    assert len(cached(cache)) == 1
    assert any("from the token cache" in r.getMessage() for r in caplog.records)
    from trainer.__main__ import main

    assert main(run_args(hf_model, f"s3://{bucket}/sst2/nope.jsonl", work / "m.jsonl", "--data-cache", str(cache))) == 2


# ---- 4. resume ---------------------------------------------------------------------------------------------


def test_resume_mid_epoch_on_another_layout_and_a_changed_file(work, hf_model, caplog):
    """6 steps on a .jsonl at dp1 (checkpoint at 3), resumed at tp2 from step 3: steps 4-6 equal the
    uninterrupted run's. Resumed on a changed .jsonl: the run says the data is not the checkpoint's."""
    data = write_rows("jsonl", work / "resume.jsonl", text_rows())
    ckpt, cache = work / "ckpt-resume", str(work / "cache-resume")
    full = work / "resume-full.jsonl"
    run_inprocess(
        run_args(
            hf_model,
            data,
            full,
            "--data-cache",
            cache,
            "--steps",
            "6",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "3",
        )
    )
    resumed = work / "resume-tp2.jsonl"
    check_ok(
        run_ranks(
            2,
            run_args(
                hf_model,
                data,
                resumed,
                "--data-cache",
                cache,
                "--steps",
                "6",
                "--tp",
                "2",
                "--resume",
                str(ckpt / "step_3"),
            ),
        )
    )
    assert [r for r in losses(resumed)] and rel_diff(losses(resumed), losses(full)[3:]) < REL
    caplog.set_level(logging.INFO, logger="trainer")
    run_inprocess(
        run_args(
            hf_model,
            data,
            work / "resume-same.jsonl",
            "--data-cache",
            cache,
            "--steps",
            "4",
            "--resume",
            str(ckpt / "step_3"),
            "--override-schedule",
        )
    )
    assert not [r for r in caplog.records if "not the data the checkpoint" in r.getMessage()]
    changed = text_rows()
    changed[40]["text"] = changed[40]["text"].replace("the", "a", 1)
    write_rows("jsonl", data, changed)
    caplog.clear()
    run_inprocess(
        run_args(
            hf_model,
            data,
            work / "resume-changed.jsonl",
            "--data-cache",
            cache,
            "--steps",
            "4",
            "--resume",
            str(ckpt / "step_3"),
            "--override-schedule",
        )
    )
    said = [r.getMessage() for r in caplog.records if "not the data the checkpoint" in r.getMessage()]
    assert len(said) == 1 and str(data) in said[0], [r.getMessage() for r in caplog.records]


# ---- 5. bad data -----------------------------------------------------------------------------------------


def _bad_cases(work: Path, tok_dir: Path) -> dict[str, tuple[Path | str, list[str], str]]:
    """name -> (--data, extra options, a fragment of the one line)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"sentence": "a b", "label": 1}, {"sentence": "c d", "label": 0}]
    good = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5))
    lines = good.splitlines(keepends=True)
    files = {
        "missing-column": (write_rows("jsonl", work / "glue.jsonl", rows), [], "its columns: 'sentence', 'label'"),
        "missing-text-column": (
            write_rows("csv", work / "glue.csv", rows),
            ["--text-column", "review"],
            "no column 'review' (its columns: 'sentence', 'label')",
        ),
        "empty-jsonl": (work / "empty.jsonl", [], "is empty"),
        "blank-jsonl": (work / "blank.jsonl", [], "is empty"),
        "empty-csv": (work / "empty.csv", [], "is empty"),
        "bad-json-line": (work / "badline.jsonl", [], "line 4 is not JSON"),
        "not-text-line": (work / "number.jsonl", [], "line 3: 'text' holds int, not text"),
        "missing-in-a-row": (work / "missing.jsonl", [], "line 5: no column 'text' (this row's columns: 'body')"),
        "bad-csv-row": (work / "bad.csv", [], "line 5 has 3 fields, the header 2"),
        "null-parquet-row": (work / "null.parquet", [], "row 2:"),
        "not-parquet": (work / "junk.parquet", [], "not a readable Parquet file"),
        "dataset-dict": (work / "dict-saved", [], "several splits (test, train)"),
        "plain-folder": (work / "plain-folder", [], "not a datasets save_to_disk folder"),
        "missing-file": (work / "nope.jsonl", [], "does not exist"),
        "tokenizer-missing": (work / "glue.jsonl", ["--tokenizer", str(work / "no-tokenizer")], "does not exist"),
        "tokenizer-empty": (work / "glue.jsonl", ["--tokenizer", str(work / "plain-folder")], "holds no tokenizer"),
        "fifo": (work / "fifo.jsonl", [], "not a regular file"),
        "numbers-parquet": (work / "numbers.parquet", [], "column 'text' holds int64 values, not text"),
        "not-utf8-csv": (work / "latin.csv", [], "line 3 is not UTF-8"),
        "not-utf8-jsonl": (work / "latin.jsonl", [], "line 2 is not UTF-8 text"),
        "no-assistant-turn": (work / "no-reply.jsonl", [], "no completion tokens to train on"),
        "bad-message": (work / "bad-message.jsonl", [], "line 2: 'messages' is not a list of"),
        "messages-as-text": (work / "chat-text.parquet", [], "column 'messages' holds string"),
        "data-cache-is-a-file": (work / "glue.jsonl", ["--data-cache", str(work / "empty.csv")], "is a file"),
        "data-cache-in-the-data": (
            work / "saved",
            ["--data-cache", str(work / "saved" / "cache")],
            "overlaps the data",
        ),
    }
    datasets.Dataset.from_list(text_rows()).save_to_disk(str(work / "saved"))
    os.mkfifo(work / "fifo.jsonl")
    pq.write_table(pa.table({"text": [1, 2]}), work / "numbers.parquet")
    (work / "latin.csv").write_bytes("text\nfine\ncaf\u00e9\n".encode("latin-1"))
    (work / "latin.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    user = {"role": "user", "content": "hi"}
    (work / "no-reply.jsonl").write_text(json.dumps({"messages": [user]}) + "\n")
    (work / "bad-message.jsonl").write_text(
        json.dumps({"messages": [user]}) + "\n" + json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n"
    )
    pq.write_table(pa.table({"messages": ["hi"]}), work / "chat-text.parquet")
    (work / "empty.jsonl").write_text("")
    (work / "blank.jsonl").write_text("\n\n  \n")
    (work / "empty.csv").write_text("")
    (work / "badline.jsonl").write_text("".join(lines[:3]) + '{"text": "unfinished\n' + "".join(lines[3:]))
    (work / "number.jsonl").write_text(lines[0] + lines[1] + '{"text": 5}\n' + "".join(lines[2:]))
    (work / "missing.jsonl").write_text("".join(lines[:4]) + '{"body": "x"}\n' + "".join(lines[4:]))
    (work / "bad.csv").write_text('text,label\nhello,1\n"two\nlines",2\nbad,3,4\nfine,5\n')
    pq.write_table(pa.table({"text": ["a", None, "c"]}), work / "null.parquet")
    (work / "junk.parquet").write_bytes(b"PAR1 not really" * 10)
    dataset = datasets.Dataset.from_list([{"text": "a"}])
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(work / "dict-saved"))
    (work / "plain-folder").mkdir(exist_ok=True)
    (work / "plain-folder" / "notes.md").write_text("hi")
    return files


def test_bad_data_is_one_line_and_exit_2(work, hf_model, bare_model, tok_dir, capsys):
    """Each case: exit 2, one line on stderr saying what is wrong, no traceback, and no file or
    staging folder left in the cache."""
    from trainer.__main__ import main

    (work / "bad").mkdir()
    cases = _bad_cases(work / "bad", tok_dir)
    cases["model-without-tokenizer"] = (work / "bad" / "glue.jsonl", ["--model", str(bare_model)], "--tokenizer DIR")
    cache = work / "bad" / "cache"
    capsys.readouterr()  # what making the cases printed
    for name, (data, extra, fragment) in cases.items():
        code = main(run_args(hf_model, data, work / "bad" / "m.jsonl", "--data-cache", str(cache), *extra))
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("trainer: error:"), (name, code, err)
        assert fragment in err[0], (name, err[0])
        assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()], (name, list(cache.rglob("*")))


# ---- 6. prepare_data.py; two runs at once -------------------------------------------------------------------


def prepare_data(args: list[str], capsys) -> tuple[int, str, str]:
    """scripts/prepare_data.py's main in this process: (exit code, stdout, stderr)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_data_writes_what_the_cache_holds(work, tok_dir, hf_model, capsys):
    """prepare_data.py on the same inputs (plain text as .csv, instruction data as .jsonl; the
    first as a command) writes the token file the trainer's cache holds, byte for byte; bad input
    (no tokenizer, --out the input) is one line, exit 2, the input untouched."""
    from trainer.tokenizing import DataOptions, open_data

    for name, rows in (("prep.csv", text_rows()), ("prep-sft.jsonl", instruction_rows())):
        data = write_rows(name.split(".")[1], work / name, rows)
        out = work / f"{name}.bin"
        args = [str(data), "--tokenizer", str(tok_dir), "--out", str(out)]
        if name == "prep.csv":
            done = subprocess.run(
                [sys.executable, "scripts/prepare_data.py", *args], cwd=ROOT, capture_output=True, text=True
            )
            code, stdout, stderr = done.returncode, done.stdout, done.stderr
        else:
            code, stdout, stderr = prepare_data(args, capsys)
        assert code == 0, stderr
        held = open_data(str(data), "--data", DataOptions(cache=str(work / "cache-prep")), [hf_model])
        assert out.read_bytes() == held.path.read_bytes(), name
        assert ("loss mask" in stdout) == (held.mask is not None)
    data = work / "prep.csv"
    before = data.read_bytes()
    for args, fragment in (
        ([str(data), "--out", str(out)], "--tokenizer"),
        ([str(data), "--tokenizer", str(tok_dir), "--out", str(data)], "overlaps the input"),
    ):
        code, _, stderr = prepare_data(args, capsys)
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and fragment in stderr, stderr
    assert data.read_bytes() == before


def test_a_file_changed_while_tokenized_is_refused(work, tok_dir, monkeypatch):
    """The cache key is the contents before the read: a file that changes while it is tokenized
    (a job still writing it) is refused in one line and nothing is cached."""
    from trainer import tokenizing
    from trainer.errors import DataError
    from trainer.tokenizing import DataOptions, open_data

    data = write_rows("jsonl", work / "growing.jsonl", text_rows())
    add_rows = tokenizing._add_rows

    def appending(*args) -> None:
        with open(data, "a") as f:
            f.write(json.dumps({"text": "one more"}) + "\n")
        add_rows(*args)

    monkeypatch.setattr(tokenizing, "_add_rows", appending)
    cache = work / "cache-growing"
    with pytest.raises(DataError, match="changed while it was read"):
        open_data(str(data), "--data", DataOptions(cache=str(cache)), [tok_dir])
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_a_changed_token_file_is_said_on_resume(tmp_path):
    """A token file of the same length with other ids has another identity (a digest of sampled
    blocks): the resumed position is kept and the change said, as a changed length always was."""
    from trainer.data import Batches, TokenFile, write_tokens

    path = write_tokens(tmp_path / "t.bin", np.arange(100_000) % 97, 97)
    saved = Batches(TokenFile(path), 9, 8, 2, 1, 0, seed=5).state().to_dict()
    write_tokens(path, (np.arange(100_000) + 1) % 97, 97)
    notes: list[str] = []

    class Log:
        def warning(self, text: str, *args) -> None:
            notes.append(text % args)

    again = Batches(TokenFile(path), 9, 8, 2, 1, 0, seed=5)
    again.load_state(saved, Log())
    assert again.consumed_samples == 0 and len(notes) == 1 and "its contents changed" in notes[0], notes
    Batches(TokenFile(path), 9, 8, 2, 1, 0, seed=5).load_state(again.state().to_dict(), Log())
    assert len(notes) == 1  # the same file: nothing said


def test_two_runs_tokenizing_at_once_do_not_mix(tmp_path):
    """Two producers of one cache folder at once (each holding its own lock file descriptor, as
    two processes do): one tokenizes, the other waits for its lock and then reads its result."""
    from trainer.tokenizing import TOKENS, _cached_entry

    made: list[str] = []

    def make(folder: Path) -> None:
        made.append(threading.current_thread().name)
        time.sleep(0.6)
        from trainer.data import write_tokens

        write_tokens(folder / TOKENS, np.arange(100) % 7, 7)

    results: dict[str, tuple[Path, bool]] = {}

    def producer() -> None:
        results[threading.current_thread().name] = _cached_entry(tmp_path / "entry", make)

    threads = [threading.Thread(target=producer, name=f"run-{i}") for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert made == ["run-0"], made
    assert results["run-0"] == (tmp_path / "entry" / TOKENS, True)
    assert results["run-1"] == (tmp_path / "entry" / TOKENS, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no staging folder or lock file left
    path = tmp_path / "entry" / TOKENS
    path.write_bytes(path.read_bytes()[:-10])  # a damaged cache file (a full disk, a copy cut short)
    assert _cached_entry(tmp_path / "entry", make) == (path, True) and len(made) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"] and len(path.read_bytes()) == 32 + 200


def test_import_trainer_stays_light():
    """pyarrow and datasets are imported only when such data is read."""
    code = "import sys, trainer, trainer.loop; print([m for m in ('pyarrow', 'datasets') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
