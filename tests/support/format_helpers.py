"""Helpers of the format tests (tests/unit/formats/test_formats_*.py): a fake of torch-xla's public
serialization module (torch_xla.utils.serialization) run in subprocesses to write and read xser
files independently of shardkit, readers of reference files and pickled globals, and the shards the
tests share are fixtures of format_fixtures.py (a plugin, as s3_fixtures is)."""

from __future__ import annotations

import json
import os
import pickletools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from shardkit import Layout, convert

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


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
