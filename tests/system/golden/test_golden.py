"""shardkit against neuronx-distributed's own converter output (../shared/golden).

The golden folder holds NxD's `checkpoint_converter.py` output for tiny Llama checkpoints. These
tests prove, tensor for tensor (torch.equal), that shardkit writes the same files, names and bytes
as NxD, that it reads NxD's files back (layout inferred, no hints) to exactly the original Hugging
Face weights, and that it reads torch-xla's xser form of the same shards.

Each case's layout comes from its args.txt (NxD's converter flags), and each case's model from
the table in golden/README.md: nothing about the cases is hard-coded here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN, golden_or_skip
from safetensors.torch import load_file

from shardkit import Layout, convert, merge, open_checkpoint

# ---- reading the golden folder (independently of shardkit) -------------------------------------


def _case_names(sub: str) -> list[str]:
    folder = GOLDEN / sub
    if not folder.is_dir():
        return ["golden-missing"]  # the test skips (golden_or_skip) before using it
    return sorted(p.name for p in folder.iterdir() if (p / "args.txt").is_file())


NXD_CASES = _case_names("nxd")
XSER_CASES = _case_names("nxd-xser")

_TRUE = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
# Flags that name paths or modes and say nothing about the shards' layout.
_IGNORED_FLAGS = {
    "--input_dir",
    "--output_dir",
    "--config",
    "--convert_from_full_state",
    "--convert_to_full_state",
    "--save_xser",
    "--load_xser",
}


def layout_from_args(text: str) -> Layout:
    """The Layout NxD's converter flags describe (trn1 = interleaved kv replication)."""
    tokens = text.split()
    flags: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        assert flag.startswith("--"), f"unexpected token {flag!r} in args.txt"
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags[flag] = tokens[i + 1]
            i += 2
        else:
            flags[flag] = "True"
            i += 1
    known = {
        "--tp_size",
        "--pp_size",
        "--qkv_linear",
        "--coalesce_qkv",
        "--fuse_qkv",
        "--kv_size_multiplier",
        "--hw_backend",
    } | _IGNORED_FLAGS
    unknown = set(flags) - known
    assert not unknown, f"args.txt has flags this test does not understand: {sorted(unknown)}"

    def flag_on(name: str) -> bool:
        return _TRUE[flags.get(name, "False").lower()]

    if flag_on("--qkv_linear"):
        qkv = "fused" if flag_on("--fuse_qkv") else "gqa"
    elif flag_on("--coalesce_qkv"):
        qkv = "coalesced"
    else:
        qkv = "separate"
    backend = flags.get("--hw_backend", "trn1")
    return Layout(
        tp=int(flags.get("--tp_size", 1)),
        pp=int(flags.get("--pp_size", 1)),
        kv_multiplier=int(flags.get("--kv_size_multiplier", 1)),
        kv_replication={"trn1": "interleaved", "trn2": "blocked"}[backend],
        qkv=qkv,
    )


def test_layout_from_args_parses_nxd_flags():
    """The flag parser itself (so a parsing slip cannot make the golden tests vacuous)."""
    assert layout_from_args("--tp_size 8 --pp_size 2 --qkv_linear True") == Layout(tp=8, pp=2, qkv="gqa")
    assert layout_from_args("--tp_size 4 --pp_size 3 --coalesce_qkv True") == Layout(tp=4, pp=3, qkv="coalesced")
    assert layout_from_args("--tp_size 2 --pp_size 2") == Layout(tp=2, pp=2, qkv="separate")
    assert layout_from_args("--tp_size 16 --pp_size 2 --qkv_linear True --kv_size_multiplier 2") == Layout(
        tp=16, pp=2, qkv="gqa", kv_multiplier=2, kv_replication="interleaved"
    )
    assert layout_from_args("--tp_size 4 --qkv_linear True --fuse_qkv True --hw_backend trn2").qkv == "fused"
    with pytest.raises(AssertionError):
        layout_from_args("--tp_size 4 --mystery_flag 3")


def model_table(golden: Path) -> dict[str, str]:
    """case -> model, from the table in golden/README.md."""
    table = {}
    for line in (golden / "README.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] and cells[1]:
            model = cells[1].split()[0]
            if (golden / "hf" / model).is_dir():
                table[cells[0]] = model
    return table


def case_info(case: str, sub: str = "nxd") -> tuple[Path, Path, str, Layout]:
    """(golden root, case dir, model name, layout) of a golden case; skips without the golden folder."""
    golden = golden_or_skip()
    case_dir = golden / sub / case
    table = model_table(golden)
    assert case in table, f"golden/README.md's table names no model for case {case}"
    return golden, case_dir, table[case], layout_from_args((case_dir / "args.txt").read_text())


def load_torch(path: Path) -> dict[str, torch.Tensor]:
    sd = torch.load(path, map_location="cpu", weights_only=True)
    assert isinstance(sd, dict), f"{path} is not a state dict"
    return sd


def rank_files(model_dir: Path) -> dict[str, Path]:
    """name -> path of the rank files (*.pt, not xser .info.pt side files) in a model/ folder."""
    return {
        p.name: p for p in model_dir.iterdir() if p.is_file() and p.suffix == ".pt" and not p.name.endswith(".info.pt")
    }


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert set(got) == set(want), (
        f"{where}: key sets differ; missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"
    )
    for name in want:
        g, w = got[name], want[name]
        assert isinstance(g, torch.Tensor), f"{where}: {name} is a {type(g).__name__}"
        assert g.dtype == w.dtype, f"{where}: {name} dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{where}: {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g, w), f"{where}: {name} values differ"


def assert_dirs_match_golden(out_model: Path, golden_model: Path) -> None:
    got, want = rank_files(out_model), rank_files(golden_model)
    assert want, f"no golden rank files in {golden_model}"
    assert sorted(got) == sorted(want), f"rank file names differ: {sorted(set(got) ^ set(want))[:6]}"
    for name in sorted(want):
        assert_same_tensors(load_torch(got[name]), load_torch(want[name]), name)


class _TensorReference:
    """Stand-in for torch_xla.utils.serialization.TensorReference (reads the xser reference files)."""

    def __init__(self, tid=None):
        self.tid = tid


def load_xser(path: Path) -> dict[str, torch.Tensor]:
    """Resolve an xser file as torch-xla's xser.load does, without shardkit or torch-xla."""
    with torch.serialization.safe_globals([(_TensorReference, "torch_xla.utils.serialization.TensorReference")]):
        refs = torch.load(path, map_location="cpu", weights_only=True)
    out = {}
    for name, value in refs.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            assert isinstance(value, _TensorReference), f"{path}: {name} is a {type(value).__name__}"
            out[name] = torch.load(
                Path(f"{path}.tensors") / f"tensor_{value.tid}.pt", map_location="cpu", weights_only=True
            )
    return out


def hf_weights(golden: Path, model: str) -> dict[str, torch.Tensor]:
    return load_file(golden / "hf" / model / "model.safetensors")


def check_inferred_layout(got: Layout, want: Layout) -> None:
    assert (got.tp, got.pp, got.qkv, got.kv_multiplier) == (want.tp, want.pp, want.qkv, want.kv_multiplier), (
        f"inferred {got.describe()}, NxD wrote {want.describe()}"
    )
    if want.kv_multiplier > 1:
        assert got.kv_replication == want.kv_replication, f"inferred {got.kv_replication} kv replication"


# ---- convert: HF -> the same shards as NxD -------------------------------------------------------


@pytest.mark.parametrize("case", NXD_CASES)
def test_convert_hf_dir_matches_nxd(case, tmp_path):
    golden, case_dir, model, layout = case_info(case)
    out = tmp_path / "shards"
    convert(golden / "hf" / model, out, layout, format="torch")
    assert_dirs_match_golden(out / "model", case_dir / "model")


@pytest.mark.parametrize("case", NXD_CASES)
def test_convert_full_state_dict_file_matches_nxd(case, tmp_path):
    """From the single torch state dict NxD's converter reads (config passed explicitly)."""
    golden, case_dir, model, layout = case_info(case)
    out = tmp_path / "shards"
    convert(
        golden / "hf" / f"{model}.full.pt", out, layout, format="torch", config=golden / "hf" / model / "config.json"
    )
    assert_dirs_match_golden(out / "model", case_dir / "model")


@pytest.mark.parametrize("case", XSER_CASES)
def test_convert_to_xser_matches_nxd_xser(case, tmp_path):
    """shardkit's xser output resolves (as torch-xla would) to the tensors of NxD's xser files."""
    golden, case_dir, model, layout = case_info(case, "nxd-xser")
    out = tmp_path / "shards"
    convert(golden / "hf" / model, out, layout, format="xser")
    got, want = rank_files(out / "model"), rank_files(case_dir / "model")
    assert sorted(got) == sorted(want)
    for name in sorted(want):
        assert Path(f"{got[name]}.tensors").is_dir(), f"{name} has no .tensors folder"
        assert_same_tensors(load_xser(got[name]), load_xser(want[name]), name)


# ---- merge: NxD shards -> the original HF weights ------------------------------------------------


@pytest.mark.parametrize("case", NXD_CASES)
def test_merge_nxd_shards_gives_hf_weights(case, tmp_path):
    golden, case_dir, model, layout = case_info(case)
    config = golden / "hf" / model / "config.json"
    ckpt = open_checkpoint(case_dir, config=config)
    assert ckpt.format == "torch"
    check_inferred_layout(ckpt.layout, layout)

    out = tmp_path / "merged"
    merge(case_dir, out, config=config)
    assert (out / "config.json").is_file()
    assert not (out / "model.safetensors.index.json").exists()
    assert_same_tensors(load_file(out / "model.safetensors"), hf_weights(golden, model), f"merged {case}")


# ---- xser: torch-xla's serialization of the same shards ------------------------------------------


@pytest.mark.parametrize("case", XSER_CASES)
def test_xser_golden_opens_as_xser_and_merges(case, tmp_path):
    golden, case_dir, model, layout = case_info(case, "nxd-xser")
    config = golden / "hf" / model / "config.json"
    ckpt = open_checkpoint(case_dir, config=config)
    assert ckpt.format == "xser"
    check_inferred_layout(ckpt.layout, layout)

    out = tmp_path / "merged"
    merge(case_dir, out, config=config)
    assert_same_tensors(load_file(out / "model.safetensors"), hf_weights(golden, model), f"merged xser {case}")


@pytest.mark.parametrize("case", XSER_CASES)
def test_xser_rank_files_equal_torch_golden(case):
    """Each xser rank file holds the tensors of the torch-form golden file of the same name."""
    golden, case_dir, _, _ = case_info(case, "nxd-xser")
    torch_dir = golden / "nxd" / case / "model"
    xser_files, torch_files = rank_files(case_dir / "model"), rank_files(torch_dir)
    assert xser_files and sorted(xser_files) == sorted(torch_files)
    for name in sorted(torch_files):
        assert_same_tensors(load_xser(xser_files[name]), load_torch(torch_files[name]), f"xser {name}")


@pytest.mark.parametrize("case", XSER_CASES)
def test_xser_rank_files_read_by_shardkit(case):
    """shardkit's own xser reader gives, for every rank file, the torch-form golden tensors."""
    from shardkit.formats.xser import load as xser_load

    golden, case_dir, _, _ = case_info(case, "nxd-xser")
    torch_dir = golden / "nxd" / case / "model"
    for name, path in sorted(rank_files(case_dir / "model").items()):
        assert_same_tensors(dict(xser_load(path)), load_torch(torch_dir / name), f"shardkit xser {name}")


def test_every_golden_case_has_a_model():
    """Guard: the README table and args.txt cover every case (else the tests above would skip)."""
    golden = golden_or_skip()
    table = model_table(golden)
    for sub, cases in (("nxd", NXD_CASES), ("nxd-xser", XSER_CASES)):
        assert cases, f"no golden cases under {sub}"
        for case in cases:
            assert case in table, f"{sub}/{case} is not in golden/README.md's table"
            assert re.search(r"--tp_size\s+\d+", (golden / sub / case / "args.txt").read_text())
