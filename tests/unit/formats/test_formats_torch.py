"""torch files written and read by shardkit: the streaming writer writes exactly what torch.save
writes (own zip writer, zip64 and changed torch left to torch, owned tensors hashed in file order),
positional reads of column blocks, the bytes a slice spans, and dtypes without a typed storage."""

from __future__ import annotations

import hashlib
import io
import os

import pytest
import torch
import xxhash

from shardkit import FormatError
from shardkit.formats.base import TensorSpec
from shardkit.formats.torch_io import TorchWriter
from shardkit.io.data.taps import OpenFile


@pytest.mark.parametrize("writer", ["native", "torch"])
def test_torch_writer_streams_exactly_what_torch_save_writes(writer, tmp_path, monkeypatch):
    """The streaming torch writer (one tensor in memory at a time) writes the very bytes of
    torch.save(state_dict), for every dtype family, 0-d, empty, repeated shapes and views, with
    shardkit's own zip writer (the default) and with torch's (used for archives of 4 GiB and more)."""
    import shardkit.formats.torch_io as tio

    if writer == "torch":
        monkeypatch.setattr(tio, "native_writer", lambda records, bound: False)
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(5, 3).to(torch.bfloat16),
        "b.same_shape": torch.randn(5, 3).to(torch.bfloat16),
        "c.fp32": torch.randn(7),
        "d.scalar": torch.tensor(3.0),
        "e.empty": torch.empty(0, 4),
        "f.fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),  # torch's v3 rebuild path
        "g.u16": torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16),
        "h.int": torch.arange(10),
        "i.bool": torch.tensor([True, False, True]),
        "j.view": torch.randn(6, 4)[2:4],
        "k.noncontiguous": torch.randn(4, 6).t(),
    }
    expected = io.BytesIO()
    torch.save({n: t.contiguous().clone() for n, t in tensors.items()}, expected)
    path = tmp_path / "model" / "rank.pt"
    writer_ = TorchWriter(
        path, tmp_path, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], digests="sha256"
    )
    assert (writer_._native is not None) == (writer == "native")
    for name, tensor in tensors.items():
        writer_.write(name, tensor)
    (record,) = writer_.close()
    raw = path.read_bytes()
    assert raw == expected.getvalue()
    assert record.path == "model/rank.pt"
    assert record.size == len(raw) and record.sha256 == hashlib.sha256(raw).hexdigest()
    with pytest.raises(RuntimeError, match="expected"):
        TorchWriter(tmp_path / "x.pt", tmp_path, [TensorSpec("a", (2,), torch.float32)]).write("b", torch.zeros(2))


@pytest.mark.parametrize("seed", range(4))
def test_own_zip_writer_matches_torch_save_on_random_state_dicts(seed, tmp_path):
    """shardkit's zip writer against torch.save on random state dicts: 1-300 tensors (record
    numbers of two and three digits, so every padding length), names of any length, sizes from
    empty to a few MiB, offsets past 1 MiB; plus the on-disk record reads back through torch."""
    from shardkit.formats import torch_zip

    assert torch_zip.native_matches(), "shardkit's zip writer no longer writes this torch's bytes"
    gen = torch.Generator().manual_seed(seed)
    count = [1, 7, 120, 300][seed]
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.int64, torch.bool]
    tensors = {}
    for i in range(count):
        name = "m." * int(torch.randint(0, 40, (1,), generator=gen)) + f"w{i}"
        numel = int(torch.randint(0, 3 if i % 5 == 0 else 70_000, (1,), generator=gen))
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        tensors[name] = (torch.randn(numel, generator=gen) * 50).to(dtype)
    expected = io.BytesIO()
    torch.save(tensors, expected)
    path = tmp_path / "rank.pt"
    writer = TorchWriter(path, tmp_path, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    assert writer._native is not None
    for name, tensor in tensors.items():
        writer.write(name, tensor, owned=bool(len(name) % 2))
    writer.close()
    assert path.read_bytes() == expected.getvalue()
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_own_zip_writer_leaves_zip64_archives_and_changed_torch_to_torch(tmp_path, monkeypatch):
    """Archives that reach 4 GiB or 65535 records need zip64 fields in every record: torch's
    writer writes those. So does a torch whose bytes differ from shardkit's writer's (simulated
    by one changed flag): the sample archive shows it, and the output is still torch.save's."""
    from shardkit.formats import torch_zip

    assert torch_zip.native_writer(10, (4 << 30) - 4096)
    assert not torch_zip.native_writer(10, 4 << 30)
    assert not torch_zip.native_writer(70_000, 1 << 20)
    torch_zip.clear_caches()
    monkeypatch.setattr(torch_zip, "_FLAGS", 0x0008)
    try:
        assert not torch_zip.native_matches()
        tensors = {"a": torch.randn(3, 5), "b": torch.arange(7)}
        path = tmp_path / "rank.pt"
        writer = TorchWriter(path, tmp_path, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
        assert writer._native is None
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.close()
        expected = io.BytesIO()
        torch.save(tensors, expected)
        assert path.read_bytes() == expected.getvalue()
    finally:
        monkeypatch.undo()
        torch_zip.clear_caches()


@pytest.mark.parametrize("chunk", [64, 1 << 30])
def test_positional_reads_of_column_blocks_in_row_chunks(chunk, tmp_path, monkeypatch):
    """Slices along dims > 0 are read in bounded blocks of rows: same result as slicing in memory."""
    import shardkit.io.data.strided as strided

    monkeypatch.setattr(strided, "STRIDED_READ_CHUNK", chunk)
    monkeypatch.setattr(strided, "MAP_WINDOW", chunk)  # 64: a mapping per row, at unaligned offsets
    torch.manual_seed(0)
    full = torch.randn(7, 5, 6)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"\0" * 24 + full.numpy().tobytes())
    stored = strided.StoredTensor(torch.float32, (7, 5, 6), file_offset=8, storage_offset=4)
    fd = os.open(path, os.O_RDONLY)
    try:
        for dim, start, stop in [(1, 1, 4), (2, 0, 3), (2, 5, 6), (0, 2, 5), (1, 0, 5)]:
            got = strided.read_stored(OpenFile(fd), stored, dim, start, stop, "raw.bin")
            assert torch.equal(got, full.narrow(dim, start, stop - start)), (dim, start, stop)
        # a tensor said to reach past the end of the file: a FormatError, never a fault (SIGBUS)
        past_end = strided.StoredTensor(torch.float32, (8, 5, 6), file_offset=8, storage_offset=4)
        with pytest.raises(FormatError, match="truncated"):
            strided.read_stored(OpenFile(fd), past_end, 2, 1, 3, "raw.bin")
    finally:
        os.close(fd)


def test_a_whole_tensor_read_along_a_later_dim_is_one_positional_read(tmp_path, monkeypatch):
    """A "slice" along dim 1 that spans the whole dim is the whole tensor: one contiguous read
    (which the hash check on read can hash), not a strided copy out of a mapping."""
    import shardkit.io.data.strided as strided

    monkeypatch.setattr(strided, "STRIDED_READ_CHUNK", 64)
    monkeypatch.setattr(strided, "_copy_columns", lambda *a: pytest.fail("copied out of a mapping"))
    full = torch.randn(7, 5, 6)
    path = tmp_path / "raw.bin"
    path.write_bytes(full.numpy().tobytes())
    reads: list[tuple[int, int]] = []
    real_pread = strided.pread_exact
    monkeypatch.setattr(
        strided,
        "pread_exact",
        lambda file, view, offset, what: (reads.append((offset, len(view))), real_pread(file, view, offset, what))[1],
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        got = strided.read_stored(OpenFile(fd), strided.StoredTensor(torch.float32, (7, 5, 6), 0), 1, 0, 5, "raw.bin")
    finally:
        os.close(fd)
    assert torch.equal(got, full) and reads == [(0, full.numel() * 4)]


def test_advise_names_the_bytes_a_slice_spans(tmp_path, monkeypatch):
    """The read-ahead hint of a slice covers exactly the bytes read_stored reads for it."""
    import shardkit.io.data.strided as strided

    stored = strided.StoredTensor(torch.float32, (7, 5, 6), file_offset=8, storage_offset=4)
    hints, reads = [], []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: hints.append((offset, length)))
    path = tmp_path / "raw.bin"
    path.write_bytes(bytes(8 + 4 * (4 + 7 * 5 * 6)))
    real_pread = strided.pread_exact
    monkeypatch.setattr(
        strided,
        "pread_exact",
        lambda file, view, offset, what: (reads.append((offset, len(view))), real_pread(file, view, offset, what))[1],
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        for dim, start, stop in [(0, 2, 5), (1, 1, 4), (2, 3, 6), (0, None, None)]:
            hints.clear(), reads.clear()
            strided.advise_stored(fd, stored, dim, start, stop)
            strided.read_stored(OpenFile(fd), stored, dim, start, stop, "raw.bin")
            assert hints == reads, (dim, start, stop)
        hints.clear()
        strided.advise_stored(fd, stored, 1, 2, 2)  # empty: nothing to read, no hint
        assert hints == []
    finally:
        os.close(fd)


def test_owned_writes_are_hashed_in_file_order(tmp_path, monkeypatch):
    """Blocks written with write_owned are hashed behind the writes (by the helper thread or the
    writer), small writes between them follow them: the digest is the file's whatever the order
    the threads ran in, also when the window of unhashed bytes forces waits."""
    import shardkit.io.data.hashing as hashing
    from shardkit.formats.base import tensor_bytes

    monkeypatch.setattr(hashing, "HASH_BEHIND", 3 << 20)
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for i in range(12):
        size = (1 << 20) + 4096 * i if i % 3 else 100 + i  # large (behind) and small (copied) blocks
        blocks.append(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
    out = hashing.HashingFile(tmp_path / "f.bin", tmp_path, digests="sha256")
    for i, block in enumerate(blocks):
        view = tensor_bytes(block)
        out.write_owned(view, view) if i % 2 else out.write(view)
    del blocks[:6]  # the caller lets go: the pending blocks keep their own bytes alive
    record = out.close()
    raw = (tmp_path / "f.bin").read_bytes()
    assert record.size == len(raw) and record.sha256 == hashlib.sha256(raw).hexdigest()
    assert record.xxh3_128 == xxhash.xxh3_128_hexdigest(raw)


def test_torch_writer_owned_tensors_write_and_hash_the_same_bytes(tmp_path):
    """write(owned=True) (the engine's path: the record's bytes hashed behind the write) gives the
    bytes and sha256 of torch.save, for records large enough to go to the helper thread."""
    gen = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(700 + 100 * i, 512, generator=gen).to(torch.bfloat16) for i in range(5)}
    tensors["small"] = torch.randn(3, generator=gen)
    expected = io.BytesIO()
    torch.save({n: t.clone() for n, t in tensors.items()}, expected)
    path = tmp_path / "rank.pt"
    writer = TorchWriter(
        path, tmp_path, [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], digests="sha256"
    )
    for name in list(tensors):
        writer.write(name, tensors.pop(name), owned=True)  # the writer holds the only reference
    (record,) = writer.close()
    raw = path.read_bytes()
    assert raw == expected.getvalue()
    assert record.sha256 == hashlib.sha256(raw).hexdigest() and record.xxh3_128 == xxhash.xxh3_128_hexdigest(raw)


def test_torch_files_with_dtypes_that_have_no_typed_storage_read_back(tmp_path):
    """float8 and uint16 tensors are saved with an UntypedStorage (numel in bytes): reading their
    metadata and slices must work (FP8 checkpoints are real), and the streaming writer must write
    exactly what torch.save writes for them."""
    from shardkit.formats.torch_io import TorchFile, TorchWriter

    torch.manual_seed(0)
    tensors = {
        "f8": torch.randn(6, 4).to(torch.float8_e4m3fn),
        "f8b": torch.randn(3).to(torch.float8_e5m2),
        "u16": torch.arange(10, dtype=torch.int32).to(torch.uint16).reshape(2, 5),
        "f32": torch.randn(2, 3),
    }
    with open(tmp_path / "ref.pt", "wb") as fh:  # through a file object, as the streaming writer writes
        torch.save(tensors, fh)
    reader = TorchFile(tmp_path / "ref.pt")
    try:
        for name, t in tensors.items():
            assert reader.dtype(name) == t.dtype and reader.shape(name) == tuple(t.shape)
            assert torch.equal(reader.read(name).view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(reader.read("f8", 0, 2, 5).view(torch.uint8), tensors["f8"][2:5].view(torch.uint8))
    finally:
        reader.close()
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = TorchWriter(tmp_path / "streamed.pt", tmp_path, specs)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    assert (tmp_path / "streamed.pt").read_bytes() == (tmp_path / "ref.pt").read_bytes()
