"""Pre-tokenized data: a memory-mapped token file, a deterministic sample order, dp slicing and
a position that checkpoints carry, so a resumed run sees exactly the data it would have seen.

Token file format (`.bin`, written by `write_tokens` / scripts/prepare_data.py / the trainer's
token cache, trainer/tokenize.py): a 32-byte little-endian header, then the tokens:

| bytes | field |
| --- | --- |
| 0-7 | magic `SKTOKENS` |
| 8-11 | format version: 1, or 2 when a loss mask follows the tokens |
| 12-15 | bytes per token: 2 (uint16) or 4 (uint32) |
| 16-23 | vocabulary size the ids come from (0: unknown) |
| 24-31 | number of tokens N |

then N ids, then (version 2 only) the loss mask: N bytes, 1 where the token is trained on as a
target (a completion's tokens and its end-of-sequence id), 0 where it is not (a prompt's). A
sample's target at position j is token start + j + 1, so its mask byte is mask[start + j + 1];
a masked target is given as -100 (`IGNORE`), and the step's loss is the sum of the token losses
over every unmasked target of the global batch divided by their count (`Batches.unmasked`), the
same in every layout. Without a mask every target counts (version 1).

A NumPy `.npy` file of unsigned or signed integers is read too (vocabulary unknown, no mask).

Samples are non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets share
seq_len of them): sample i starts at token i * seq_len. Epoch e visits every sample once, in the
order of a permutation seeded with (seed, e). The run consumes the global sample stream in order:
step s takes samples [s * G, (s + 1) * G) of it (G = global batch); data-parallel rank d takes the
d-th contiguous 1/dp of those, cut into micro-batches. The position is the number of samples
consumed, which does not depend on the layout: resuming with another tp/pp/dp continues exactly.
The data's identity (`TokenFile.identity`: the token cache's key for a text source, else a digest
of the token file's size and sampled contents) is saved with the position; a resume on data
whose identity, length or order differs says so.

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
import xxhash

from shardkit.io.safety.transaction import write_file
from shardkit.paths import regular_file

from .errors import DataError

MAGIC = b"SKTOKENS"
HEADER = struct.Struct("<8sIIQQ")
VERSION = 1
MASKED_VERSION = 2
IGNORE = -100
"""A masked target (torch's cross-entropy ignore_index): no loss, no gradient."""
SAMPLED_BLOCKS = 64
SAMPLED_BYTES = 4096


def token_dtype(vocab_size: int) -> np.dtype:
    """The id type of a token file for `vocab_size`: uint16 when it fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def header(count: int, vocab_size: int, masked: bool = False) -> bytes:
    """The 32-byte header of a token file of `count` ids (`masked`: a loss mask follows them)."""
    version = MASKED_VERSION if masked else VERSION
    return HEADER.pack(MAGIC, version, token_dtype(vocab_size).itemsize, vocab_size, count)


def write_tokens(path: str | Path, tokens, vocab_size: int, mask=None) -> Path:
    """Write token ids (and, for instruction data, their 0/1 loss mask) as a token file."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise DataError(f"token ids must lie in [0, {vocab_size}); got {array.min()}..{array.max()}")
    chunks = [
        header(array.size, vocab_size, mask is not None),
        array.astype(token_dtype(vocab_size), copy=False).tobytes(),
    ]
    if mask is not None:
        flags = np.asarray(mask)
        if flags.shape != array.shape:
            raise DataError(f"the loss mask has {flags.size} entries for {array.size} tokens")
        chunks.append((flags != 0).astype(np.uint8).tobytes())
    path = Path(path)
    write_file(path, chunks, what="token file")
    return path


class TokenFile:
    """A memory-mapped token file (.bin with the header above, or .npy): `tokens`, `mask` (None
    without one), `vocab_size` (None: unknown) and `identity` (what a resume compares)."""

    def __init__(self, path: str | Path, identity: str | None = None, shown: str | None = None):
        self.path = Path(path)
        self.shown = shown or str(self.path)  # how messages name it (an s3:// URL, the text it came from)
        if not self.path.is_file():
            raise DataError(
                f"data file {self.path} does not exist: give a token file, or text as .txt, .jsonl, .csv, "
                f".parquet or a datasets save_to_disk folder (python scripts/prepare_data.py TEXT --out "
                f"{self.path.name} writes a token file)"
            )
        self.vocab_size: int | None = None
        self.mask: np.ndarray | None = None
        if self.path.suffix == ".npy":
            try:
                self.tokens = np.load(self.path, mmap_mode="r")
            except (ValueError, OSError) as e:
                raise DataError(f"{self.path} is not a readable .npy file ({e})") from None
            if self.tokens.ndim != 1 or self.tokens.dtype.kind not in "iu":
                raise DataError(f"{self.path} must hold a 1-D array of integer token ids")
        else:
            self._map()
        self.identity = identity or self._sampled_digest()

    def _map(self) -> None:
        regular_file(self.path, "data file")  # a FIFO or device would hang or never end
        with open(self.path, "rb") as f:
            raw = f.read(HEADER.size)
        if len(raw) < HEADER.size or raw[:8] != MAGIC:
            raise DataError(
                f"{self.path} is not a token file (no {MAGIC.decode()} header): give text as .txt, .jsonl, .csv, "
                ".parquet or a datasets folder, write a token file with scripts/prepare_data.py, or pass a .npy "
                "array of token ids"
            )
        _, version, itemsize, vocab, count = HEADER.unpack(raw)
        if version not in (VERSION, MASKED_VERSION) or itemsize not in (2, 4):
            raise DataError(f"{self.path}: token file version {version} / {itemsize}-byte tokens is not supported")
        dtype = np.uint16 if itemsize == 2 else np.uint32
        masked = version == MASKED_VERSION
        expected = HEADER.size + count * itemsize + (count if masked else 0)
        actual = self.path.stat().st_size
        if actual < expected:
            raise DataError(
                f"{self.path} is truncated: the header promises {count} tokens{' and their mask' if masked else ''} "
                f"({expected} bytes), the file has {actual} bytes"
            )
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))
        if masked:
            offset = HEADER.size + count * itemsize
            self.mask = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(count,))
        self.vocab_size = int(vocab) or None

    def _sampled_digest(self) -> str:
        """A digest of the ids' type and count and of SAMPLED_BLOCKS blocks spread over them (and
        the mask): cheap for any size, and different for nearly any other token file."""
        digest = xxhash.xxh3_128()
        digest.update(f"{self.tokens.dtype.str}/{len(self)}/{self.mask is not None}".encode())
        for array in (self.tokens, self.mask) if self.mask is not None else (self.tokens,):
            per_block = max(1, SAMPLED_BYTES // array.dtype.itemsize)
            for start in np.linspace(0, max(0, len(array) - per_block), SAMPLED_BLOCKS, dtype=np.int64):
                digest.update(np.ascontiguousarray(array[int(start) : int(start) + per_block]).tobytes())
        return digest.hexdigest()

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class DataState:
    """The position in the sample stream (what checkpoints store), and what it is a position in."""

    consumed_samples: int = 0
    seed: int = 0
    seq_len: int = 0
    num_samples: int = 0
    source: str = ""  # the data's identity (TokenFile.identity)

    def to_dict(self) -> dict[str, Any]:
        return dict(
            consumed_samples=self.consumed_samples,
            seed=self.seed,
            seq_len=self.seq_len,
            num_samples=self.num_samples,
            source=self.source,
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
            raise DataError(
                f"{file.shown} holds {len(file)} tokens: fewer than one sequence of --seq-len {seq_len} + 1"
            )
        self.consumed_samples = 0
        self.unmasked: int | None = None
        """With a loss mask: the unmasked targets of the last step's whole global batch (every rank's)."""
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

    def _start(self, index: int) -> int:
        epoch, pos = divmod(index, self.num_samples)
        return int(self._order(epoch)[pos]) * self.seq_len

    def sample(self, index: int) -> np.ndarray:
        """Global sample `index` of the stream: seq_len + 1 tokens."""
        start = self._start(index)
        return np.asarray(self.file.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def target_mask(self, index: int) -> np.ndarray:
        """Global sample `index`'s target mask (seq_len bools; the file must have a mask)."""
        assert self.file.mask is not None
        start = self._start(index)
        return np.asarray(self.file.mask[start + 1 : start + self.seq_len + 1]) != 0

    def step_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the next step, each [micro-batches x micro_batch, seq_len],
        micro-batch k in rows [k * micro_batch, (k + 1) * micro_batch); masked targets are IGNORE
        and `unmasked` counts the global batch's others. Advances the position."""
        per_rank = self.global_batch // self.dp
        first = self.consumed_samples + self.dp_rank * per_rank
        rows = np.stack([self.sample(first + i) for i in range(per_rank)])
        if self.file.mask is not None:
            mine = np.stack([self.target_mask(first + i) for i in range(per_rank)])
            self.unmasked = sum(
                int(self.target_mask(self.consumed_samples + i).sum()) for i in range(self.global_batch)
            )
        self.consumed_samples += self.global_batch
        if rows.size and rows.min() < 0:
            raise DataError(
                f"{self.file.shown} holds a negative token id ({int(rows.min())}): token ids count from 0; "
                "tokenize with scripts/prepare_data.py"
            )
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise DataError(
                f"{self.file.shown} holds token id {int(rows.max())}, outside the model's vocabulary of "
                f"{self.vocab_size}: tokenize with the model's tokenizer"
            )
        data = torch.from_numpy(rows)
        targets = data[:, 1:].contiguous()
        if self.file.mask is not None:
            targets[~torch.from_numpy(mine)] = IGNORE
        return data[:, :-1].contiguous(), targets

    def state(self) -> DataState:
        return DataState(self.consumed_samples, self.seed, self.seq_len, self.num_samples, self.file.identity)

    def load_state(self, state: Mapping[str, Any], log=None) -> None:
        changed = [k for k in ("seed", "seq_len", "num_samples") if k in state and int(state[k]) != getattr(self, k)]
        notes = [f"{k} {state[k]} -> {getattr(self, k)}" for k in changed]
        saved = state.get("source")
        if isinstance(saved, str) and saved and saved != self.file.identity:
            notes.insert(0, f"{self.file.shown} is not the data the checkpoint was trained on: its contents changed")
        if notes and log is not None:
            log.warning(
                "the data differs from the checkpoint's (%s): the position is kept, but the samples from here on "
                "are not those the checkpoint's run would have trained on",
                ", ".join(notes),
            )
        self.consumed_samples = int(state.get("consumed_samples", 0))


class TargetWeight:
    """The loss of masked data: the sum of the token losses over the unmasked targets of a global
    batch, times 1 / their count (`Batches.unmasked`), given to the device as data each step (a
    lazy backend's graph stays the same). Without a mask (`value` None) the loss is the mean."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def set(self, batches: Batches, to_device) -> None:
        """Take the count of `batches`' last step (`to_device`: the Comm's upload of host tensors)."""
        if batches.unmasked is None:
            self.value = None
            return
        weight = torch.tensor(1.0 / max(1, batches.unmasked), dtype=torch.float32)
        self.value = to_device([weight])[0]

    def loss(self, per_token: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step's loss (`targets` holding IGNORE where masked)."""
        assert self.value is not None  # `set` took a masked step
        kept = torch.where(targets != IGNORE, per_token, torch.zeros_like(per_token))
        return kept.sum() * self.value


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def bits(nats: float) -> float:
    return nats / math.log(2)
