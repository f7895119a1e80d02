"""PyTorch DCP as a format both ways (issue "Interop beyond NxD's default save", part 2).

Every check reads with torch's own DCP (`format_utils.dcp_to_torch_save`) or transformers, and
every torchtitan name and row order is the one written in tests/support/titan_dcp.py from torchtitan's
own adapter (`scripts/check_torchtitan.py` runs the adapter itself where torchtitan is installed).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dcp_helpers import _miscounted, bands, grid, retile, torch_reads
from meaning_helpers import _input_ids, _logits
from safetensors.torch import load_file
from titan_dcp import to_titan

import shardkit
from shardkit.cli import cli
from shardkit.layout import Layout

ROOT = Path(__file__).resolve().parents[3]
SUPPORT = ROOT / "tests" / "support"
MODEL = "tinyllama-mini"
LAYOUTS = {
    "full": Layout(),
    "tp2pp2": Layout(tp=2, pp=2),
    "tp4-kv2-blocked": Layout(tp=4, kv_multiplier=2, kv_replication="blocked"),
}


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "layout, convention",
    [
        ("full", "hf"),
        # torch reads a one-rank torchtitan folder in the main suite: test_large_tensors_are_saved_in_bounded_chunks
        pytest.param("full", "torchtitan", marks=pytest.mark.slow),
        # pp and tp cuts under Hugging Face names: tp4-kv2-blocked-hf and tp2pp2-torchtitan here
        pytest.param("tp2pp2", "hf", marks=pytest.mark.slow),
        ("tp2pp2", "torchtitan"),
        ("tp4-kv2-blocked", "hf"),
        ("tp4-kv2-blocked", "torchtitan"),
    ],
)
def test_convert_to_dcp_holds_every_tensor_as_torch_reads_it(tiny_model, tmp_path, convention, layout):
    """`shardkit convert HF OUT --format dcp`: torch's reader gives every Hugging Face tensor
    exactly, under the convention's names and row order (torchtitan: q/k heads permuted); one
    data file per rank, replicated slices (kv replicas, norms) saved once."""
    src = tiny_model(MODEL)
    config = json.loads((src / "config.json").read_text())
    out = tmp_path / "dcp"
    run = CliRunner().invoke(
        cli,
        ["convert", str(src), str(out), "--format", "dcp", "--convention", convention, *_layout_args(LAYOUTS[layout])],
    )
    assert run.exit_code == 0, run.output
    ranks = LAYOUTS[layout].tp * LAYOUTS[layout].pp
    assert sorted(p.name for p in out.glob("*.distcp")) == sorted(f"__{r}_0.distcp" for r in range(ranks))
    want = hf_state(src)
    if convention == "torchtitan":
        want = to_titan(want, config)
    got = torch_reads(out, tmp_path / "read.pt")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    manifest = json.loads((out / "shardkit.json").read_text())
    assert manifest["format"] == "dcp" and manifest["convention"] == convention
    assert {f["path"] for f in manifest["files"]} >= {".metadata", "__0_0.distcp"}


def _layout_args(layout: Layout) -> list[str]:
    args = ["--tp", str(layout.tp), "--pp", str(layout.pp), "--kv-multiplier", str(layout.kv_multiplier)]
    return args + ["--kv-replication", layout.kv_replication]


def test_merge_of_dcp_gives_the_sources_logits(tiny_model, tmp_path):
    """A torchtitan-named DCP folder (tp2 pp2 chunks) merged back: every tensor and transformers'
    logits identical to the source; inspect says whose names it holds."""
    src = tiny_model(MODEL)
    shardkit.convert(src, tmp_path / "dcp", Layout(tp=2, pp=2), format="dcp", convention="torchtitan")
    run = CliRunner().invoke(cli, ["merge", str(tmp_path / "dcp"), str(tmp_path / "hf")])
    assert run.exit_code == 0, run.output
    merged, source = hf_state(tmp_path / "hf"), hf_state(src)
    assert set(merged) == set(source) and all(torch.equal(merged[k], v) for k, v in source.items())
    ids = _input_ids(json.loads((src / "config.json").read_text())["vocab_size"])
    assert torch.equal(_logits(tmp_path / "hf", ids), _logits(src, ids))
    info = CliRunner().invoke(cli, ["inspect", str(tmp_path / "dcp")])
    assert "torchtitan 0.1-0.2 Llama 3 tensor names" in info.output and "DCP chunks" in info.output
    from shardkit.hub.card import model_card

    card = model_card(tmp_path / "hf", "org/tiny", origin=tmp_path / "dcp")
    assert "a PyTorch DCP checkpoint (torchtitan 0.1-0.2 Llama 3 tensor names, llama family)" in card


@pytest.fixture(scope="module")
def fsdp_dcp(tiny_model, tmp_path_factory):
    """The source model saved as torchtitan saves one: torchtitan's names and row order, sharded by
    FSDP2 over 3 gloo processes (dim-0 chunks that cut o_proj's and down_proj's rows, and q/k rows
    inside heads), by torch's `dcp.save` (tests/support/titan_dcp.py)."""
    from titan_dcp import titan_state

    src = tiny_model(MODEL)
    tmp = tmp_path_factory.mktemp("fsdp")
    state = titan_state(hf_state(src), json.loads((src / "config.json").read_text()), steps=0)
    torch.save(state, tmp / "state.pt")
    done = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "titan_dcp.py"),
            str(tmp / "dcp"),
            str(tmp / "state.pt"),
            str(src / "config.json"),
            "3",
            "--model-only",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return src, tmp / "dcp"


def test_torch_written_fsdp_dcp_merges_and_reshards_exactly(fsdp_dcp, tmp_path):
    """DCP chunks of any cut: merge gives the source's tensors; reshard to NxD tp2 shards gives
    the bytes a convert of the source gives."""
    src, folder = fsdp_dcp
    meta = pickle.loads((folder / ".metadata").read_bytes())
    wo = meta.state_dict_metadata["layers.0.attention.wo.weight"]
    assert [tuple(c.offsets)[0] for c in wo.chunks] == [0, 86, 172]  # 256 rows over 3 ranks
    shardkit.merge(folder, tmp_path / "hf", config=src / "config.json")
    merged, source = hf_state(tmp_path / "hf"), hf_state(src)
    assert set(merged) == set(source) and all(torch.equal(merged[k], v) for k, v in source.items())
    layout = Layout(tp=2, qkv="gqa")
    shardkit.reshard(folder, tmp_path / "from-dcp", layout, config=src / "config.json")
    shardkit.convert(src, tmp_path / "from-hf", layout)
    for f in sorted((tmp_path / "from-hf/model").iterdir()):
        assert f.read_bytes() == (tmp_path / "from-dcp/model" / f.name).read_bytes(), f.name


def test_dcp_reshards_to_dcp_in_another_convention(tiny_model, tmp_path):
    """DCP (Hugging Face names, tp2) -> DCP (torchtitan's, pp2): torch reads the torchtitan
    tensors of the source."""
    src = tiny_model(MODEL)
    config = json.loads((src / "config.json").read_text())
    shardkit.convert(src, tmp_path / "a", Layout(tp=2), format="dcp")
    run = CliRunner().invoke(
        cli,
        [
            "reshard",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--pp",
            "2",
            "--format",
            "dcp",
            "--convention",
            "torchtitan",
        ],
    )
    assert run.exit_code == 0, run.output
    got, want = torch_reads(tmp_path / "b", tmp_path / "b.pt"), to_titan(hf_state(src), config)
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_reading_a_tensor_reads_only_its_chunks(fsdp_dcp, monkeypatch):
    """A tensor is read from the bytes of the chunks it meets (here one per data file), never a
    whole file."""
    from shardkit.formats import SourceReader, open_checkpoint
    from shardkit.io.data import taps
    from shardkit.placements import Segment

    src, folder = fsdp_dcp
    ckpt = open_checkpoint(folder, src / "config.json")
    read: list[int] = []
    real = taps.read_exact

    def counted(fd, view, offset, what, fetcher=None):
        read.append(len(view))
        return real(fd, view, offset, what, fetcher)

    monkeypatch.setattr(taps, "read_exact", counted)
    reader = SourceReader(ckpt)
    try:
        norm = reader.read_segment(Segment("model.norm.weight", 0, 0, 256))
    finally:
        reader.close()
    assert torch.equal(norm, hf_state(src)["model.norm.weight"])
    assert len(read) == 3 and sum(read) == 256 * 4


@pytest.mark.parametrize("damage", ["global", "truncated", "missing"])
def test_bad_dcp_is_one_line_exit_2(tiny_model, tmp_path, damage):
    src = tiny_model(MODEL)
    folder = tmp_path / "dcp"
    shardkit.convert(src, folder, Layout(tp=2), format="dcp")
    if damage == "global":
        (folder / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n(S'true'\ntR.")
    elif damage == "truncated":
        data = folder / "__1_0.distcp"
        data.write_bytes(data.read_bytes()[:-100])
    else:
        (folder / "__0_0.distcp").unlink()
    run = CliRunner().invoke(cli, ["merge", str(folder), str(tmp_path / "out"), "--no-verify-hashes"])
    assert run.exit_code == 2, run.output
    lines = run.output.strip().splitlines()
    assert len(lines) == 1, run.output
    assert {"global": "never runs arbitrary pickle", "truncated": "truncated", "missing": "__0_0.distcp"}[
        damage
    ] in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    not (os.environ.get("TORCHTITAN_SRC") or os.environ.get("TORCHTITAN_PYTHON")),
    reason="torchtitan's files are not here: `python scripts/check_torchtitan.py fetch DIR`, then "
    "TORCHTITAN_SRC=DIR (or TORCHTITAN_PYTHON: a python with torchtitan installed)",
)
@pytest.mark.parametrize("convention", ["torchtitan", "torchtitan-0.3"])
def test_torchtitans_own_adapter_reads_shardkits_dcp(tiny_model, tmp_path, convention):
    """torchtitan's Llama3StateDictAdapter (its own files, from its published wheel or an installed
    torchtitan, run in its own process; 0.2's or 0.3's) maps shardkit's torchtitan-named DCP back to
    the source's Hugging Face tensors and the source to the DCP's tensors (scripts/check_torchtitan.py)."""
    src = tiny_model(MODEL)
    shardkit.convert(src, tmp_path / "dcp", Layout(tp=2, pp=2), format="dcp", convention=convention)
    python = os.environ.get("TORCHTITAN_PYTHON") or sys.executable
    done = subprocess.run(
        [python, str(ROOT / "scripts/check_torchtitan.py"), str(src), str(tmp_path / "dcp")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "torchtitan's adapter agrees" in done.stdout, done.stdout + done.stderr[-3000:]


def test_dcp_convert_under_torchrun_equals_one_process(tiny_model, tmp_path):
    """`convert --format dcp` in a 2-process gloo job (torchrun): the ranks divide the data files,
    rank 0 writes `.metadata` from every rank's records; the folder is byte for byte the
    one-process folder."""
    src = tiny_model(MODEL)
    args = [
        "convert",
        str(src),
        str(tmp_path / "dist"),
        "--format",
        "dcp",
        "--convention",
        "torchtitan",
        "--tp",
        "2",
        "--pp",
        "2",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardkit",
            "-v",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shardkit.convert(src, tmp_path / "one", Layout(tp=2, pp=2), format="dcp", convention="torchtitan")
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "dist").iterdir()) and ".metadata" in names
    for name in names:
        if name != "shardkit.json":  # it records the command line
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "dist" / name).read_bytes(), name


def test_large_tensors_are_saved_in_bounded_chunks(tiny_model, tmp_path, monkeypatch):
    """A slice larger than `dcp.CHUNK_BYTES` is saved as several chunks (whole heads for q/k in
    torchtitan's order): torch reads the same tensors, and a merge gives the source back."""
    from shardkit.formats import dcp

    monkeypatch.setattr(dcp, "CHUNK_BYTES", 64 << 10)
    src = tiny_model(MODEL)
    config = json.loads((src / "config.json").read_text())
    shardkit.convert(src, tmp_path / "dcp", Layout(), format="dcp", convention="torchtitan")
    meta = pickle.loads((tmp_path / "dcp/.metadata").read_bytes()).state_dict_metadata
    assert len(meta["tok_embeddings.weight"].chunks) == 16  # 1024 x 256 fp32 in 64 KiB chunks
    q = meta["layers.0.attention.wq.weight"].chunks
    assert len(q) == 4 and all(c.offsets[0] % 8 == 0 and c.sizes[0] % 8 == 0 for c in q)
    got, want = torch_reads(tmp_path / "dcp", tmp_path / "x.pt"), to_titan(hf_state(src), config)
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    shardkit.merge(tmp_path / "dcp", tmp_path / "hf")
    merged, source = hf_state(tmp_path / "hf"), hf_state(src)
    assert all(torch.equal(merged[k], v) for k, v in source.items())


# ---- chunks must tile their tensor, for any number of chunks ----------------------------------------


TILINGS = {
    "128 rows": lambda shape: [([r, 0], [h, shape[1]]) for r, h in bands(shape[0], 128)],
    "1000 tiles": lambda shape: grid(shape, 40, 25),
}


@pytest.fixture()
def tiny_dcp(tiny_model, tmp_path):
    """A DCP folder of llama-trainer-tiny in Hugging Face's names (one chunk per tensor), and the source."""
    src = tiny_model("llama-trainer-tiny")
    shardkit.convert(src, tmp_path / "dcp", Layout(), format="dcp")
    return src, tmp_path / "dcp"


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_many_chunks_that_tile_a_tensor_are_read_exactly(tiny_dcp, tmp_path, tiling):
    """The embedding saved as 128 row chunks, or a 40 x 25 grid of 1000 uneven tiles: torch's
    reader reads it, and a merge gives the source exactly."""
    src, folder = tiny_dcp
    name = "model.embed_tokens.weight"
    embed = hf_state(src)[name]
    retile(folder, name, TILINGS[tiling](tuple(embed.shape)), embed)
    assert torch.equal(torch_reads(folder, tmp_path / "t.pt")[name], embed)
    run = CliRunner().invoke(cli, ["merge", str(folder), str(tmp_path / "hf")])
    assert run.exit_code == 0, run.output
    merged, source = hf_state(tmp_path / "hf"), hf_state(src)
    assert set(merged) == set(source) and all(torch.equal(merged[k], v) for k, v in source.items())


@pytest.mark.parametrize("command", ["merge", "convert"])
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_chunks_with_one_missing_and_one_twice_are_one_line_exit_2(tiny_dcp, tmp_path, tiling, command):
    """128 or 1000 chunks, one block missing and another listed twice (the volumes add up): the
    missing block would be uninitialised memory. Refused in one line naming the tensor and an
    element in no chunk or in two; nothing written."""
    src, folder = tiny_dcp
    name = "model.embed_tokens.weight"
    embed = hf_state(src)[name]
    retile(folder, name, _miscounted(TILINGS[tiling](tuple(embed.shape))), embed)
    args = [command, str(folder), str(tmp_path / "out")] + (["--tp", "2"] if command == "convert" else [])
    run = CliRunner().invoke(cli, args)
    assert run.exit_code == 2, run.output
    (line,) = run.output.strip().splitlines()
    assert f"the chunks of {name} do not tile its shape [256, 32]: element [" in line
    assert "is in no chunk (a gap)" in line or "is in more than one chunk (an overlap)" in line
    assert not (tmp_path / "out").exists()


def _coverage(shape: tuple[int, ...], boxes: list) -> torch.Tensor:
    count = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return count


def test_tiling_check_is_exact_against_counting_every_element():
    """`tiling_problem` against a brute-force count, on 4000 seeded random sets of boxes in 0-4 axes
    (gaps, overlaps, empty boxes, scalars) and 400 random valid tilings (recursive cuts along any
    axis, shuffled): it accepts exactly the tilings, and the element it names is in no box or in
    several. A pinwheel (no straight cut through it) tiles; 25 axes cut everywhere are refused."""
    from shardkit.formats.dcp_files import tiling_problem

    rng = random.Random(53)
    for _ in range(4000):
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 4)))
        boxes = []
        for _ in range(rng.randint(0, 7)):
            offsets = [rng.randint(0, n) for n in shape]
            boxes.append((offsets, [rng.randint(0, n - o) for o, n in zip(offsets, shape)]))
        count = _coverage(shape, boxes)
        problem = tiling_problem(shape, boxes)
        assert (problem is None) == bool((count == 1).all()), (shape, boxes, problem)
        if problem is not None:
            element = json.loads(problem.split("element ")[1].split(" is ")[0])
            covered = int(count[tuple(element)])
            assert covered == 0 if "no chunk" in problem else covered > 1, (shape, boxes, problem)

    def cut(offsets: list[int], sizes: list[int], depth: int) -> list:
        k = rng.randrange(len(sizes))
        if depth == 0 or sizes[k] < 2 or rng.random() < 0.2:
            return [(offsets, sizes)]
        at = rng.randint(1, sizes[k] - 1)
        upper = [o + (at if i == k else 0) for i, o in enumerate(offsets)]
        return cut(offsets, [at if i == k else s for i, s in enumerate(sizes)], depth - 1) + cut(
            upper, [s - at if i == k else s for i, s in enumerate(sizes)], depth - 1
        )

    for _ in range(400):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 4)))
        tiles = cut([0] * len(shape), list(shape), 7)
        rng.shuffle(tiles)
        assert tiling_problem(shape, tiles) is None, (shape, tiles)
    pinwheel = [([0, 0], [2, 1]), ([2, 0], [1, 2]), ([1, 2], [2, 1]), ([0, 1], [1, 2]), ([1, 1], [1, 1])]
    assert tiling_problem((3, 3), pinwheel) is None
    assert "too many axes" in tiling_problem((3,) * 25, [([0] * 25, [1] * 25)])


def test_tiling_check_takes_100k_chunks():
    """100k chunks along one axis, and a 316 x 316 grid (~100k tiles) cut along two, are proven
    (a pairwise check would be 5e9 pairs: this test would not end); a doubled tile of the grid found.
    How long it takes is measured outside the tests (about 0.2 s and 1.4 s)."""
    from shardkit.formats.dcp_files import tiling_problem

    rows = [([r, 0], [1, 16]) for r in range(100_000)]
    tiles = grid((632, 948), 316, 316)
    assert tiling_problem((100_000, 16), rows) is None and tiling_problem((632, 948), tiles) is None
    assert "do not tile" in tiling_problem((632, 948), _miscounted(tiles))


@pytest.mark.parametrize("size", [[-256, 32], [0, 1 << 70], [1 << 40, 1 << 40]], ids=["negative", "huge-empty", "huge"])
def test_a_tensor_of_an_impossible_shape_is_one_line_exit_2(tiny_dcp, tmp_path, size):
    """`.metadata` giving a tensor a negative size, or more than 2**63 elements on an axis or in all
    (its one chunk as large): refused in one line (no overflow deep in numpy or torch)."""
    src, folder = tiny_dcp
    meta = pickle.loads((folder / ".metadata").read_bytes())
    entry = meta.state_dict_metadata["model.embed_tokens.weight"]
    entry.size = torch.Size(size)
    if min(size) >= 0:  # its one chunk the whole of it, as the metadata says
        entry.chunks[0].sizes = torch.Size(size)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    run = CliRunner().invoke(cli, ["merge", str(folder), str(tmp_path / "out"), "--no-verify-hashes"])
    assert run.exit_code == 2, run.output
    (line,) = run.output.strip().splitlines()
    assert f"model.embed_tokens.weight has the impossible shape {size}" in line
    assert not (tmp_path / "out").exists()
