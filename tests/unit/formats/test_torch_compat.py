"""The private torch internals shardkit relies on (shardkit/torch_compat.py): the normal path on the
running torch, and, for each internal moved away or changed as a future torch might, a one-line
ShardkitError naming it at first use (never an AttributeError or a file torch.save would not write).
Also: the package imports without torch-xla and neuronx-distributed."""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit import ShardkitError, torch_compat
from shardkit.formats import torch_zip
from shardkit.formats.base import TensorSpec
from shardkit.formats.torch_io import TorchWriter, state_dict_pickle
from shardkit.formats.torch_metadata import load_metadata
from shardkit.formats.xser import _PICKLE_MODULE
from shardkit.torch_compat import TorchInternalsError

ROOT = Path(__file__).resolve().parents[3]
SPECS = [TensorSpec("a", (2, 3), torch.float32), TensorSpec("b", (4,), torch.uint16)]


def clear_error(name: str) -> re.Pattern:
    lo, hi = torch_compat.TESTED_TORCH
    return re.compile(
        rf"^torch {re.escape(torch_compat.torch_version())} changed an internal shardkit relies on "
        rf"\({re.escape(name)}\): install torch {re.escape(lo)}–{re.escape(hi)} \(tested\) or report this$"
    )


def assert_clear(excinfo, name: str) -> None:
    err = excinfo.value
    assert isinstance(err, TorchInternalsError) and isinstance(err, ShardkitError)
    assert clear_error(name).match(str(err)), str(err)
    assert "\n" not in str(err)


@pytest.fixture(autouse=True)
def fresh_checks():
    torch_compat.clear_caches()
    torch_zip.clear_caches()
    yield
    torch_compat.clear_caches()
    torch_zip.clear_caches()


def tensors():
    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.arange(4, dtype=torch.int32).to(torch.uint16),
    }


def write_torch_file(path: Path) -> Path:
    writer = TorchWriter(path, path.parent, SPECS)
    for name, tensor in tensors().items():
        writer.write(name, tensor)
    writer.close()
    return path


# --- the normal path, on the running torch ---------------------------------------------------------


def test_tested_range_is_pyprojects_floor_and_cis():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={torch_compat.TESTED_TORCH[0]}"' in text
    ci = (ROOT / ".ci" / "run").read_text()  # CI runs the format tests on both ends of the range
    assert all(f'"torch=={v}.0"' in ci for v in torch_compat.TESTED_TORCH)
    assert re.fullmatch(r"\d+\.\d+", torch_compat.torch_version())


def test_normal_path_writes_what_torch_save_writes(tmp_path):
    path = write_torch_file(tmp_path / "rank.pt")
    expected = io.BytesIO()
    torch.save(tensors(), expected)
    assert path.read_bytes() == expected.getvalue()
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors().items())
    torch.save({"a": tensors()["a"]}, tmp_path / "float.pt")
    meta = load_metadata(tmp_path / "float.pt")
    assert {k: (v.dtype, v.shape) for k, v in meta.items()} == {"a": (torch.float32, (2, 3))}


def test_normal_path_accessors():
    assert torch_compat.rebuild_tensor_v2() is torch._utils._rebuild_tensor_v2
    assert torch_compat.rebuild_tensor_v3() is torch._utils._rebuild_tensor_v3
    assert torch.uint16 in torch_compat.new_dtypes() and torch.float32 not in torch_compat.new_dtypes()
    assert torch_compat.storage_type(torch.float32) is torch.FloatStorage
    assert torch_compat.PurePickler is pickle._Pickler
    writer, alignment = torch_compat.file_writer(io.BytesIO())
    assert isinstance(writer, torch._C.PyTorchFileWriter) and alignment == torch.serialization._get_storage_alignment()


# --- each internal moved away or changed -------------------------------------------------------------


def _rebuild(storage, storage_offset, size):  # a changed signature
    raise AssertionError("never called")


@pytest.mark.parametrize("attr", ["_rebuild_tensor_v2", "_rebuild_tensor_v3"])
@pytest.mark.parametrize("how", ["moved", "changed"])
def test_rebuild_tensor(monkeypatch, attr, how):
    if how == "moved":
        monkeypatch.delattr(torch._utils, attr)
    else:
        monkeypatch.setattr(torch._utils, attr, _rebuild)
    with pytest.raises(TorchInternalsError) as excinfo:
        state_dict_pickle(SPECS)  # pickles a float32 (v2) and a uint16 (v3) tensor
    assert_clear(excinfo, f"torch._utils.{attr}")


@pytest.mark.parametrize(
    "attr,how",
    [
        ("_new_dtypes", "moved"),
        ("_new_dtypes", "changed"),
        ("_dtype_to_storage_type_map", "moved"),
        ("_dtype_to_storage_type_map", "changed"),
    ],
)
def test_storage_tables(monkeypatch, attr, how):
    if how == "moved":
        monkeypatch.delattr(torch.storage, attr)
    elif attr == "_new_dtypes":
        monkeypatch.setattr(torch.storage, attr, lambda: {"uint16"})  # names instead of dtypes
    else:
        monkeypatch.setattr(torch.storage, attr, lambda: {torch.float32: "NoSuchStorage"})
    with pytest.raises(TorchInternalsError) as excinfo:
        state_dict_pickle(SPECS)
    assert_clear(excinfo, f"torch.storage.{attr}")


@pytest.mark.parametrize("how", ["moved", "changed"])
def test_weights_only_unpickler(monkeypatch, tmp_path, how):
    """Read for files holding more than plain tensors (a plain state dict never reaches it)."""
    path = tmp_path / "rank.pt"
    torch.save({"w": torch.ones(2), "shape": torch.Size([2])}, path)
    import torch._weights_only_unpickler as wou

    if how == "moved":
        monkeypatch.delattr(wou, "Unpickler")
    else:

        class Unpickler:  # lost the encoding keyword
            def __init__(self, file):
                pass

        monkeypatch.setattr(wou, "Unpickler", Unpickler)
    with pytest.raises(TorchInternalsError) as excinfo:
        load_metadata(path)
    assert_clear(excinfo, "torch._weights_only_unpickler.Unpickler")


@pytest.mark.parametrize(
    "module,attr,name",
    [
        (torch._C, "PyTorchFileWriter", "torch._C.PyTorchFileWriter"),
        (torch.serialization, "get_crc32_options", "torch.serialization.get_crc32_options"),
        (torch.serialization, "_get_storage_alignment", "torch.serialization._get_storage_alignment"),
    ],
)
def test_file_writer_moved(monkeypatch, tmp_path, module, attr, name):
    monkeypatch.delattr(module, attr)
    with pytest.raises(TorchInternalsError) as excinfo:
        TorchWriter(tmp_path / "rank.pt", tmp_path, SPECS)
    assert_clear(excinfo, name)


def test_file_writer_changed(monkeypatch, tmp_path):
    class PyTorchFileWriter:  # takes the stream alone, as torch before 2.5 did
        def __init__(self, out):
            pass

    monkeypatch.setattr(torch._C, "PyTorchFileWriter", PyTorchFileWriter)
    with pytest.raises(TorchInternalsError) as excinfo:
        TorchWriter(tmp_path / "rank.pt", tmp_path, SPECS)
    assert_clear(excinfo, "torch._C.PyTorchFileWriter")

    monkeypatch.undo()
    monkeypatch.setattr(torch.serialization, "_get_storage_alignment", lambda: "64")
    with pytest.raises(TorchInternalsError) as excinfo:
        TorchWriter(tmp_path / "rank2.pt", tmp_path, SPECS)
    assert_clear(excinfo, "torch.serialization.get_crc32_options/_get_storage_alignment")


def test_pure_pickler_moved(monkeypatch):
    monkeypatch.delattr(pickle, "_Pickler")
    missing = torch_compat._pure_pickler()

    class Sub(missing):  # as xser's reference pickler subclasses it at import
        pass

    with pytest.raises(TorchInternalsError, match=r"changed an internal shardkit relies on \(pickle\._Pickler\)"):
        Sub(io.BytesIO(), protocol=2)


def test_xser_pickler_is_pure_python():
    buf = io.BytesIO()
    _PICKLE_MODULE.Pickler(buf, protocol=2).dump({"x": 1})
    assert pickle.loads(buf.getvalue()) == {"x": 1}


# --- optional stacks ---------------------------------------------------------------------------------


def test_imports_without_torch_xla_and_neuronx_distributed():
    """Every shardkit module imports, and the CLI answers, with torch-xla and neuronx-distributed
    unimportable (None in sys.modules makes `import` raise ImportError)."""
    code = """
import importlib, pkgutil, sys
for name in ("torch_xla", "torch_neuronx", "neuronx_distributed", "libneuronxla"):
    sys.modules[name] = None
import shardkit
for mod in pkgutil.walk_packages(shardkit.__path__, "shardkit."):
    if mod.name != "shardkit.__main__":
        importlib.import_module(mod.name)
from click.testing import CliRunner
from shardkit.cli import cli
result = CliRunner().invoke(cli, ["--help"])
assert result.exit_code == 0, result.output
assert not any(n.split(".")[0] in ("torch_xla", "neuronx_distributed") for n, m in sys.modules.items() if m is not None)
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
