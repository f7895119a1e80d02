"""Check a shardkit DCP folder in torchtitan's names with torchtitan's own state-dict adapter.

torchtitan (0.1-0.2, the `torchtitan` convention; 0.3, `torchtitan-0.3`) is no dependency of
shardkit, and shardkit's code is not used here. Its files come from the published wheels
(`fetch`: `pip download --no-deps`, nothing installed; .ci/run does it, the tests never touch the
network), or from a Python where torchtitan is installed:

    python scripts/check_torchtitan.py fetch DIR                # torchtitan 0.2.2's and 0.3.0's files into DIR
    TORCHTITAN_SRC=DIR python scripts/check_torchtitan.py HF_DIR DCP_DIR
    /tmp/tt/bin/python scripts/check_torchtitan.py HF_DIR DCP_DIR   # a venv with torchtitan installed

It reads the DCP folder with torch's own reader (`dcp_to_torch_save`), then checks both ways with
torchtitan's `Llama3StateDictAdapter` (0.3's when the folder has 0.3's names): `to_hf` of the
folder's tensors gives the Hugging Face model's tensors, and `from_hf` of the model gives the
folder's. Only the adapter's module and its base class are loaded (torchtitan's package also pulls
in training-only dependencies such as triton); their few imports of the rest of torchtitan are
stood in for. Exit 0 when both agree.

The tests of torchtitan 0.3's fused q/k/v (tests/support/titan_dcp.py) run, from the same fetched files,
the state-dict hooks of its `FusedQKVLinear` (`fused_qkv_hooks`: the two functions alone, taken
from the module's source) and its optimizer's flat state-dict functions (`optimizer_utils`).
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
from typing import Any


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
VERSION_03 = "0.3.0"
FILES_03 = (
    "torchtitan/protocols/state_dict_adapter.py",
    "torchtitan/models/llama3/state_dict_adapter.py",
    "torchtitan/models/common/attention.py",  # FusedQKVLinear and its state-dict hooks
    "torchtitan/components/optimizer/utils.py",  # the optimizer's flat, name-keyed state dict
)
"""The files of torchtitan 0.3's wheel the checks run, fetched into DIR/0.3."""


def fetch(folder: Path) -> None:
    """torchtitan's files (FILES, FILES_03) from its published wheels into `folder` (0.3's in `folder/0.3`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from wheel_files import fetch_wheel_files

    fetch_wheel_files(f"torchtitan=={VERSION}", FILES, folder)
    fetch_wheel_files(f"torchtitan=={VERSION_03}", FILES_03, folder / "0.3")


def torchtitan_03_root() -> Path | None:
    """torchtitan 0.3's fetched package folder (TORCHTITAN_SRC/0.3), or an installed torchtitan
    0.3's; None when neither is here."""
    if os.environ.get("TORCHTITAN_SRC"):
        root = Path(os.environ["TORCHTITAN_SRC"]) / "0.3" / "torchtitan"
        return root if (root / "models/common/attention.py").is_file() else None
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    return root if (root / "models/common/attention.py").is_file() else None


def fused_qkv_hooks(root: Path) -> tuple[Any, Any]:
    """torchtitan 0.3's `FusedQKVLinear._split_qkv_on_save` and `_merge_qkv_on_load`, the two
    functions alone, compiled from its attention.py (the module imports half of torchtitan)."""
    import ast

    import torch
    from torch.distributed.tensor import DTensor, Replicate

    path = root / "models/common/attention.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FusedQKVLinear")
    wanted = ("_split_qkv_on_save", "_merge_qkv_on_load")
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    for func in funcs:
        func.decorator_list = []  # @staticmethod: plain functions here
    namespace: dict[str, Any] = {"torch": torch, "DTensor": DTensor, "Replicate": Replicate}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)  # torchtitan's own code
    return namespace[wanted[0]], namespace[wanted[1]]


def optimizer_utils(root: Path) -> types.ModuleType:
    """torchtitan 0.3's `components/optimizer/utils.py` (it imports torch only)."""
    return _module("torchtitan_03_optimizer_utils", root / "components/optimizer/utils.py")


def torchtitan_adapter_03(root: Path) -> Any:
    """torchtitan 0.3's Llama3StateDictAdapter class, from its own files, and the stand-in of the
    rotary class its `from_hf` checks the model config for."""
    for package in (
        "torchtitan",
        "torchtitan.tools",
        "torchtitan.protocols",
        "torchtitan.models",
        "torchtitan.models.common",
        "torchtitan.models.llama3",
    ):
        _module(package)
    _module("torchtitan.tools.logging", logger=logging.getLogger("torchtitan"))
    config = type("Config", (), {})
    _module("torchtitan.protocols.model", BaseModel=type("BaseModel", (), {"Config": config}))
    rope = type("ComplexRoPE", (), {"Config": type("Config", (), {})})
    _module("torchtitan.models.common.rope", ComplexRoPE=rope)
    _module("torchtitan.models.llama3.model", Llama3Model=type("Llama3Model", (), {"Config": config}))
    _module("torchtitan.protocols.state_dict_adapter", root / "protocols/state_dict_adapter.py")
    adapter = _module("torchtitan.models.llama3.state_dict_adapter", root / "models/llama3/state_dict_adapter.py")
    return adapter.Llama3StateDictAdapter, rope


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
    for package in (
        "torchtitan",
        "torchtitan.tools",
        "torchtitan.protocols",
        "torchtitan.models",
        "torchtitan.models.llama3",
        "torchtitan.models.llama3.model",
    ):
        _module(package)
    _module("torchtitan.tools.logging", logger=logging.getLogger("torchtitan"))
    _module("torchtitan.protocols.model", BaseModelArgs=object)
    _module("torchtitan.models.llama3.model.args", TransformerModelArgs=object)
    _module("torchtitan.protocols.state_dict_adapter", root / "protocols/state_dict_adapter.py")
    adapter = _module(
        "torchtitan.models.llama3.model.state_dict_adapter", root / "models/llama3/model/state_dict_adapter.py"
    )
    return adapter.Llama3StateDictAdapter


def main(hf_dir: Path, dcp_dir: Path) -> int:
    import torch  # imported here: `fetch` needs neither torch nor the project's dependencies
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dcp_dir, Path(tmp) / "dcp.pt")
        saved = torch.load(Path(tmp) / "dcp.pt", weights_only=True)
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    if any(".qkv_linear." in k for k in saved):  # torchtitan 0.3's names
        root = torchtitan_03_root()
        if root is None:
            raise SystemExit("the folder has torchtitan 0.3's names, and torchtitan 0.3's files are not here")
        cls, rope = torchtitan_adapter_03(root)
        attention = types.SimpleNamespace(
            n_heads=heads, n_kv_heads=kv, head_dim=config.get("head_dim"), rope=rope.Config()
        )
        layers = [types.SimpleNamespace(attention=attention)] * config["num_hidden_layers"]
        model_config = types.SimpleNamespace(layers=layers, dim=dim, enable_weight_tying=False)
        adapter = cls(model_config, None)
    else:
        adapter = torchtitan_adapter()(types.SimpleNamespace(n_heads=heads, n_kv_heads=kv, dim=dim), None)
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
    print(
        f"torchtitan's adapter agrees: {len(saved)} tensors of {dcp_dir} are {hf_dir} in torchtitan's names and order"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    if sys.argv[1] == "fetch":
        fetch(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
