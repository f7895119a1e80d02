"""The encoder tasks' data: labelled rows tokenized, labels mapped, masked-LM masks drawn, and the
rows served in the token data's deterministic order (trainer/data.py's `Batches`).

`--task sequence-classification`: a row is `--text-column` (and `--text-pair-column`, a second
segment) and `--label-column`. Labels are whole numbers 0 .. `--num-labels` - 1, or text: then
the training data's distinct labels in sorted order are ids 0, 1, ... (a model that already
classifies keeps its own `label2id`), saved with the model as `id2label` / `label2id`.

`--task pretraining`: a row is `--text-column`, or a sentence pair (`--text-pair-column`) with the
`next_sentence_label` column (0: the second sentence follows the first, 1: it does not, as
transformers' BertForPreTraining reads it) for next-sentence prediction; without that column the
run trains the masked LM only (its log says so). Masks are drawn on the fly as BERT's recipe and
transformers' DataCollatorForLanguageModeling do: each token that is not special (CLS, SEP,
padding) is chosen with probability 0.15; a chosen token becomes [MASK] with probability 0.8, a
random id with 0.1, stays with 0.1; the chosen tokens are the targets. Sample i of the stream
(its position, not its row) draws from a generator seeded with (--seed, i), so the masks do not
depend on the layout and a resumed run draws what the uninterrupted one would have.

Rows are tokenized with the model's tokenizer (or `--tokenizer`) as pairs when there is a second
column ([CLS] a [SEP] b [SEP], token types 0 then 1), truncated and padded to `--seq-len`, with
their attention mask: every batch has the same shape (static shapes for XLA). A sample is a
row: epoch e visits every row once in the order of a permutation seeded with (--seed, e); the
position is the number of samples consumed, as for token data. Held-out data is read in file
order, all of it: the last batch is completed with padding rows that count for nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import rows
from .data import Batches
from .errors import DataError

log = logging.getLogger("trainer")
CLASSIFICATION, PRETRAINING = "sequence-classification", "pretraining"
NSP_COLUMN = "next_sentence_label"
IGNORE = -100
MLM_PROBABILITY, MASK_SHARE, RANDOM_SHARE = 0.15, 0.8, 0.1
TRAIN_SALT, EVAL_SALT = 0x4D4C4D, 0x4556414C  # the masks' generator streams of --data and --eval-data
WHOLE = re.compile(r"[+-]?\d+")


@dataclass
class Columns:
    """The columns a row is read from (`pair`, `label` None: not read)."""

    text: str
    pair: str | None
    label: str | None
    hints: dict[str, str] = field(default_factory=dict)  # column -> what to do when a table lacks it


@dataclass
class Labels:
    """Class labels: `names[i]` is label i's name; `ids` maps text labels to ids (None: the labels
    are whole numbers)."""

    names: list[str]
    ids: dict[str, int] | None

    def id2label(self) -> dict[str, str]:
        return {str(i): name for i, name in enumerate(self.names)}

    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}


@dataclass
class RowData:
    """Tokenized rows: ids and token types `[rows, seq]`, each row's attended length, and its label
    (a class id, or the next-sentence label; IGNORE: none)."""

    shown: str
    identity: str
    ids: np.ndarray
    types: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    pad_id: int
    special: np.ndarray  # [vocab] bool: the tokenizer's special ids (never masked)
    mask_id: int | None
    vocab_size: int
    table: rows.Table | None = None  # where the rows are (for errors naming a row's line)
    mask: None = None  # no loss mask: what trainer/data.py's token files may have

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[1])


# ---- reading and tokenizing --------------------------------------------------------------------------


def read_rows(text: str, what: str, columns: Columns, tok: Any, seq_len: int, vocab: int) -> tuple[RowData, list[Any]]:
    """The rows of `text` tokenized, and their raw labels (as read; None without a label column)."""
    table = rows.open_table(text, what)
    for name in (columns.text, columns.pair, columns.label):
        if name is not None:
            rows.require(table, name, columns.hints.get(name, "pass --text-column NAME"))
    names = [n for n in (columns.text, columns.pair, columns.label) if n is not None]
    if tok.pad_token_id is None:
        raise DataError(f"the tokenizer {tok.name_or_path} has no padding token: a BERT tokenizer has [PAD]")
    ids: list[np.ndarray] = []
    types: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    raw: list[Any] = []
    count = 0
    for batch in rows.batches(table, names):
        n = len(batch[names[0]])
        for column in (columns.text, columns.pair):
            if column is None:
                continue
            for i, value in enumerate(batch[column]):
                if not isinstance(value, str):
                    shown = "null" if value is None else type(value).__name__
                    raise table.error(count + i, f"column {column!r} holds {shown}, not text")
        try:
            enc = tok(
                batch[columns.text],
                batch[columns.pair] if columns.pair else None,
                padding="max_length",
                truncation=True,
                max_length=seq_len,
                return_token_type_ids=True,
                return_attention_mask=True,
            )
        except Exception as e:  # noqa: BLE001 - the tokenizer's errors (a sequence it cannot truncate)
            raise DataError(f"{text}: the tokenizer cannot encode its rows at --seq-len {seq_len} ({e})") from None
        ids.append(np.asarray(enc["input_ids"], dtype=np.int64))
        types.append(np.asarray(enc["token_type_ids"], dtype=np.int64))
        lengths.append(np.asarray(enc["attention_mask"], dtype=np.int64).sum(axis=1))
        raw += batch[columns.label] if columns.label else [None] * n
        count += n
    if count == 0:
        raise DataError(f"{text} holds no rows: nothing to train or evaluate on")
    all_ids = np.concatenate(ids)
    if int(all_ids.max()) >= vocab:
        raise DataError(
            f"{text}: the tokenizer gives id {int(all_ids.max())}, outside the model's vocabulary of {vocab}: "
            "use the model's tokenizer (--tokenizer)"
        )
    special = np.zeros(vocab, dtype=bool)
    special[[i for i in tok.all_special_ids if 0 <= i < vocab]] = True
    digest = hashlib.sha256(
        json.dumps([table.source.identity(), type(tok).__name__, len(tok), names, seq_len]).encode()
    ).hexdigest()
    data = RowData(
        text,
        digest,
        all_ids.astype(np.int32),
        np.concatenate(types).astype(np.int8),
        np.concatenate(lengths).astype(np.int32),
        np.full(count, IGNORE, dtype=np.int64),
        int(tok.pad_token_id),
        special,
        tok.mask_token_id,
        vocab,
        table,
    )
    return data, raw


def _table(data: RowData) -> rows.Table:
    assert data.table is not None  # read_rows gives every RowData its table
    return data.table


def _whole(value: Any) -> int | None:
    """`value` as a whole number (an int, a float without a fraction, or text holding one), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and WHOLE.fullmatch(value.strip()):
        return int(value)
    return None


def _check_label(table: rows.Table, index: int, value: Any) -> None:
    """A label is a whole number or text: one line naming the row otherwise (missing, a list, ...)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise table.error(index, "the label is missing")
    if not isinstance(value, str) and _whole(value) is None:
        raise table.error(index, f"label {value!r} is neither a whole number nor text")


def choose_labels(data: RowData, raw: list[Any], num_labels: int, model_labels: Mapping[str, int] | None) -> Labels:
    """The labels of the training rows (module doc): whole numbers, or text mapped in sorted order
    (or by the model's own `label2id`); `num_labels` 0: as many as the model or the data has."""
    table = _table(data)
    for i, value in enumerate(raw):
        _check_label(table, i, value)
    numbers = [_whole(v) for v in raw]
    if all(n is not None for n in numbers):
        if model_labels:  # the model's own names of its label ids
            return Labels(sorted(model_labels, key=lambda k: model_labels[k]), None)
        count = num_labels or max(0, *(n for n in numbers if n is not None)) + 1
        return Labels([f"LABEL_{i}" for i in range(count)], None)
    texts = [str(v).strip() for v in raw]
    if model_labels:
        return Labels(sorted(model_labels, key=lambda k: model_labels[k]), dict(model_labels))
    names = sorted(set(texts))
    count = num_labels or len(names)
    if len(names) > count:
        raise DataError(
            f"{data.shown} holds {len(names)} distinct labels ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''}) "
            f"but --num-labels is {count}: pass --num-labels {len(names)}"
        )
    names += [f"LABEL_{i}" for i in range(len(names), count)]
    return Labels(names, {n: i for i, n in enumerate(names)})


def assign_labels(data: RowData, raw: list[Any], labels: Labels, what: str) -> None:
    """Each row's label id (into data.labels), or one line naming the first row whose label is not one."""
    table = _table(data)
    count = len(labels.names)
    for i, value in enumerate(raw):
        _check_label(table, i, value)
        if labels.ids is None:
            n = _whole(value)
            if n is None:
                raise table.error(i, f"label {value!r} is not a whole number like the labels of --data")
            if n < 0:
                raise table.error(i, f"label {n} is negative: labels count from 0")
            if n >= count:
                raise table.error(
                    i,
                    f"label {n} is outside --num-labels {count} (labels 0 to {count - 1}): fix the row or pass --num-labels {n + 1}",
                )
            data.labels[i] = n
            continue
        key = str(value).strip()
        if key not in labels.ids:
            known = ", ".join(labels.names[:8]) + (", ..." if count > 8 else "")
            raise table.error(i, f"label {key!r} is not one of the {count} labels of {what} ({known})")
        data.labels[i] = labels.ids[key]


def assign_next_sentence(data: RowData, raw: list[Any]) -> None:
    """The next-sentence labels: 0 (the pair is consecutive) or 1 (it is not)."""
    table = _table(data)
    for i, value in enumerate(raw):
        n = _whole(value)
        if n not in (0, 1):
            raise table.error(i, f"{NSP_COLUMN} is {value!r}: 0 (the second text follows the first) or 1 (it does not)")
        data.labels[i] = n


# ---- masks ---------------------------------------------------------------------------------------------


def mask_tokens(data: RowData, row: int, seed: int, salt: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample `index`'s masked-LM input and targets of `row` (module doc): (ids, labels with
    IGNORE where not chosen)."""
    ids = data.ids[row].astype(np.int64)
    rng = np.random.default_rng([seed, salt, index])
    n = ids.shape[0]
    candidates = ~data.special[ids] & (np.arange(n) < data.lengths[row])
    chosen = candidates & (rng.random(n) < MLM_PROBABILITY)
    how = rng.random(n)
    random_ids = rng.integers(0, data.vocab_size, n)
    labels = np.where(chosen, ids, IGNORE)
    out = ids.copy()
    assert data.mask_id is not None  # checked when the task is planned
    out[chosen & (how < MASK_SHARE)] = data.mask_id
    swap = chosen & (how >= MASK_SHARE) & (how < MASK_SHARE + RANDOM_SHARE)
    out[swap] = random_ids[swap]
    return out, labels


# ---- batches -------------------------------------------------------------------------------------------


class RowBatches(Batches):
    """This dp rank's rows of each step, in trainer/data.py's order and position (a sample is a row).
    `padded` (held-out data, in file order): samples past the last row are padding rows.

    A step's inputs are `[rows, 3, seq]` (ids, token types, attention mask). Its targets:
    classification, `[rows]` labels; pre-training, `[rows, seq + 2]`: the masked-LM targets, the
    next-sentence label, and the number of masked-LM targets in the step's whole global batch
    (every rank's; the loss divides by it, so every layout computes the same mean)."""

    def __init__(
        self,
        data: RowData,
        task: str,
        global_batch: int,
        micro_batch: int,
        dp: int,
        dp_rank: int,
        seed: int,
        padded: bool = False,
    ):
        if global_batch % (micro_batch * dp):
            raise DataError(f"--global-batch {global_batch} is not a multiple of --micro-batch {micro_batch} x dp {dp}")
        self.file = data  # type: ignore[assignment]  # Batches' state() reads its identity and name
        self.rows = data
        self.task, self.padded = task, padded
        self.seq_len, self.global_batch, self.micro_batch = data.seq_len, global_batch, micro_batch
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self.vocab_size = data.vocab_size
        self.shuffle = not padded
        self.num_samples = len(data)
        self.consumed_samples = 0
        self.unmasked = None
        self._perm_epoch = -1
        self._perm = None
        self.salt = EVAL_SALT if padded else TRAIN_SALT

    def row_of(self, index: int) -> int:
        """The row of global sample `index` (-1: a padding row past held-out data's end)."""
        if self.padded:
            return index if index < self.num_samples else -1
        epoch, pos = divmod(index, self.num_samples)
        return int(self._order(epoch)[pos])

    def _sample(self, index: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """(ids, token types, attended length, masked-LM targets: all IGNORE but in pre-training) of
        sample `index`."""
        data, row = self.rows, self.row_of(index)
        if row < 0:  # padding: only its first position attended (no empty softmax), no targets
            ids = np.full(data.seq_len, data.pad_id, dtype=np.int64)
            return ids, np.zeros(data.seq_len, dtype=np.int64), 1, np.full(data.seq_len, IGNORE, dtype=np.int64)
        types, length = data.types[row].astype(np.int64), int(data.lengths[row])
        if self.task == PRETRAINING:
            ids, targets = mask_tokens(data, row, self.seed, self.salt, index)
            return ids, types, length, targets
        return data.ids[row].astype(np.int64), types, length, np.full(data.seq_len, IGNORE, dtype=np.int64)

    def label(self, index: int) -> int:
        row = self.row_of(index)
        return int(self.rows.labels[row]) if row >= 0 else IGNORE

    def step_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // self.dp
        start = self.consumed_samples
        mine = range(start + self.dp_rank * per_rank, start + (self.dp_rank + 1) * per_rank)
        samples = [self._sample(i) for i in mine]
        seq = np.arange(self.seq_len)
        inputs = np.stack(
            [np.stack([ids, types, (seq < length).astype(np.int64)]) for ids, types, length, _ in samples]
        )
        labels = np.asarray([self.label(i) for i in mine], dtype=np.int64)
        if self.task == PRETRAINING:
            counted = sum(int((self._sample(i)[3] != IGNORE).sum()) for i in range(start, start + self.global_batch))
            self.unmasked = counted
            mlm = np.stack([s[3] for s in samples])
            extra = np.stack([labels, np.full(per_rank, counted, dtype=np.int64)], axis=1)
            targets = np.concatenate([mlm, extra], axis=1)
        else:
            targets = labels
        self.consumed_samples += self.global_batch
        return torch.from_numpy(inputs), torch.from_numpy(np.ascontiguousarray(targets))

    def steps_to_cover(self) -> int:
        """Batches that hold every row once (the last one padded)."""
        return -(-self.num_samples // self.global_batch)


def row_stats(data: RowData) -> str:
    """How full the rows are, for the run's log: truncated rows and the mean length."""
    full = int((data.lengths >= data.seq_len).sum())
    return f"{len(data)} rows, {data.lengths.mean():.1f} tokens on average, {full} at --seq-len {data.seq_len}"


def describe(columns: Columns, nsp: bool, task: str) -> str:
    """What a row is read as, for the run's log."""
    read = [repr(c) for c in (columns.text, columns.pair) if c]
    if task == CLASSIFICATION:
        return f"text {' + '.join(read)}, label {columns.label!r}"
    return f"text {' + '.join(read)}, " + (f"next-sentence label {NSP_COLUMN!r}" if nsp else "masked LM only")
