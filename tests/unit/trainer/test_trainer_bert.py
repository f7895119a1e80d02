"""BERT in the trainer: sequence classification from labelled rows, and masked-LM / next-sentence
pre-training (NxD's BERT example), in shardkit's BERT layout (q/k/v and intermediate
column-parallel, output projections row-parallel, the rest replicated).

Acceptance: 3 full-batch fp32 steps of classification from fixtures/tweets-tiny.csv equal
transformers' BertForSequenceClassification + torch.optim.AdamW on the same padded batch (1e-4
relative per step); dp2 (ZeRO-1) and tp2 equal dp1 (1e-5); the `--export-hf` folder gives the
reference's trained logits; pre-training at tp2 equals tp1 and transformers' BertForPreTraining
loss with the same masks, with AdamW and with LAMB (written here from its formula); bad data is
one line and exit 2. The tokenizer is a WordPiece vocabulary written here (nothing downloaded).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from bert_helpers import CLS, TWEETS, bert_model, eval_records, tweets, write_vocab
from trainer_helpers import check_ok, losses, rel_diff, run_inprocess, run_ranks

from shardkit.testing import make_tiny_model

ROOT = Path(__file__).resolve().parents[3]
STEPS, SEQ, ROWS, MICRO, LR, SEED = 3, 16, 36, 6, 1e-3, 1234
REL = 1e-4
LABELS = ["negative", "neutral", "positive"]
COMMON = [
    "--seq-len", str(SEQ), "--micro-batch", str(MICRO), "--global-batch", str(ROWS), "--steps", str(STEPS),
    "--lr", str(LR), "--warmup", "0", "--decay", "constant", "--clip-grad", "0", "--dtype", "fp32",
    "--no-progress", "--threads", "1", "--seed", str(SEED),
]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bert")


@pytest.fixture(scope="module")
def tok_dir(work) -> Path:
    return write_vocab(work / "tokenizer")


@pytest.fixture(scope="module")
def classifier(work, tok_dir) -> Path:
    labels = {"id2label": dict(enumerate(LABELS)), "label2id": {n: i for i, n in enumerate(LABELS)}}
    return bert_model(work, "bert-cls", tok_dir, "BertForSequenceClassification", **labels)


@pytest.fixture(scope="module")
def pretrained(work, tok_dir) -> Path:
    return bert_model(work, "bert-pre", tok_dir, "BertForPreTraining")


def hf_batch(tok_dir: Path, rows: list[dict]) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    enc = tok([r["text"] for r in rows], padding="max_length", truncation=True, max_length=SEQ, return_tensors="pt")
    return dict(enc)


def classification_reference(model_dir: Path, tok_dir: Path) -> tuple[list[float], torch.nn.Module]:
    """transformers' model (no dropout: eval mode) + AdamW, full-batch steps on every row."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = hf_batch(tok_dir, tweets())
    labels = torch.tensor([LABELS.index(r["sentiment"]) for r in tweets()])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    got = []
    for _ in range(STEPS):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(float(loss.detach()))
    return got, model


def probe_logits(model: torch.nn.Module, tok_dir: Path) -> torch.Tensor:
    with torch.no_grad():
        return model(**hf_batch(tok_dir, tweets()[:8])).logits


@pytest.fixture(scope="module")
def single(work, classifier, tok_dir):
    """The classification run on one process: (metrics, export, eval metrics)."""
    metrics, export = work / "cls-dp1.jsonl", work / "cls-dp1-export"
    dev = work / "dev.csv"
    with open(dev, "w", newline="") as f:
        writer = csv.DictWriter(f, ["text", "sentiment"])
        writer.writeheader()
        writer.writerows(tweets()[::3])
    run_inprocess(
        [
            "--model",
            str(classifier),
            "--data",
            str(TWEETS),
            "--eval-data",
            str(dev),
            "--metrics",
            str(metrics),
            *COMMON,
            *CLS,
            "--export-hf",
            str(export),
        ]
    )
    return metrics, export, dev


def test_classification_trains_like_transformers_and_adamw(single, classifier, tok_dir):
    """3 full-batch steps (6 micro-batches) equal transformers + AdamW on the same padded batch; the
    export is a BertForSequenceClassification with the labels and the tokenizer, giving the trained
    logits; the evaluation's loss and accuracy are the trained model's on the held-out rows."""
    from transformers import AutoModelForSequenceClassification

    metrics, export, dev = single
    got = losses(metrics)
    expected, trained = classification_reference(classifier, tok_dir)
    assert abs(expected[-1] - expected[0]) > 0.05 * expected[0], "the weights barely moved"
    assert rel_diff(got, expected) < REL, (got, expected)
    exported = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    ours, ref = probe_logits(exported, tok_dir), probe_logits(trained, tok_dir)
    assert (ours - ref).abs().max() < REL * ref.abs().max(), (ours - ref).abs().max()
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {str(i): n for i, n in enumerate(LABELS)} and config["label2id"]["positive"] == 2
    assert config["problem_type"] == "single_label_classification" and exported.config.num_labels == 3
    assert (export / "vocab.txt").is_file()
    (record,) = eval_records(metrics)
    dev_rows = tweets()[::3]
    with torch.no_grad():
        logits = trained(**hf_batch(tok_dir, dev_rows)).logits
    labels = torch.tensor([LABELS.index(r["sentiment"]) for r in dev_rows])
    want_loss = float(torch.nn.functional.cross_entropy(logits, labels))
    assert abs(record["eval_loss"] - want_loss) < REL * want_loss
    assert record["eval_accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    assert record["eval_samples"] == len(dev_rows)


@pytest.mark.parametrize(
    "layout", [["--tp", "2"], ["--dp", "2", "--zero1", "--activation-checkpointing"]], ids=["tp2", "dp2-zero1-ac"]
)
def test_classification_layouts_equal_one_process(layout, work, single, classifier):
    """tp2, and dp2 with ZeRO-1 and activation checkpointing, give the one-process run's losses and
    evaluation (1e-5)."""
    metrics = work / f"cls-{'-'.join(layout)}.jsonl"
    check_ok(
        run_ranks(
            2,
            [
                "--model",
                str(classifier),
                "--data",
                str(TWEETS),
                "--eval-data",
                str(single[2]),
                "--metrics",
                str(metrics),
                *COMMON,
                *CLS,
                *layout,
            ],
        )
    )
    assert rel_diff(losses(metrics), losses(single[0])) < 1e-5
    (ours,), (one,) = eval_records(metrics), eval_records(single[0])
    assert abs(ours["eval_loss"] - one["eval_loss"]) < 1e-5 * one["eval_loss"]
    assert ours["eval_accuracy"] == one["eval_accuracy"]


def test_classification_resumes_on_another_layout_and_exports(work, single, classifier, tok_dir):
    """A tp2 checkpoint of step 2 resumes at tp1 for step 3: the uninterrupted run's loss; the
    checkpoints keep --num-kept 1; `shardkit ckpt export` writes the trained classifier."""
    from click.testing import CliRunner
    from transformers import AutoModelForSequenceClassification

    from shardkit.cli import cli

    ckpt, metrics = work / "cls-ckpt", work / "cls-resumed.jsonl"
    base = [
        "--model",
        str(classifier),
        "--data",
        str(TWEETS),
        "--metrics",
        str(metrics),
        *COMMON,
        *CLS,
        "--checkpoint-dir",
        str(ckpt),
        "--num-kept",
        "1",
    ]
    check_ok(run_ranks(2, [*base, "--tp", "2", "--steps", "2", "--override-schedule"]))
    run_inprocess([*base, "--resume", "latest_if_exists"])
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_3"]
    assert rel_diff(losses(metrics), losses(single[0])) < 1e-5
    out = work / "cls-ckpt-export"
    result = CliRunner().invoke(cli, ["-q", "ckpt", "export", str(ckpt), str(out), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    exported = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    one = AutoModelForSequenceClassification.from_pretrained(single[1], dtype=torch.float32).eval()
    ours, ref = probe_logits(exported, tok_dir), probe_logits(one, tok_dir)
    assert (ours - ref).abs().max() < 1e-5 * ref.abs().max()


def test_a_pretrained_encoder_gets_a_seeded_classifier(work, pretrained, caplog):
    """From a BertForPreTraining folder: the pooler and encoder are its own, the classifier is drawn
    as transformers initialises it (normal(0, initializer_range), zero bias) from --seed, the same
    on every tp rank and in every layout; one log line says so."""
    import logging

    from shardkit import Layout, open_checkpoint
    from trainer.encoder import EncoderSpec, read_pieces

    ckpt = open_checkpoint(pretrained)
    config = {**ckpt.config, "architectures": ["BertForSequenceClassification"], "id2label": dict(enumerate(LABELS))}
    one, drawn = read_pieces(ckpt, EncoderSpec.for_task(config, Layout(), "sequence-classification"), 0, SEED)
    assert drawn == ["classifier.bias", "classifier.weight"]
    w = one["classifier.weight"]
    assert w.shape == (3, 64) and abs(float(w.std()) - 0.02) < 0.005 and not one["classifier.bias"].any()
    for t in range(2):
        two, _ = read_pieces(ckpt, EncoderSpec.for_task(config, Layout(tp=2), "sequence-classification"), t, SEED)
        assert torch.equal(two["classifier.weight"], w) and torch.equal(
            two["bert.pooler.dense.weight"], one["bert.pooler.dense.weight"]
        )
    other, _ = read_pieces(ckpt, EncoderSpec.for_task(config, Layout(), "sequence-classification"), 0, SEED + 1)
    assert not torch.equal(other["classifier.weight"], w)
    caplog.set_level(logging.INFO, logger="trainer")
    metrics = work / "from-pretrained.jsonl"
    run_inprocess(
        ["--model", str(pretrained), "--data", str(TWEETS), "--metrics", str(metrics), *COMMON, *CLS, "--steps", "1"]
    )
    assert any("classifier.bias, classifier.weight not in" in r.getMessage() for r in caplog.records)
    assert len(losses(metrics)) == 1 and math.isfinite(losses(metrics)[0])


def test_any_source_gives_the_same_pieces(work, pretrained, tok_dir):
    """The encoder's pieces of a Hugging Face folder equal those of its tp2 shards (resharded on
    load); a bare BertModel folder (saved without the `bert.` prefix) gives its encoder and pooler."""
    from safetensors.torch import load_file

    from shardkit import Layout, convert, open_checkpoint
    from trainer.encoder import EncoderSpec, read_pieces

    config = {
        **open_checkpoint(pretrained).config,
        "architectures": ["BertForSequenceClassification"],
        "id2label": dict(enumerate(LABELS)),
    }
    spec = EncoderSpec.for_task(config, Layout(tp=2), "sequence-classification")
    convert(pretrained, work / "pre-tp2", Layout(tp=2))
    for t in range(2):
        a, _ = read_pieces(open_checkpoint(pretrained), spec, t, SEED)
        b, _ = read_pieces(open_checkpoint(work / "pre-tp2"), spec, t, SEED)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    bare = bert_model(work, "bert-bare", tok_dir, "BertModel")
    saved = load_file(bare / "model.safetensors")
    pieces, drawn = read_pieces(
        open_checkpoint(bare), EncoderSpec.for_task(config, Layout(), "sequence-classification"), 0, SEED
    )
    assert drawn == ["classifier.bias", "classifier.weight"]
    assert all(torch.equal(pieces["bert." + k], v) for k, v in saved.items() if "position_ids" not in k)


def test_a_csv_with_a_byte_order_mark_reads_its_header(work, classifier):
    """A spreadsheet's CSV (UTF-8 with a byte-order mark): the same rows, the same first loss."""
    marked = work / "tweets-bom.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + TWEETS.read_bytes())
    got = []
    for data in (TWEETS, marked):
        metrics = work / f"bom-{data.stem}.jsonl"
        run_inprocess(
            ["--model", str(classifier), "--data", str(data), "--metrics", str(metrics), *COMMON, *CLS, "--steps", "1"]
        )
        got.append(losses(metrics))
    assert got[0] == got[1]


def test_rows_from_parquet_datasets_and_s3_train_like_the_csv(work, classifier, bucket, caplog):
    """The tweets as .parquet (labels as whole numbers in float64, as pandas may store them), as a
    datasets folder and as s3://bucket/key.csv: the csv's first loss."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tweets()
    table = pa.table(
        {"text": [r["text"] for r in rows], "sentiment": [float(LABELS.index(r["sentiment"])) for r in rows]}
    )
    pq.write_table(table, work / "tweets.parquet")
    sources = {"parquet": str(work / "tweets.parquet")}
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(
        {"text": [r["text"] for r in rows], "sentiment": [r["sentiment"] for r in rows]}
    ).save_to_disk(str(work / "tweets-ds"))
    sources["datasets"] = str(work / "tweets-ds")
    from shardkit.io.objects import s3

    s3.client().put_object(Bucket=bucket, Key="tweets/train.csv", Body=TWEETS.read_bytes())
    sources["s3"] = f"s3://{bucket}/tweets/train.csv"
    want = None
    for name, data in {"csv": str(TWEETS), **sources}.items():
        metrics = work / f"rows-{name}.jsonl"
        labels = ["--num-labels", "3"] if name == "parquet" else []
        run_inprocess(
            [
                "--model",
                str(classifier),
                "--data",
                data,
                "--metrics",
                str(metrics),
                *COMMON,
                *CLS,
                *labels,
                "--steps",
                "1",
            ]
        )
        got = losses(metrics)
        want = want or got
        assert got == want, name


# ---- pre-training ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(work) -> Path:
    """Sentence pairs from the tweets: each row and the next (label 0) or one from elsewhere (1)."""
    rows = tweets()
    out = work / "pairs.jsonl"
    with open(out, "w") as f:
        for i, r in enumerate(rows):
            follows = i % 2 == 0
            other = rows[(i + 1) % len(rows)] if follows else rows[(i + 17) % len(rows)]
            f.write(
                json.dumps({"text": r["text"], "second": other["text"], "next_sentence_label": 0 if follows else 1})
                + "\n"
            )
    return out


PRE = ["--task", "pretraining", "--text-pair-column", "second"]


def pretraining_batches(pretrained: Path, pairs: Path):
    """The trainer's own batches of the run (dp1): the same masks the reference trains on."""
    from transformers import AutoTokenizer

    from trainer import tasks

    tok = AutoTokenizer.from_pretrained(str(pretrained), local_files_only=True)
    columns = tasks.Columns("text", "second", tasks.NSP_COLUMN)
    data, raw = tasks.read_rows(str(pairs), "--data", columns, tok, SEQ, 64)
    tasks.assign_next_sentence(data, raw)
    return tasks.RowBatches(data, tasks.PRETRAINING, ROWS, MICRO, 1, 0, SEED)


class Lamb(torch.optim.Optimizer):
    """LAMB from its formula (timm's Lamb, trust_clip=True), on whole tensors: the reference."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                t = state["t"]
                u = (state["m"] / (1 - b1**t)) / (state["v"].sqrt() / math.sqrt(1 - b2**t) + group["eps"])
                ratio = 1.0
                if group["weight_decay"]:
                    u = u + group["weight_decay"] * p
                    w, n = float(p.norm()), float(u.norm())
                    ratio = min(1.0, w / n) if w > 0 and n > 0 else 1.0
                p.add_(u, alpha=-group["lr"] * ratio)


def pretraining_reference(pretrained: Path, pairs: Path, optimizer: str) -> list[float]:
    """transformers' BertForPreTraining (eval mode: no dropout) on the trainer's batches: its loss
    (masked LM + next sentence) per full-batch step, AdamW or LAMB (weight decay 0.01 on matrices)."""
    from transformers import BertForPreTraining

    model = BertForPreTraining.from_pretrained(pretrained, dtype=torch.float32).eval()
    batches = pretraining_batches(pretrained, pairs)
    params = dict(model.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.01 if optimizer == "lamb" else 0.0},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = (
        Lamb(groups, LR, (0.9, 0.999), 1e-6, 0.01)
        if optimizer == "lamb"
        else torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    )
    got = []
    for _ in range(STEPS):
        inputs, targets = batches.step_batch()
        out = model(
            input_ids=inputs[:, 0],
            token_type_ids=inputs[:, 1],
            attention_mask=inputs[:, 2],
            labels=targets[:, :SEQ].contiguous(),
            next_sentence_label=targets[:, SEQ].contiguous(),
        )
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(float(out.loss.detach()))
    return got


OPTIMIZERS = {
    "adamw": [],
    "lamb": ["--optimizer", "lamb", "--weight-decay", "0.01", "--beta2", "0.999", "--eps", "1e-6"],
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_pretraining_tp2_equals_tp1_and_transformers(optimizer, work, pretrained, pairs):
    """Masked LM + next-sentence prediction: tp2 equals tp1 (1e-5), and both equal transformers'
    BertForPreTraining loss with the same masks, trained by AdamW or LAMB (1e-4); LAMB's trust
    ratio is the whole tensor's at tp2 and with ZeRO-1 at dp2."""
    base = ["--model", str(pretrained), "--data", str(pairs), *COMMON, *PRE, *OPTIMIZERS[optimizer]]
    one, two = work / f"pre-{optimizer}-1.jsonl", work / f"pre-{optimizer}-tp2.jsonl"
    run_inprocess([*base, "--metrics", str(one)])
    check_ok(run_ranks(2, [*base, "--metrics", str(two), "--tp", "2"]))
    expected = pretraining_reference(pretrained, pairs, optimizer)
    assert max(abs(e - expected[0]) for e in expected) > 0.005 * expected[0], "the weights barely moved"
    assert rel_diff(losses(one), expected) < REL, (losses(one), expected)
    assert rel_diff(losses(two), losses(one)) < 1e-5
    if optimizer == "lamb":
        zero = work / "pre-lamb-dp2.jsonl"
        check_ok(run_ranks(2, [*base, "--metrics", str(zero), "--dp", "2", "--zero1"]))
        assert rel_diff(losses(zero), losses(one)) < 1e-5


def test_lamb_trust_ratios_are_whole_tensors_for_decoders(work):
    """LAMB on a Llama whose pieces mix tensors and replicate them: tp2 with q/k/v fused into one
    piece and K/V replicated twice (--kv-multiplier 2) equals transformers + the reference LAMB on
    the whole tensors (3 full-batch steps, 1e-4): each segment takes its own tensor's ratio and a
    replicated slice counts once."""
    from trainer_helpers import CORPUS
    from transformers import AutoModelForCausalLM

    from trainer.data import Batches, TokenFile, write_tokens

    seq, sequences, micro, lr = 32, 16, 4, 1e-2
    model_dir = make_tiny_model("llama-trainer-tiny", work / "llama-lamb", seed=3)
    data = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8)[: sequences * seq + 1].astype(np.int64)
    tokens = write_tokens(work / "llama-lamb.bin", data, 256)
    metrics = work / "llama-lamb.jsonl"
    check_ok(run_ranks(2, [
        "--model", str(model_dir), "--data", str(tokens), "--metrics", str(metrics), "--seq-len", str(seq),
        "--micro-batch", str(micro), "--global-batch", str(sequences), "--steps", str(STEPS), "--lr", str(lr),
        "--warmup", "0", "--decay", "constant", "--clip-grad", "0", "--dtype", "fp32", "--no-progress",
        "--threads", "1", *OPTIMIZERS["lamb"], "--tp", "2", "--qkv", "fused", "--kv-multiplier", "2",
    ]))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    opt = Lamb(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr,
        (0.9, 0.999),
        1e-6,
        0.01,
    )
    batches = Batches(TokenFile(tokens), seq, sequences, micro, 1, 0, SEED)
    expected = []
    for _ in range(STEPS):
        inputs, targets = batches.step_batch()
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    assert max(abs(e - expected[0]) for e in expected) > 0.01 * expected[0], "the weights barely moved"
    assert rel_diff(losses(metrics), expected) < REL, (losses(metrics), expected)


def test_masks_follow_the_recipe_and_the_sample_not_the_layout(pretrained, pairs):
    """15% of the non-special tokens chosen, of them 80% [MASK], 10% random, 10% kept; specials and
    padding never chosen; a sample's masks depend on (seed, its index) only: dp2's two halves are
    dp1's batch, and a resumed position draws the same masks."""
    from trainer import tasks

    batches = pretraining_batches(pretrained, pairs)
    data = batches.rows
    chosen = kept = masked = candidates = 0
    for index in range(400):
        row = batches.row_of(index)
        ids, labels = tasks.mask_tokens(data, row, SEED, tasks.TRAIN_SALT, index)
        original = data.ids[row]
        pick = labels != tasks.IGNORE
        real = np.arange(SEQ) < data.lengths[row]
        assert not (pick & (data.special[original] | ~real)).any()
        candidates += int((~data.special[original] & real).sum())
        chosen += int(pick.sum())
        masked += int((ids[pick] == data.mask_id).sum())
        kept += int((ids[pick] == original[pick]).sum())
    assert 0.12 < chosen / candidates < 0.18 and 0.74 < masked / chosen < 0.86 and 0.06 < kept / chosen < 0.16
    whole = batches.step_batch()
    halves = [tasks.RowBatches(data, tasks.PRETRAINING, ROWS, MICRO, 2, d, SEED).step_batch() for d in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole[0])
    assert torch.equal(torch.cat([h[1] for h in halves]), whole[1])
    later = tasks.RowBatches(data, tasks.PRETRAINING, ROWS, MICRO, 1, 0, SEED)
    later.load_state({"consumed_samples": ROWS})
    assert torch.equal(later.step_batch()[0], batches.step_batch()[0])


# ---- bad input -------------------------------------------------------------------------------------------


def bad_cases(work: Path, classifier: Path, pretrained: Path) -> dict[str, tuple[list[str], str]]:
    """name: (arguments, a fragment of the one line)."""
    folder = work / "bad"
    folder.mkdir(exist_ok=True)
    files = {
        "no-label-column.csv": "text,mood\nhello,positive\n",
        "empty.csv": "",
        "header-only.csv": "text,sentiment\n",
        "label-outside.csv": "text,sentiment\nhello,0\nthe city,1\nthe park,7\n",
        "ragged.csv": 'text,sentiment\nhello,0\n"a, b",1\nthe train,is,late,2\n',
        "missing-label.csv": "text,sentiment\nhello,0\nthe city,\n",
        "unknown-label.csv": "text,sentiment\nthe city,neutral\nthe park,angry\n",
        "bad.jsonl": '{"text": "hello", "sentiment": "positive"}\n{"text": "the city", \n',
        "number-text.jsonl": '{"text": "hello", "sentiment": "positive"}\n{"text": 5, "sentiment": "neutral"}\n',
        "negative-label.csv": "text,sentiment\nhello,0\nthe city,-1\n",
        "list-label.jsonl": '{"text": "hello", "sentiment": 1}\n{"text": "the city", "sentiment": [2]}\n',
        "pairs-without-nsp.jsonl": '{"text": "hello", "second": "the city"}\n',
        "one-label.csv": "text,sentiment\nhello,positive\nthe city,positive\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)

    def data(name: str) -> list[str]:
        return ["--data", str(folder / name)]

    model = ["--model", str(classifier)]
    odd = folder / "odd-labels"
    if not odd.exists():
        shutil.copytree(classifier, odd)
        config = json.loads((odd / "config.json").read_text())
        (odd / "config.json").write_text(json.dumps({**config, "id2label": {"0": "negative", "5": "neutral", "2": 7}}))
    return {
        "malformed id2label": (["--model", str(odd), "--data", str(TWEETS)], "id2label must map the ids 0 .. n-1"),
        "missing column": (
            [*model, *data("no-label-column.csv")],
            "has no column 'sentiment' (its columns: 'text', 'mood'): pass --label-column NAME",
        ),
        "empty file": ([*model, *data("empty.csv")], "empty.csv is empty"),
        "no rows": ([*model, *data("header-only.csv")], "holds no rows"),
        "label outside": (
            [*model, *data("label-outside.csv")],
            "label-outside.csv line 4: label 7 is outside --num-labels 3",
        ),
        "ragged row": ([*model, *data("ragged.csv")], "ragged.csv line 4 has 4 fields, the header 2"),
        "missing label": ([*model, *data("missing-label.csv")], "missing-label.csv line 3: the label is missing"),
        "unknown eval label": (
            [*model, "--data", str(TWEETS), "--eval-data", str(folder / "unknown-label.csv")],
            "unknown-label.csv line 3: label 'angry' is not one of the 3 labels of the model",
        ),
        "jsonl not parsing": ([*model, *data("bad.jsonl")], "bad.jsonl line 2 is not JSON"),
        "text not text": (
            [*model, *data("number-text.jsonl")],
            "number-text.jsonl line 2: column 'text' holds int, not text",
        ),
        "missing file": ([*model, "--data", str(folder / "nowhere.csv")], "nowhere.csv does not exist"),
        "token file": ([*model, "--data", str(ROOT / "fixtures" / "bert-tiny.json")], "not a token file"),
        "labels of the model": (
            [*model, "--data", str(TWEETS), "--num-labels", "4"],
            "the model classifies into 3 labels",
        ),
        "bert as a causal LM": (
            ["--model", str(pretrained), "--data", str(TWEETS), "--task", "causal-lm"],
            "bert is an encoder, not a causal LM",
        ),
        "negative label": (
            [*model, *data("negative-label.csv")],
            "negative-label.csv line 3: label -1 is negative: labels count from 0",
        ),
        "absurd label count": (
            [*model, *data("label-outside.csv"), "--num-labels", "1000000000"],
            "--num-labels 1000000000 is more labels than any classification has",
        ),
        "labels for pre-training": (
            ["--model", str(pretrained), "--data", str(TWEETS), "--task", "pretraining", "--num-labels", "3"],
            "--num-labels is for --task sequence-classification",
        ),
        "lamb with lora": (
            [
                "--model",
                str(make_tiny_model("llama-trainer-tiny", folder / "llama")),
                "--data",
                str(TWEETS),
                "--task",
                "causal-lm",
                "--optimizer",
                "lamb",
                "--lora-rank",
                "4",
            ],
            "--optimizer lamb does not take --lora-rank",
        ),
        "one label": (
            ["--model", str(pretrained), *data("one-label.csv"), "--num-labels", "0"],
            "one-label.csv holds one label ('positive'): a classification needs 2 or more",
        ),
        "resume of another task": (
            ["--model", str(pretrained), "--data", str(TWEETS), "--resume", str(work / "pre-ckpt" / "step_1")],
            "holds BertForPreTraining, this run trains BertForSequenceClassification",
        ),
        "label not a label": (
            [*model, *data("list-label.jsonl")],
            "list-label.jsonl line 2: label [2] is neither a whole number nor text",
        ),
        "eval pairs without nsp": (
            [
                "--model",
                str(pretrained),
                "--data",
                str(work / "pairs.jsonl"),
                "--task",
                "pretraining",
                "--text-pair-column",
                "second",
                "--eval-data",
                str(folder / "pairs-without-nsp.jsonl"),
                "--num-labels",
                "0",
            ],
            "has no column 'next_sentence_label' (its columns: 'text', 'second'): the next-sentence labels of --data",
        ),
        "sequence parallel for bert": (
            [*model, "--data", str(TWEETS), "--sequence-parallel"],
            "does not take --sequence-parallel",
        ),
    }


def test_bad_data_is_one_line_and_exit_2(work, classifier, pretrained, pairs, capsys):
    from trainer.__main__ import main

    run_inprocess(
        [
            "--model",
            str(pretrained),
            "--data",
            str(pairs),
            *COMMON,
            *PRE,
            "--steps",
            "1",
            "--checkpoint-dir",
            str(work / "pre-ckpt"),
        ]
    )
    cases = bad_cases(work, classifier, pretrained)
    capsys.readouterr()
    for name, (args, fragment) in cases.items():
        code = main([*COMMON, *CLS, *args])  # a later option wins
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("trainer: error:"), (name, code, err)
        assert fragment in err[0], (name, err[0])
    done = run_ranks(2, ["--model", str(classifier), "--data", str(TWEETS), *COMMON, *CLS, "--pp", "2"])
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    assert done.returncode == 2 and lines and "does not take --pp > 1" in lines[0], done.stderr
