"""Pre-tokenized data: a memory-mapped token file, a deterministic sample order, dp slicing and
a position that checkpoints carry, so a resumed run sees exactly the data it would have seen.

Token file format (`.bin`, written by `write_tokens` / scripts/prepare_data.py): a 32-byte
little-endian header, then the tokens:

| bytes | field |
| --- | --- |
| 0-7 | magic `SKTOKENS` |
| 8-11 | format version (1) |
| 12-15 | bytes per token: 2 (uint16) or 4 (uint32) |
| 16-23 | vocabulary size the ids come from (0: unknown) |
| 24-31 | number of tokens |

A NumPy `.npy` file of unsigned or signed integers is read too (vocabulary unknown).

Samples are non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets share
seq_len of them): sample i starts at token i * seq_len. Epoch e visits every sample once, in the
order of a permutation seeded with (seed, e). The run consumes the global sample stream in order:
step s takes samples [s * G, (s + 1) * G) of it (G = global batch); data-parallel rank d takes the
d-th contiguous 1/dp of those, cut into micro-batches. The position is the number of samples
consumed, which does not depend on the layout: resuming with another tp/pp/dp continues exactly.

Held-out data (`--eval-data`) is read the same way without shuffling (`shuffle=False`: sample i
is window i), from its start at every evaluation, so evaluations are comparable over a run and
between layouts.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardkit.io.transaction import write_file
from shardkit.paths import regular_file

from .errors import DataError

MAGIC = b"SKTOKENS"
HEADER = struct.Struct("<8sIIQQ")
VERSION = 1


def write_tokens(path: str | Path, tokens, vocab_size: int) -> Path:
    """Write token ids as a token file (uint16 when the vocabulary fits, else uint32)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise DataError(f"token ids must lie in [0, {vocab_size}); got {array.min()}..{array.max()}")
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    path = Path(path)
    header = HEADER.pack(MAGIC, VERSION, np.dtype(dtype).itemsize, vocab_size, array.size)
    write_file(path, [header, array.astype(dtype, copy=False).tobytes()], what="token file")
    return path


class TokenFile:
    """A memory-mapped token file (.bin with the header above, or .npy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(
                f"data file {self.path} does not exist: tokenize text with scripts/prepare_data.py "
                f"(python scripts/prepare_data.py TEXT --out {self.path.name})"
            )
        self.vocab_size: int | None = None
        if self.path.suffix == ".npy":
            try:
                self.tokens = np.load(self.path, mmap_mode="r")
            except (ValueError, OSError) as e:
                raise DataError(f"{self.path} is not a readable .npy file ({e})") from None
            if self.tokens.ndim != 1 or self.tokens.dtype.kind not in "iu":
                raise DataError(f"{self.path} must hold a 1-D array of integer token ids")
        else:
            regular_file(self.path, "data file")  # a FIFO or device would hang or never end
            with open(self.path, "rb") as f:
                raw = f.read(HEADER.size)
            if len(raw) < HEADER.size or raw[:8] != MAGIC:
                raise DataError(
                    f"{self.path} is not a token file (no {MAGIC.decode()} header): "
                    "write it with scripts/prepare_data.py, or pass a .npy array of token ids"
                )
            _, version, itemsize, vocab, count = HEADER.unpack(raw)
            if version != VERSION or itemsize not in (2, 4):
                raise DataError(f"{self.path}: token file version {version} / {itemsize}-byte tokens is not supported")
            dtype = np.uint16 if itemsize == 2 else np.uint32
            expected = HEADER.size + count * itemsize
            actual = self.path.stat().st_size
            if actual < expected:
                raise DataError(
                    f"{self.path} is truncated: the header promises {count} tokens ({expected} bytes), "
                    f"the file has {actual} bytes"
                )
            self.tokens = np.memmap(self.path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))
            self.vocab_size = int(vocab) or None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class DataState:
    """The position in the sample stream (what checkpoints store)."""

    consumed_samples: int = 0
    seed: int = 0
    seq_len: int = 0
    num_samples: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(
            consumed_samples=self.consumed_samples, seed=self.seed, seq_len=self.seq_len, num_samples=self.num_samples
        )


class Batches:
    """This data-parallel rank's micro-batches of each step, in the global order."""

    def __init__(
        self,
        file: TokenFile,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        dp: int,
        dp_rank: int,
        seed: int,
        vocab_size: int | None = None,
        shuffle: bool = True,
    ):
        if global_batch % (micro_batch * dp):
            raise DataError(f"--global-batch {global_batch} is not a multiple of --micro-batch {micro_batch} x dp {dp}")
        self.file = file
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp = dp
        self.dp_rank = dp_rank
        self.seed = seed
        self.vocab_size = vocab_size
        self.shuffle = shuffle
        self.num_samples = (len(file) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(f"{file.path} holds {len(file)} tokens: fewer than one sequence of --seq-len {seq_len} + 1")
        self.consumed_samples = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                if self.shuffle
                else np.arange(self.num_samples)
            )
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def sample(self, index: int) -> np.ndarray:
        """Global sample `index` of the stream: seq_len + 1 tokens."""
        epoch, pos = divmod(index, self.num_samples)
        start = int(self._order(epoch)[pos]) * self.seq_len
        return np.asarray(self.file.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def step_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the next step, each [micro-batches x micro_batch, seq_len],
        micro-batch k in rows [k * micro_batch, (k + 1) * micro_batch). Advances the position."""
        per_rank = self.global_batch // self.dp
        first = self.consumed_samples + self.dp_rank * per_rank
        rows = np.stack([self.sample(first + i) for i in range(per_rank)])
        self.consumed_samples += self.global_batch
        if rows.size and rows.min() < 0:
            raise DataError(
                f"{self.file.path} holds a negative token id ({int(rows.min())}): token ids count from 0; "
                "tokenize with scripts/prepare_data.py"
            )
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise DataError(
                f"{self.file.path} holds token id {int(rows.max())}, outside the model's vocabulary of "
                f"{self.vocab_size}: tokenize with the model's tokenizer"
            )
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def state(self) -> DataState:
        return DataState(self.consumed_samples, self.seed, self.seq_len, self.num_samples)

    def load_state(self, state: Mapping[str, Any], log=None) -> None:
        changed = [k for k in ("seed", "seq_len", "num_samples") if k in state and int(state[k]) != getattr(self, k)]
        if changed and log is not None:
            log.warning(
                "the data differs from the checkpoint's (%s): the position is kept, the order is not the same",
                ", ".join(f"{k} {state[k]} -> {getattr(self, k)}" for k in changed),
            )
        self.consumed_samples = int(state.get("consumed_samples", 0))


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def bits(nats: float) -> float:
    return nats / math.log(2)
