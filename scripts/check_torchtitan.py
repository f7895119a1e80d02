"""Check a shardkit DCP folder in torchtitan's names with torchtitan's own state-dict adapter.

torchtitan (0.1-0.2, the `torchtitan` convention) is no dependency of shardkit, and shardkit's
code is not used here. Its two files come from the published wheel (`fetch`: `pip download
--no-deps`, nothing installed; .ci/run does it, the tests never touch the network), or from a
Python where torchtitan is installed:

    python scripts/check_torchtitan.py fetch DIR                # torchtitan 0.2.2's files into DIR
    TORCHTITAN_SRC=DIR python scripts/check_torchtitan.py HF_DIR DCP_DIR
    /tmp/tt/bin/python scripts/check_torchtitan.py HF_DIR DCP_DIR   # a venv with torchtitan installed

It reads the DCP folder with torch's own reader (`dcp_to_torch_save`), then checks both ways with
torchtitan's `Llama3StateDictAdapter`: `to_hf` of the folder's tensors gives the Hugging Face
model's tensors, and `from_hf` of the model gives the folder's. Only the adapter's module and its
base class are loaded (torchtitan's package also pulls in training-only dependencies such as
triton); their few imports of the rest of torchtitan are stood in for. Exit 0 when both agree.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path


def _module(name: str, path: Path | None = None, **attrs: object) -> types.ModuleType:
    """`name` in sys.modules: the file at `path` executed as that module, or a stand-in package."""
    if path is None:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that submodules can be imported from it
        module.__dict__.update(attrs)
    else:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


VERSION = "0.2.2"
FILES = ("torchtitan/protocols/state_dict_adapter.py", "torchtitan/models/llama3/model/state_dict_adapter.py")
"""The files of torchtitan's wheel this check runs (`fetch`)."""


def fetch(folder: Path) -> None:
    """torchtitan's adapter files (FILES) from its published wheel into `folder`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from wheel_files import fetch_wheel_files

    fetch_wheel_files(f"torchtitan=={VERSION}", FILES, folder)


def torchtitan_root() -> Path:
    """The torchtitan package folder: TORCHTITAN_SRC's (fetched), else the installed package's."""
    if os.environ.get("TORCHTITAN_SRC"):
        return Path(os.environ["TORCHTITAN_SRC"]) / "torchtitan"
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchtitan is not installed in this Python and TORCHTITAN_SRC is not set")
    return Path(list(spec.submodule_search_locations)[0])


def torchtitan_adapter():
    """torchtitan's Llama3StateDictAdapter class, from torchtitan's own files."""
    root = torchtitan_root()
    for package in ("torchtitan", "torchtitan.tools", "torchtitan.protocols", "torchtitan.models",
                    "torchtitan.models.llama3", "torchtitan.models.llama3.model"):
        _module(package)
    _module("torchtitan.tools.logging", logger=logging.getLogger("torchtitan"))
    _module("torchtitan.protocols.model", BaseModelArgs=object)
    _module("torchtitan.models.llama3.model.args", TransformerModelArgs=object)
    _module("torchtitan.protocols.state_dict_adapter", root / "protocols/state_dict_adapter.py")
    adapter = _module("torchtitan.models.llama3.model.state_dict_adapter",
                      root / "models/llama3/model/state_dict_adapter.py")
    return adapter.Llama3StateDictAdapter


def main(hf_dir: Path, dcp_dir: Path) -> int:
    import torch  # imported here: `fetch` runs before .ci/run installs the project's dependencies
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    config = json.loads((hf_dir / "config.json").read_text())
    args = types.SimpleNamespace(n_heads=config["num_attention_heads"], n_kv_heads=config["num_key_value_heads"],
                                 dim=config["hidden_size"])
    adapter = torchtitan_adapter()(args, None)
    hf = load_file(str(hf_dir / "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dcp_dir, Path(tmp) / "dcp.pt")
        saved = torch.load(Path(tmp) / "dcp.pt", weights_only=True)
    problems = []
    back = adapter.to_hf(dict(saved))
    if set(back) != set(hf):
        problems.append(f"to_hf names differ: {sorted(set(back) ^ set(hf))[:4]}")
    problems += [f"to_hf({k}) differs" for k in hf if k in back and not torch.equal(back[k], hf[k])]
    native = adapter.from_hf(dict(hf))
    if set(native) != set(saved):
        problems.append(f"from_hf names differ: {sorted(set(native) ^ set(saved))[:4]}")
    problems += [f"from_hf gives another {k}" for k in saved if k in native and not torch.equal(native[k], saved[k])]
    for line in problems:
        print(line)
    if problems:
        return 1
    print(f"torchtitan's adapter agrees: {len(saved)} tensors of {dcp_dir} are {hf_dir} in torchtitan's names and order")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    if sys.argv[1] == "fetch":
        fetch(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
