"""On-disk formats: xser as torch-xla writes and reads it (checked against a fake of torch-xla's
public loader and against real torch-xla output), reading inline and referenced xser tensors,
never running arbitrary pickle, the streaming safetensors writer, manifest checksums, and clean
failures on truncated files."""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import io
import json
import os
import pickletools
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import golden_or_skip
from safetensors.torch import load_file

from shardkit import FormatError, Layout, convert, merge, open_checkpoint
from shardkit.formats.base import TensorSpec
from shardkit.formats.safetensors_io import SafetensorsWriter
from shardkit.formats.torch_io import TorchWriter
from shardkit.formats.xser import XserFile
from shardkit.formats.xser import load as shardkit_xser_load

MODEL = "llama-gqa64"
LAYOUT = Layout(tp=2, pp=2, qkv="gqa")
REFERENCE_GLOBAL = "torch_xla.utils.serialization TensorReference"
RANK_FILE = re.compile(r"^dp_rank_\d+_(ep_rank_\d+_)?tp_rank_\d+_pp_rank_\d+\.(pt|safetensors)$")
GOLDEN_XSER_CASE = "gqa-tp8-pp2-qkvlinear"


# ---- a fake torch_xla.utils.serialization ----------------------------------------------------------
# It follows torch-xla's public implementation (torch_xla/utils/serialization.py): the class
# TensorReference with one field `tid`; save() rewrites device tensors into references, each
# tensor torch.save'd alone at <path>.tensors/tensor_<tid>.pt, then torch.save(ref_data, path);
# load() torch.loads the reference structure with full pickle and replaces each TensorReference
# by torch.load(<path>.tensors/tensor_<tid>.pt). torch-xla's ToXlaTensorArena collects the
# selected objects, converts them in one batch and rewrites the structure; _Arena does the same.
# The only invention is `to_device`, which stands in for moving a tensor to an XLA device (torch-xla
# only rewrites device tensors; CPU tensors stay inline in the .pt).

FAKE_SERIALIZATION = '''
import os
import shutil

import torch


class TensorReference(object):

  def __init__(self, tid):
    self.tid = tid


def _get_tensors_folder(path):
  return path + '.tensors'


def _get_tensor_file(path, tid):
  return os.path.join(path, 'tensor_{}.pt'.format(tid))


def to_device(tensor):
  """Stand-in for tensor.to(xm.xla_device()): marks the tensor as living on the device."""
  tensor = tensor.detach().clone()
  tensor._fake_xla_device = True
  return tensor


def _is_xla_tensor(v):
  return getattr(v, '_fake_xla_device', False)


class _Arena(object):
  """torch-xla's ToXlaTensorArena: collect selected objects, convert them at once, rewrite."""

  def __init__(self, convert_fn, select_fn):
    self._convert_fn = convert_fn
    self._select_fn = select_fn

  def _collect(self, value, found):
    if self._select_fn(value):
      if all(v is not value for v in found):
        found.append(value)
    elif isinstance(value, dict):
      for k, v in value.items():
        self._collect(k, found)
        self._collect(v, found)
    elif isinstance(value, (list, tuple, set)):
      for v in value:
        self._collect(v, found)

  def _rewrite(self, value, converted):
    if self._select_fn(value):
      return converted[id(value)]
    if isinstance(value, dict):
      result = value.__class__()
      for k, v in value.items():
        result[k] = self._rewrite(v, converted)
      return result
    if isinstance(value, (list, tuple, set)):
      return value.__class__(self._rewrite(v, converted) for v in value)
    return value

  def transform(self, data):
    found = []
    self._collect(data, found)
    converted = dict(zip([id(v) for v in found], self._convert_fn(found)))
    return self._rewrite(data, converted)


def _rewrite_data(path, data, save_tensors):

  def convert_fn(tensors):
    rewritten_tensors = []
    for i, t in enumerate(tensors):
      if save_tensors:
        torch.save(t.detach().clone().cpu(), _get_tensor_file(path, i))
      rewritten_tensors.append(TensorReference(i))
    return rewritten_tensors

  def select_fn(v):
    return type(v) == torch.Tensor and _is_xla_tensor(v)

  if save_tensors:
    if os.path.isdir(path):
      shutil.rmtree(path)
    os.mkdir(path)
  return _Arena(convert_fn, select_fn).transform(data)


def save(data, path, master_only=True, global_master=False):
  ref_data = _rewrite_data(_get_tensors_folder(path), data, True)
  torch.save(ref_data, path)


def load(path):
  ref_data = torch.load(path, weights_only=False)
  tensor_folder = _get_tensors_folder(path)

  def convert_fn(tensors):
    rewritten_tensors = []
    for t in tensors:
      rewritten_tensors.append(
          torch.load(_get_tensor_file(tensor_folder, t.tid), weights_only=False))
    return rewritten_tensors

  def select_fn(v):
    return type(v) == TensorReference

  return _Arena(convert_fn, select_fn).transform(ref_data)
'''

# Loads xser files with the fake torch-xla (never importing shardkit) and saves what it got as
# plain state dicts, so the test process can compare them.
LOAD_SCRIPT = """
import json, os, sys
import torch
import torch_xla
import torch_xla.utils.serialization as xser

def name(t):
    return t.__module__ + "." + t.__qualname__

out_dir = sys.argv[1]
report = {"torch_xla": torch_xla.__file__, "files": []}
for i, path in enumerate(sys.argv[2:]):
    raw = torch.load(path, weights_only=False)
    obj = xser.load(path)
    out = os.path.join(out_dir, "loaded_%d.pt" % i)
    torch.save({k: v for k, v in obj.items()}, out)
    report["files"].append({
        "path": path,
        "out": out,
        "raw_type": name(type(raw)),
        "type": name(type(obj)),
        "keys": list(obj),
        "raw": {k: [name(type(v)), type(v) is xser.TensorReference, getattr(v, "tid", None)] for k, v in raw.items()},
        "loaded_types": sorted({name(type(v)) for v in obj.values()}),
    })
report["shardkit_imported"] = sorted(m for m in sys.modules if m == "shardkit" or m.startswith("shardkit."))
print(json.dumps(report))
"""

# Writes xser files with the fake torch-xla: tensors named in "device" become references, the
# others stay inline; NxD's .info.pt is added when asked.
SAVE_SCRIPT = """
import json, sys
import torch
import torch_xla.utils.serialization as xser

jobs = json.loads(open(sys.argv[1]).read())
for job in jobs:
    sd = torch.load(job["src"], weights_only=True)
    data = {k: (xser.to_device(v) if k in job["device"] else v) for k, v in sd.items()}
    xser.save(data, job["dst"])
    if job["info"]:
        refs = torch.load(job["dst"], weights_only=False)
        info = {v.tid: {"dtype": sd[k].dtype, "shape": sd[k].shape, "expert_model_parallel": False}
                for k, v in refs.items() if type(v) is xser.TensorReference}
        torch.save(info, job["dst"] + ".info.pt")
print("ok")
"""


@pytest.fixture(scope="module")
def fake_xla(tmp_path_factory) -> Path:
    """A folder holding a fake torch_xla package (only utils.serialization), for PYTHONPATH."""
    root = tmp_path_factory.mktemp("fake-torch-xla")
    pkg = root / "torch_xla"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Fake torch_xla for tests: only utils.serialization."""\nFAKE = True\n')
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "serialization.py").write_text(FAKE_SERIALIZATION)
    return root


def run_with_fake_xla(fake_xla: Path, script: str, *args, tmp: Path) -> str:
    """Run `script` in a fresh interpreter with the fake torch_xla importable; returns stdout."""
    path = tmp / f"script_{abs(hash(script)) % 10**8}.py"
    path.write_text(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake_xla)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(path), *map(str, args)], capture_output=True, text=True, env=env, cwd=tmp, timeout=120
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def fake_xla_load(fake_xla: Path, files: list[Path], tmp: Path) -> dict:
    out = tmp / "fake-loaded"
    out.mkdir(exist_ok=True)
    report = json.loads(run_with_fake_xla(fake_xla, LOAD_SCRIPT, out, *files, tmp=tmp))
    assert Path(report["torch_xla"]).resolve().is_relative_to(fake_xla.resolve()), report["torch_xla"]
    assert report["shardkit_imported"] == [], "the fake torch-xla load must not need shardkit"
    return report


# ---- helpers ------------------------------------------------------------------------------------


class _Ref:
    """Our own stand-in for TensorReference (to read reference files independently of shardkit)."""

    def __init__(self, tid=None):
        self.tid = tid


def load_refs(path: Path) -> dict:
    with torch.serialization.safe_globals([(_Ref, "torch_xla.utils.serialization.TensorReference")]):
        return torch.load(path, map_location="cpu", weights_only=True)


def load_plain(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def rank_files(root: Path) -> list[Path]:
    """The rank files (not .info.pt side files) under root/model, sorted."""
    return sorted(p for p in (root / "model").iterdir() if RANK_FILE.match(p.name))


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def pickle_globals(path: Path) -> list[str]:
    """The GLOBAL / STACK_GLOBAL names in a torch zip file's data.pkl."""
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
        data = zf.read(name)
    found, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.append(arg)
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.append(f"{strings[-2]} {strings[-1]}")
    return found


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got a {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: values differ"


def convert_to(src: Path, dst: Path, fmt: str, layout: Layout = LAYOUT, **options) -> Path:
    convert(src, dst, layout, format=fmt, **options)
    return dst


def nxd_copy(shards: Path, dst: Path) -> Path:
    """An NxD-style directory (model/ + config.json, no shardkit manifest) from shardkit's shards."""
    dst.mkdir(parents=True)
    shutil.copytree(shards / "model", dst / "model")
    shutil.copyfile(shards / "config.json", dst / "config.json")
    return dst


def no_output_left(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was left behind"
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert not leftovers, f"staging directories left behind: {leftovers}"


@pytest.fixture(scope="module")
def torch_shards(tiny_model, tmp_path_factory) -> Path:
    """llama-gqa64 (64 heads, 8 kv) in torch format, tp 2, pp 2, GQA layer; read-only for tests."""
    return convert_to(tiny_model(MODEL), tmp_path_factory.mktemp("torch-shards") / "shards", "torch")


@pytest.fixture(scope="module")
def hand_xser(torch_shards, fake_xla, tmp_path_factory) -> Path:
    """The same shards as an NxD xser directory written by the fake torch-xla: in every rank file
    some tensors are references (<file>.tensors/tensor_<tid>.pt) and some are inline; even rank
    files also carry NxD's .info.pt. Read-only for tests: copy before changing."""
    tmp = tmp_path_factory.mktemp("hand-xser")
    root = tmp / "nxd"
    (root / "model").mkdir(parents=True)
    shutil.copyfile(torch_shards / "config.json", root / "config.json")
    jobs = []
    for i, src in enumerate(rank_files(torch_shards)):
        keys = list(load_plain(src))
        device = [k for j, k in enumerate(keys) if (i + j) % 2 == 0]
        assert 0 < len(device) < len(keys)
        jobs.append({"src": str(src), "dst": str(root / "model" / src.name), "device": device, "info": i % 2 == 0})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    run_with_fake_xla(fake_xla, SAVE_SCRIPT, tmp / "jobs.json", tmp=tmp)
    return root


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- 1. xser written by shardkit is what torch-xla writes and reads ------------------------------


def test_xser_output_loads_with_torch_xla_loader(tiny_model, torch_shards, fake_xla, tmp_path):
    """torch-xla's xser.load (faked, full pickle) gives, for every rank file, a dict with the
    torch-format file's keys in the same order and equal tensors: shardkit's TensorReference
    resolves to torch-xla's own class."""
    xser_dir = convert_to(tiny_model(MODEL), tmp_path / "xser", "xser")
    files = rank_files(xser_dir)
    assert [f.name for f in files] == [f.name for f in rank_files(torch_shards)]
    report = fake_xla_load(fake_xla, files, tmp_path)
    assert len(report["files"]) == len(files)
    for entry, path in zip(report["files"], files):
        want = load_plain(torch_shards / "model" / path.name)
        assert entry["raw_type"] in ("builtins.dict", "collections.OrderedDict"), entry["raw_type"]
        assert entry["type"] == entry["raw_type"]
        assert entry["keys"] == list(want), f"{path.name}: keys or key order differ from the torch format"
        for key, (cls, is_fake_class, tid) in entry["raw"].items():
            assert cls == "torch_xla.utils.serialization.TensorReference" and is_fake_class, (path.name, key, cls)
            assert isinstance(tid, int), (path.name, key, tid)
        assert entry["loaded_types"] == ["torch.Tensor"]
        got = load_plain(Path(entry["out"]))
        for key in want:
            assert_same_tensor(got[key], want[key], f"{path.name}:{key}")


def test_xser_output_is_the_reference_form(tiny_model, torch_shards, tmp_path):
    """The .pt holds only torch-xla TensorReference objects (pickle GLOBAL under torch-xla's name),
    each tensor sits alone in <file>.tensors/tensor_<tid>.pt, and <file>.info.pt maps
    tid -> {dtype, shape, expert_model_parallel}."""
    xser_dir = convert_to(tiny_model(MODEL), tmp_path / "xser", "xser")
    for path in rank_files(xser_dir):
        want = load_plain(torch_shards / "model" / path.name)
        globals_ = pickle_globals(path)
        assert REFERENCE_GLOBAL in globals_, f"{path.name}: no {REFERENCE_GLOBAL!r} GLOBAL in {globals_}"
        assert not [g for g in globals_ if g.startswith("torch.")], f"{path.name}: inline tensors in {globals_}"
        refs = load_refs(path)
        assert list(refs) == list(want)
        assert all(isinstance(v, _Ref) and isinstance(v.tid, int) for v in refs.values())
        tids = {k: v.tid for k, v in refs.items()}
        assert len(set(tids.values())) == len(tids), f"{path.name}: duplicate tids"
        tensor_dir = Path(str(path) + ".tensors")
        assert {p.name for p in tensor_dir.iterdir()} == {f"tensor_{t}.pt" for t in tids.values()}
        for key, tid in tids.items():
            assert_same_tensor(load_plain(tensor_dir / f"tensor_{tid}.pt"), want[key], f"{path.name}:{key}")
        info = load_plain(Path(str(path) + ".info.pt"))
        assert set(info) == set(tids.values())
        for key, tid in tids.items():
            assert info[tid] == {"dtype": want[key].dtype, "shape": want[key].shape, "expert_model_parallel": False}
            assert isinstance(info[tid]["shape"], torch.Size)


@pytest.mark.parametrize("writer", ["native", "torch"])
def test_xser_tensor_files_are_torch_save_of_the_bare_tensor(writer, monkeypatch, tmp_path):
    """Each tensor file XserWriter streams is byte for byte torch.save(tensor) (what torch-xla's
    xser.save writes for it, into a file object), whichever zip writer writes it and whether the
    tensor is handed over (owned: written and hashed behind); its record's digests are the file's."""
    from shardkit.formats import torch_io, torch_zip
    from shardkit.formats.xser import XserWriter, tensor_path

    if writer == "torch":
        monkeypatch.setattr(torch_io, "native_writer", lambda records, bound: False)
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "big.bf16": torch.randn(1500, 700, generator=gen).to(torch.bfloat16),  # large enough to go behind
        "w.fp32": torch.randn(33, 17, generator=gen),
        "strided": torch.randn(12, 8, generator=gen).t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ids.i64": torch.arange(9),
        "mask": torch.tensor([True, False]),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["f8"] = torch.randn(5, 3, generator=gen).to(torch.float8_e4m3fn)
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    path = tmp_path / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    out = XserWriter(path, tmp_path, specs, digests="sha256")
    for i, (name, tensor) in enumerate(tensors.items()):
        out.write(name, tensor.clone(), owned=bool(i % 2))
    records = {r.path: r for r in out.close()}
    assert torch_zip.native_matches() or writer == "torch"
    for tid, (name, tensor) in enumerate(tensors.items()):
        want = io.BytesIO()
        torch.save(tensor.contiguous().clone(), want)
        file = tensor_path(path, tid)
        raw = file.read_bytes()
        assert raw == want.getvalue(), name
        record = records[file.relative_to(tmp_path).as_posix()]
        assert (record.size, record.sha256, record.xxh3_128) == (
            len(raw),
            hashlib.sha256(raw).hexdigest(),
            xxhash.xxh3_128_hexdigest(raw),
        ), name


def test_xser_output_matches_real_torch_xla_golden(tmp_path):
    """Same layout as the golden files written by real torch-xla: same file names, same tids per
    key (in the same order), same .info.pt contents, equal tensors, same pickle globals."""
    golden = golden_or_skip()
    want_root = golden / "nxd-xser" / GOLDEN_XSER_CASE
    got_root = convert_to(golden / "hf" / "llama-gqa-tiny", tmp_path / "xser", "xser", Layout(tp=8, pp=2, qkv="gqa"))
    want_files = {f for f in files_under(want_root / "model")}
    got_files = {f for f in files_under(got_root / "model")}
    assert got_files == want_files, (sorted(got_files - want_files)[:5], sorted(want_files - got_files)[:5])
    for want_path in rank_files(want_root):
        got_path = got_root / "model" / want_path.name
        want_refs, got_refs = load_refs(want_path), load_refs(got_path)
        assert [(k, v.tid) for k, v in got_refs.items()] == [(k, v.tid) for k, v in want_refs.items()], want_path.name
        assert pickle_globals(got_path) == pickle_globals(want_path)
        assert load_plain(Path(str(got_path) + ".info.pt")) == load_plain(Path(str(want_path) + ".info.pt"))
        for ref in want_refs.values():
            rel = f"{want_path.name}.tensors/tensor_{ref.tid}.pt"
            assert_same_tensor(load_plain(got_root / "model" / rel), load_plain(want_root / "model" / rel), rel)


def test_fake_torch_xla_reads_real_torch_xla_output(fake_xla, tmp_path):
    """Check of the fake itself: it reads real torch-xla files to the torch-form golden tensors."""
    golden = golden_or_skip()
    files = rank_files(golden / "nxd-xser" / GOLDEN_XSER_CASE)[:2]
    report = fake_xla_load(fake_xla, files, tmp_path)
    for entry, path in zip(report["files"], files):
        want = load_plain(golden / "nxd" / GOLDEN_XSER_CASE / "model" / path.name)
        assert entry["keys"] == list(want)
        got = load_plain(Path(entry["out"]))
        for key in want:
            assert_same_tensor(got[key], want[key], f"{path.name}:{key}")


# ---- 2. reading xser with referenced and inline tensors -------------------------------------------


def test_reads_xser_with_inline_and_referenced_tensors(hand_xser, torch_shards, tiny_model, tmp_path):
    files = rank_files(hand_xser)
    for path in files:  # the fixture really mixes both forms in each file
        globals_ = pickle_globals(path)
        assert REFERENCE_GLOBAL in globals_ and "torch._utils _rebuild_tensor_v2" in globals_, (path.name, globals_)
    ckpt = open_checkpoint(hand_xser)
    assert ckpt.format == "xser" and ckpt.kind == "sharded"
    assert (ckpt.layout.tp, ckpt.layout.pp, ckpt.layout.qkv) == (2, 2, "gqa")
    for path in files:
        want = load_plain(torch_shards / "model" / path.name)
        reader = XserFile(path)
        try:
            assert reader.keys() == list(want)
            for key, tensor in want.items():
                assert reader.shape(key) == tuple(tensor.shape), (path.name, key)
                assert reader.dtype(key) == tensor.dtype, (path.name, key)
                assert_same_tensor(reader.read(key), tensor, f"{path.name}:{key}")
                rows = tensor.shape[0]
                if tensor.dim() and rows > 1:
                    assert_same_tensor(reader.read(key, 0, 1, rows), tensor[1:rows], f"{path.name}:{key}[1:]")
        finally:
            reader.close()
        loaded = shardkit_xser_load(path)
        assert list(loaded) == list(want)
        for key in want:
            assert_same_tensor(loaded[key], want[key], f"xser.load {path.name}:{key}")
    merged = tmp_path / "merged"
    merge(hand_xser, merged)
    hf = load_file(tiny_model(MODEL) / "model.safetensors")
    got = load_file(merged / "model.safetensors")
    assert set(got) == set(hf)
    for key in hf:
        assert_same_tensor(got[key], hf[key], f"merged {key}")


def test_reads_real_torch_xla_golden_with_xserfile():
    golden = golden_or_skip()
    for path in rank_files(golden / "nxd-xser" / GOLDEN_XSER_CASE):
        want = load_plain(golden / "nxd" / GOLDEN_XSER_CASE / "model" / path.name)
        reader = XserFile(path)
        try:
            assert reader.keys() == list(want)
            for key in want:
                assert_same_tensor(reader.read(key), want[key], f"{path.name}:{key}")
        finally:
            reader.close()


# ---- 3. never run arbitrary pickle ---------------------------------------------------------------


class _Payload:
    """Unpickling calls func(arg): what a malicious checkpoint does."""

    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def payload(kind: str, marker: Path) -> _Payload:
    if kind == "os.system":
        return _Payload(os.system, f"touch '{marker}'")
    return _Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()")


PAYLOADS = ("os.system", "exec")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_payloads_are_live(kind, tmp_path):
    """Guard against a vacuous test: full pickle really runs these payloads."""
    marker = tmp_path / "canary"
    torch.save({"w": payload(kind, marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def _malicious_rank_file(path: Path, kind: str, marker: Path) -> None:
    """Rewrite a torch rank file with one tensor replaced by the payload."""
    sd = load_plain(path)
    first = next(iter(sd))
    sd[first] = payload(kind, marker)
    torch.save(sd, path)


def assert_refused(excinfo, bad_file: Path, marker: Path) -> None:
    message = str(excinfo.value)
    assert "refus" in message.lower(), message
    assert bad_file.name in message, message
    assert "\n" not in message, message
    assert not marker.exists(), "the malicious pickle ran"


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refuses_malicious_nxd_rank_file(kind, torch_shards, tmp_path):
    """(a) A rank file of an NxD directory: open_checkpoint (first rank) and merge (any rank)."""
    marker = tmp_path / "pwned"
    first = nxd_copy(torch_shards, tmp_path / "first")
    bad = rank_files(first)[0]
    _malicious_rank_file(bad, kind, marker)
    with pytest.raises(FormatError) as excinfo:
        open_checkpoint(first)
    assert_refused(excinfo, bad, marker)
    with pytest.raises(FormatError) as excinfo:
        merge(first, tmp_path / "out1")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out1")

    last = nxd_copy(torch_shards, tmp_path / "last")
    bad = rank_files(last)[-1]
    _malicious_rank_file(bad, kind, marker)
    with pytest.raises(FormatError) as excinfo:
        merge(last, tmp_path / "out2")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out2")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refuses_malicious_rank_file_in_shardkit_dir(kind, torch_shards, tmp_path):
    """(a) A rank file of shardkit's own shards (manifest present): merge and reshard refuse."""
    marker = tmp_path / "pwned"
    shards = copy_tree(torch_shards, tmp_path / "shards")
    bad = rank_files(shards)[-1]
    _malicious_rank_file(bad, kind, marker)
    with pytest.raises(FormatError) as excinfo:
        merge(shards, tmp_path / "out")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out")
    with pytest.raises(FormatError) as excinfo:
        convert(shards, tmp_path / "resharded", Layout(tp=1, pp=1, qkv="gqa"))
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "resharded")


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("target", ["tensor", "main", "info"])
def test_refuses_malicious_xser_files(kind, target, hand_xser, tmp_path):
    """(b) An xser tensor file, the xser reference file itself, and NxD's .info.pt."""
    marker = tmp_path / "pwned"
    root = copy_tree(hand_xser, tmp_path / "xser")
    main = rank_files(root)[0]  # rank 0 has an .info.pt (even rank files do)
    if target == "tensor":
        bad = sorted(Path(str(main) + ".tensors").iterdir())[0]
        torch.save(payload(kind, marker), bad)
    elif target == "main":
        bad = main  # the reference file: payload first, then the file's tensors (inline)
        resolved = {
            k: (load_plain(Path(str(main) + ".tensors") / f"tensor_{v.tid}.pt") if isinstance(v, _Ref) else v)
            for k, v in load_refs(main).items()
        }
        resolved[next(iter(resolved))] = payload(kind, marker)
        torch.save(resolved, main)
    else:
        bad = Path(str(main) + ".info.pt")
        assert bad.is_file()
        info = load_plain(bad)
        info[next(iter(info))]["dtype"] = payload(kind, marker)
        torch.save(info, bad)
    with pytest.raises(FormatError) as excinfo:
        merge(root, tmp_path / "out")
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refuses_malicious_hf_pytorch_model_bin(kind, tiny_model, tmp_path):
    """(c) The Hugging Face source's pytorch_model.bin: convert refuses (directory and file)."""
    marker = tmp_path / "pwned"
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copyfile(tiny_model(MODEL) / "config.json", hf / "config.json")
    sd = load_file(tiny_model(MODEL) / "model.safetensors")
    sd["model.embed_tokens.weight"] = payload(kind, marker)
    torch.save(sd, hf / "pytorch_model.bin")
    bad = hf / "pytorch_model.bin"
    with pytest.raises(FormatError) as excinfo:
        convert(hf, tmp_path / "out", LAYOUT)
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out")
    with pytest.raises(FormatError) as excinfo:
        convert(bad, tmp_path / "out2", LAYOUT)
    assert_refused(excinfo, bad, marker)
    no_output_left(tmp_path / "out2")
    with pytest.raises(FormatError) as excinfo:
        open_checkpoint(hf)
    assert_refused(excinfo, bad, marker)


def test_cli_refuses_malicious_files(torch_shards, tiny_model, tmp_path):
    """The CLI (merge and convert): exit 2, one line naming the refusal, no DST, payload not run."""
    if importlib.util.find_spec("shardkit.cli") is None:
        pytest.skip("the shardkit CLI (shardkit.cli) does not exist yet")
    from click.testing import CliRunner

    from shardkit.cli import cli

    marker = tmp_path / "pwned"
    shards = nxd_copy(torch_shards, tmp_path / "nxd")
    bad_rank = rank_files(shards)[-1]
    _malicious_rank_file(bad_rank, "os.system", marker)
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copyfile(tiny_model(MODEL) / "config.json", hf / "config.json")
    torch.save({"model.embed_tokens.weight": payload("exec", marker)}, hf / "pytorch_model.bin")
    runs = [
        (bad_rank, "merge", shards, tmp_path / "out1"),
        (hf / "pytorch_model.bin", "convert", hf, tmp_path / "out2", "--tp", "2", "--pp", "2", "--qkv", "gqa"),
    ]
    for bad, command, src, dst, *rest in runs:
        result = CliRunner().invoke(cli, ["-q", command, str(src), str(dst), *rest])
        assert result.exit_code == 2, (command, result.exit_code, result.output, result.exception)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (command, result.stderr)
        assert "refus" in lines[0].lower() and bad.name in lines[0], (command, lines[0])
        assert "Traceback" not in result.stderr
        no_output_left(dst)
        assert not marker.exists(), "the malicious pickle ran"


# ---- 4. safetensors written by shardkit --------------------------------------------------------------


def read_st_header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8 : 8 + length])


def check_st_layout(path: Path) -> dict:
    """Header length a multiple of 8, metadata {"format": "pt"}, data offsets packed and covering the file."""
    length, header = read_st_header(path)
    assert length % 8 == 0, f"{path.name}: header length {length} is not a multiple of 8"
    assert header.pop("__metadata__", None) == {"format": "pt"}, path.name
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    end = 0
    for start, stop in spans:
        assert start == end, f"{path.name}: gap or overlap at {start}"
        end = stop
    assert path.stat().st_size == 8 + length + end, f"{path.name}: size does not match the header"
    return header


@pytest.mark.parametrize(
    "model,dtype", [(MODEL, torch.float32), (MODEL, torch.bfloat16), ("llama-bias", torch.bfloat16)]
)
def test_safetensors_shards(model, dtype, tiny_model, tmp_path):
    src = tiny_model(model, dtype=dtype)
    layout = Layout(tp=2, pp=2, qkv="gqa")
    st = convert_to(src, tmp_path / "st", "safetensors", layout)
    pt = convert_to(src, tmp_path / "pt", "torch", layout)
    st_files = rank_files(st)
    assert [f.stem for f in st_files] == [f.stem for f in rank_files(pt)]
    assert all(f.suffix == ".safetensors" for f in st_files)
    st_name = {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]
    for path in st_files:
        header = check_st_layout(path)
        want = load_plain(pt / "model" / (path.stem + ".pt"))
        assert list(header) == list(want), f"{path.name}: names or order differ from the torch format"
        assert {v["dtype"] for v in header.values()} == {st_name}
        got = load_file(path)
        assert set(got) == set(want)
        for key in want:
            assert want[key].dtype == dtype
            assert_same_tensor(got[key], want[key], f"{path.name}:{key}")


def test_safetensors_cast_on_write(tiny_model, tmp_path):
    """dtype="bf16" from an fp32 source: the streamed bf16 file equals the cast tensors."""
    src = tiny_model(MODEL)
    st = convert_to(src, tmp_path / "st", "safetensors", dtype="bf16")
    pt = convert_to(src, tmp_path / "pt", "torch")
    for path in rank_files(st):
        check_st_layout(path)
        want = load_plain(pt / "model" / (path.stem + ".pt"))
        got = load_file(path)
        for key in want:
            assert_same_tensor(got[key], want[key].to(torch.bfloat16), f"{path.name}:{key}")


def test_safetensors_writer_streams_any_shapes_and_dtypes(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bf16": torch.randn(7, 3).to(torch.bfloat16),
        "c.fp16": torch.randn(1).to(torch.float16),
        "d.scalar": torch.tensor(2.5),
        "e.int": torch.arange(11, dtype=torch.int64),
        "f.bool": torch.tensor([True, False, True]),
        "g.u8": torch.arange(5, dtype=torch.uint8),
        "h.noncontiguous": torch.randn(4, 6).t(),
        "i.fp64": torch.randn(2, 2, dtype=torch.float64),
    }
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    path = tmp_path / "out" / "file.safetensors"
    writer = SafetensorsWriter(path, tmp_path, specs, digests="sha256")
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    (record,) = writer.close()
    raw = path.read_bytes()
    assert record.path == "out/file.safetensors"
    assert record.size == len(raw) and record.sha256 == hashlib.sha256(raw).hexdigest()
    header = check_st_layout(path)
    assert list(header) == list(tensors)
    got = load_file(path)
    for name, tensor in tensors.items():
        assert_same_tensor(got[name], tensor.contiguous(), name)


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
    import shardkit.io.strided as strided

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
            got = strided.read_stored(fd, stored, dim, start, stop, "raw.bin")
            assert torch.equal(got, full.narrow(dim, start, stop - start)), (dim, start, stop)
        # a tensor said to reach past the end of the file: a FormatError, never a fault (SIGBUS)
        past_end = strided.StoredTensor(torch.float32, (8, 5, 6), file_offset=8, storage_offset=4)
        with pytest.raises(FormatError, match="truncated"):
            strided.read_stored(fd, past_end, 2, 1, 3, "raw.bin")
    finally:
        os.close(fd)


def test_a_whole_tensor_read_along_a_later_dim_is_one_positional_read(tmp_path, monkeypatch):
    """A "slice" along dim 1 that spans the whole dim is the whole tensor: one contiguous read
    (which the hash check on read can hash), not a strided copy out of a mapping."""
    import shardkit.io.strided as strided

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
        lambda fd, view, offset, what, tapped=True: (
            reads.append((offset, len(view))),
            real_pread(fd, view, offset, what),
        )[1],
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        got = strided.read_stored(fd, strided.StoredTensor(torch.float32, (7, 5, 6), 0), 1, 0, 5, "raw.bin")
    finally:
        os.close(fd)
    assert torch.equal(got, full) and reads == [(0, full.numel() * 4)]


def test_advise_names_the_bytes_a_slice_spans(tmp_path, monkeypatch):
    """The read-ahead hint of a slice covers exactly the bytes read_stored reads for it."""
    import shardkit.io.strided as strided

    stored = strided.StoredTensor(torch.float32, (7, 5, 6), file_offset=8, storage_offset=4)
    hints, reads = [], []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: hints.append((offset, length)))
    path = tmp_path / "raw.bin"
    path.write_bytes(bytes(8 + 4 * (4 + 7 * 5 * 6)))
    real_pread = strided.pread_exact
    monkeypatch.setattr(
        strided,
        "pread_exact",
        lambda fd, view, offset, what: (reads.append((offset, len(view))), real_pread(fd, view, offset, what))[1],
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        for dim, start, stop in [(0, 2, 5), (1, 1, 4), (2, 3, 6), (0, None, None)]:
            hints.clear(), reads.clear()
            strided.advise_stored(fd, stored, dim, start, stop)
            strided.read_stored(fd, stored, dim, start, stop, "raw.bin")
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
    import shardkit.io.hashing as hashing
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


# ---- 5. manifest checksums ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_manifest_sizes_and_digests_match_disk(fmt, tiny_model, tmp_path):
    out = convert_to(tiny_model(MODEL), tmp_path / fmt, fmt)
    manifest = json.loads((out / "shardkit.json").read_text())
    assert manifest["format"] == fmt
    listed = [entry["path"] for entry in manifest["files"]]
    assert len(listed) == len(set(listed)), "a file is listed twice"
    for entry in manifest["files"]:
        path = out / entry["path"]
        assert path.is_file(), f"{entry['path']} is listed but missing"
        data = path.read_bytes()
        assert entry["size"] == len(data), entry["path"]
        assert "sha256" not in entry, "sha256 is recorded only with --sha256"
        assert entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(data), entry["path"]
    model_files = {f"model/{p}" for p in files_under(out / "model")}
    assert model_files <= set(listed), f"not in the manifest: {sorted(model_files - set(listed))[:5]}"
    assert {p for p in listed if p.startswith("model/")} == model_files


# ---- 6. truncated files ------------------------------------------------------------------------


def truncate(path: Path, how: str) -> None:
    size = path.stat().st_size
    keep = size // 2 if how == "half" else size - 1
    with open(path, "r+b") as fh:
        fh.truncate(keep)


@pytest.mark.parametrize("how", ["half", "last-byte"])
@pytest.mark.parametrize("kind", ["torch", "safetensors", "xser-tensor", "xser-tensor-noinfo"])
def test_merge_of_truncated_file_fails_cleanly(kind, how, tiny_model, torch_shards, hand_xser, tmp_path):
    if kind == "torch":
        root = copy_tree(torch_shards, tmp_path / "src")
        bad = rank_files(root)[-1]
    elif kind == "safetensors":
        root = convert_to(tiny_model(MODEL), tmp_path / "src", "safetensors")
        bad = rank_files(root)[-1]
    else:
        root = copy_tree(hand_xser, tmp_path / "src")
        # rank file 2 has an .info.pt (shapes come from it, data is read while writing); rank file 3
        # has none (shapes are read from the tensor files while checking)
        main = rank_files(root)[2 if kind == "xser-tensor" else 3]
        assert Path(str(main) + ".info.pt").is_file() == (kind == "xser-tensor")
        # a tensor merge must read (tp-split, not a replicated norm that another rank also holds)
        tid = next(r.tid for k, r in load_refs(main).items() if isinstance(r, _Ref) and "norm" not in k)
        bad = Path(str(main) + ".tensors") / f"tensor_{tid}.pt"
    truncate(bad, how)
    dst = tmp_path / "merged"
    with pytest.raises(FormatError) as excinfo:
        merge(root, dst)
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert bad.name in message, message
    if kind.startswith("xser"):
        assert bad.parent.name in message, message
    no_output_left(dst)


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
