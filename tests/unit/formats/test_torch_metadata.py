"""A torch file's metadata (names, dtypes, shapes, strides, where the bytes are) is read by
Python's C unpickler with an inert stand-in for every global a plain state dict names
(`torch_io._PlainUnpickler`, ~4x faster), and by torch's weights-only unpickler for anything else.
Both give the same StoredTensors, the same errors, and a hostile pickle reaches nothing callable."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from shardkit import torch_compat
from shardkit.errors import FormatError
from shardkit.formats import torch_metadata
from shardkit.formats.torch_metadata import load_metadata

GOLDEN = Path(__file__).resolve().parents[4] / "shared" / "golden"


def _by_torch(path: Path, monkeypatch) -> object:
    with monkeypatch.context() as m:
        m.setattr(torch_metadata, "_plain_metadata", lambda *args: None)
        return load_metadata(path)


@pytest.fixture
def torch_unpickler_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch_compat.weights_only_unpickler

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_compat, "weights_only_unpickler", counting)
    return calls


def _every_kind() -> dict:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    return {
        "bf16": torch.ones(3, 4, dtype=torch.bfloat16),
        "shared": base,
        "view": base[2:4, 1:7],  # a storage offset and a row stride of another tensor
        "transposed": base.t(),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "uint16": torch.zeros(5, dtype=torch.uint16),  # no typed storage: _rebuild_tensor_v3
        "float8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.0),
        "long": torch.arange(4),
    }


def test_plain_files_read_as_torch_reads_them_without_its_unpickler(tmp_path, monkeypatch, torch_unpickler_calls):
    path = tmp_path / "plain.pt"
    torch.save({"model": _every_kind(), "epoch": 3, "names": ["a", "b"], "pair": (1, 2.5), "none": None}, path)
    fast = load_metadata(path)
    assert torch_unpickler_calls == []  # read by the plain unpickler
    assert fast == _by_torch(path, monkeypatch)
    assert torch_unpickler_calls == [1]
    model = fast["model"]
    assert model["view"].storage_offset == 21 and model["view"].stride == (10, 1)
    assert model["uint16"].dtype == torch.uint16 and model["float8"].dtype == torch.float8_e4m3fn


def test_golden_nxd_files_read_the_same_both_ways(monkeypatch):
    files = sorted(p for part in ("nxd", "nxd-train") for p in (GOLDEN / part).rglob("*.pt"))
    if not files:
        pytest.skip(f"no NxD reference files under {GOLDEN} (a user's clone)")
    for path in files:
        assert repr(load_metadata(path)) == repr(_by_torch(path, monkeypatch)), path


def test_anything_more_than_tensors_and_containers_goes_to_torchs_unpickler(tmp_path, torch_unpickler_calls):
    path = tmp_path / "sized.pt"
    torch.save({"w": torch.ones(2, 3), "shape": torch.Size([2, 3])}, path)
    meta = load_metadata(path)
    assert torch_unpickler_calls == [1]
    assert meta["shape"] == torch.Size([2, 3]) and meta["w"].shape == (2, 3)


def _with_pickle(path: Path, raw: bytes) -> None:
    """Replace the data.pkl of a torch file with `raw` (the zip rewritten, stored)."""
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(name, raw if name.endswith("data.pkl") else data)


class _CallStorage:
    """Pickles as a call of torch.FloatStorage(2**40): a terabyte, were it ever called."""

    def __reduce__(self):
        return (torch.FloatStorage, (1 << 40,))


def test_a_pickle_that_calls_a_stand_in_calls_nothing(tmp_path):
    path = tmp_path / "calls.pt"
    torch.save({"w": torch.ones(2)}, path)
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=2).dump({"w": _CallStorage()})
    _with_pickle(path, buffer.getvalue())
    with pytest.raises(FormatError) as info:
        torch_metadata.read_metadata(path)
    assert "\n" not in str(info.value)


def test_a_tensor_past_its_storage_or_its_record_is_refused_as_before(tmp_path, monkeypatch):
    path = tmp_path / "past.pt"
    torch.save({"w": torch.ones(4, 4)}, path)
    with zipfile.ZipFile(path) as archive:
        raw = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    # the shape (4, 4) pickled as BININT1 4, BININT1 4: make it (4, 5), one row past the storage
    bad = raw.replace(b"K\x04K\x04\x86", b"K\x04K\x05\x86", 1)
    assert bad != raw
    _with_pickle(path, bad)
    with pytest.raises(FormatError, match="cut short") as fast:
        torch_metadata.read_metadata(path)
    with pytest.raises(FormatError) as slow:
        _by_torch(path, monkeypatch)
    assert str(fast.value) == str(slow.value)

    cut = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(64, 64)}, cut)
    data = cut.read_bytes()
    with zipfile.ZipFile(cut) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
        records = {i.filename: archive.read(i) for i in archive.infolist()}
    records[info.filename] = records[info.filename][:100]  # the record cut short, the zip whole
    with zipfile.ZipFile(cut, "w", zipfile.ZIP_STORED) as archive:
        for name, payload in records.items():
            archive.writestr(name, payload)
    assert len(cut.read_bytes()) < len(data)
    with pytest.raises(FormatError, match="cut short") as fast:
        load_metadata(cut)
    with pytest.raises(FormatError, match="cut short") as slow:
        _by_torch(cut, monkeypatch)
    assert str(fast.value) == str(slow.value)


def test_payloads_never_run(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch '{marker}'",))

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2)}, path)
    buffer = io.BytesIO()
    pickle.Pickler(buffer, protocol=2).dump({"w": Payload()})
    _with_pickle(path, buffer.getvalue())
    with pytest.raises(FormatError, match="refusing"):
        torch_metadata.read_metadata(path)
    assert not marker.exists()


_MARK = object()


class _Moved:
    """Pickles as a tensor rebuilt from record 0, then (BUILD) its fields changed: its file offset
    to 0 (the archive's first header) and its shape past its record."""

    def __reduce__(self):
        hooks = __import__("collections").OrderedDict()
        return (
            torch._utils._rebuild_tensor_v2,
            (_MARK, 0, (4,), (1,), False, hooks),
            {"file_offset": 0, "shape": (1 << 20,)},
        )


def test_fields_changed_after_a_tensor_is_built_are_never_trusted(tmp_path, monkeypatch):
    """A pickle may change an object after building it (BUILD): the plain reader checks the
    tensors it returns, not only the arguments they were built from."""
    path = tmp_path / "moved.pt"
    torch.save({"w": torch.ones(4)}, path)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.persistent_id = lambda obj: ("storage", torch.FloatStorage, "0", "cpu", 4) if obj is _MARK else None
    pickler.dump({"w": _Moved()})
    _with_pickle(path, buffer.getvalue())
    try:
        meta = torch_metadata.read_metadata(path)
    except FormatError as e:
        assert "\n" not in str(e)
        return
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
    w = meta["w"]
    assert w.file_offset > info.header_offset and w.shape == (4,)  # the record's own bytes, as built
