"""`checkpoint.object_writer.save_together`: optimizer and model files written a tensor at a time are the
bytes `save_object` (torch.save of the path, or xser) writes for the same objects held whole."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.object_writer import Deferred, save_object, save_together
from shardkit.checkpoint.zero1 import MASTER, build_optim
from shardkit.formats import torch_io
from shardkit.formats.manifest import file_record

NAMES = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"]
SHAPES = [(7, 3), (3,), (5, 3)]


def _state(seed: int = 0) -> dict[str, dict]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: {
            "exp_avg": torch.randn(shape, generator=g),
            "exp_avg_sq": torch.rand(shape, generator=g),
            MASTER: torch.randn(shape, generator=g),
            "step": 11,
        }
        for n, shape in zip(NAMES, SHAPES)
    }


def _hyper() -> list[dict]:
    betas = (0.9, 0.95)  # one tuple shared by both groups, as an optimizer's defaults share it
    return [
        {"lr": 3e-4, "betas": betas, "eps": 1e-8, "weight_decay": 0.1},
        {"lr": 3e-4, "betas": betas, "eps": 1e-8, "weight_decay": 0.0},
    ]


def _deferred(state: dict[str, dict], reads: list[str]) -> dict[str, dict]:
    def reader(name: str, moment: str, t: torch.Tensor):
        def make() -> torch.Tensor:
            reads.append(f"{moment}:{name}")
            return t.clone()

        return make

    return {
        n: {
            m: Deferred(tuple(v.shape), v.dtype, reader(n, m, v)) if isinstance(v, torch.Tensor) else v
            for m, v in e.items()
        }
        for n, e in state.items()
    }


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _optim_objects(state: dict, dp: int) -> list[dict]:
    return [build_optim(NAMES, [0, 1, 0], _hyper(), state, dp, d, True) for d in range(dp)]


@pytest.mark.parametrize("native", [True, False], ids=["shardkit-zip", "torch-writer"])
@pytest.mark.parametrize("use_xser", [False, True], ids=["torch", "xser"])
def test_dp_files_written_together_are_torch_save_bytes(tmp_path, monkeypatch, native, use_xser):
    if not native:  # what an archive of 4 GiB or more gets: torch's own writer of the path
        monkeypatch.setattr(torch_io, "native_writer", lambda records, bound: False)
    dp = 3
    whole, lazy = tmp_path / "whole", tmp_path / "lazy"
    for d, obj in enumerate(_optim_objects(_state(), dp)):
        save_object(whole / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt", obj, use_xser)
    reads: list[str] = []
    objs = _optim_objects(_deferred(_state(), reads), dp)
    paths = [lazy / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(dp)]
    save_together(paths, objs, use_xser)
    assert _files(lazy) == _files(whole)
    assert len(_files(lazy)) == (dp if not use_xser else dp * (2 + 3 * 4))
    # each source tensor was asked for by every dp file (made once per file: the caller's cache
    # decides whether it is read once), in torch.save's order: the moments, then the masters
    assert reads[: dp * 2] == [f"exp_avg:{NAMES[0]}"] * dp + [f"exp_avg_sq:{NAMES[0]}"] * dp
    assert reads[-dp:] == [f"{MASTER}:{NAMES[1]}"] * dp  # group 1 (the norm) comes after group 0


def test_model_file_written_a_tensor_at_a_time_is_torch_save_bytes(tmp_path):
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in zip(NAMES, SHAPES)}
    save_object(tmp_path / "a" / "dp_rank_00_tp_rank_01_pp_rank_00.pt", weights, False)
    lazy = {n: Deferred(tuple(t.shape), t.dtype, lambda t=t: t.clone()) for n, t in weights.items()}
    save_together([tmp_path / "b" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"], [lazy], False)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    loaded = torch.load(tmp_path / "b" / "dp_rank_00_tp_rank_01_pp_rank_00.pt", weights_only=True)
    assert all(torch.equal(loaded[n], weights[n]) for n in NAMES)


@pytest.mark.parametrize("native", [True, False], ids=["shardkit-zip", "torch-writer"])
def test_a_failing_read_leaves_no_file(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(torch_io, "native_writer", lambda records, bound: False)
    state = _deferred(_state(), [])
    entry = state[NAMES[1]]

    def broken() -> torch.Tensor:
        raise OSError(5, "Input/output error")

    entry["exp_avg_sq"] = Deferred(entry["exp_avg_sq"].shape, torch.float32, broken)
    paths = [tmp_path / "out" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt" for d in range(2)]
    with pytest.raises(OSError, match="Input/output"):
        save_together(paths, _optim_objects(state, 2), False)
    assert not any(p.exists() for p in paths)


def test_a_made_tensor_of_the_wrong_shape_is_refused(tmp_path):
    lazy = {"w": Deferred((2, 3), torch.float32, lambda: torch.zeros(3, 2))}
    with pytest.raises(RuntimeError, match=r"expected \(2, 3\)"):
        save_together([tmp_path / "w.pt"], [lazy], False)
    assert not (tmp_path / "w.pt").exists()


def test_presharded_state_as_save_checkpoint_gives_it(tmp_path):
    """`save_checkpoint`'s optimizer file (its own dp shard, given as tensors) is torch.save's bytes."""
    dp, d = 2, 1
    state = _state()
    shards = {
        n: {k: (v.reshape(-1)[: v.numel() // 2].clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
        for n, e in state.items()
    }
    obj = build_optim(NAMES, [0, 1, 0], _hyper(), shards, dp, d, True, presharded=True, shapes=SHAPES)
    save_object(tmp_path / "a" / "dp_rank_01_tp_rank_00_pp_rank_00.pt", obj, False)
    written = save_together([tmp_path / "b" / "dp_rank_01_tp_rank_00_pp_rank_00.pt"], [obj], False, root=tmp_path / "b")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert [r.path for r in written] == ["dp_rank_01_tp_rank_00_pp_rank_00.pt"]  # a record, hashed as written
    assert written[0] == file_record(tmp_path / "b" / "dp_rank_01_tp_rank_00_pp_rank_00.pt", tmp_path / "b")


def test_ckpt_reshard_keeps_each_weights_stored_dtype(tmp_path):
    """A tag whose norms are kept in fp32 beside bf16 weights (as mixed-precision trainers save
    them) is resharded with every weight in its own dtype and values, read a tensor at a time."""
    import ckpt_child

    from shardkit.checkpoint import Rank, finalize_checkpoint, load_checkpoint, save_checkpoint
    from shardkit.checkpoint.reshard import reshard_training
    from shardkit.layout import Layout
    from shardkit.testing import fixture_config

    config = fixture_config("llama-trainer-tiny")
    full = ckpt_child.full_state(config, 3, seed=2)["weight"]
    full = {n: t.float() if "norm" in n else t.to(torch.bfloat16) for n, t in full.items()}
    tp2 = Layout(tp=2, qkv="gqa")
    model = {(r, 0): ckpt_child.rank_pieces(config, tp2, Rank(tp=r), full) for r in range(2)}
    save_checkpoint(tmp_path / "src", "step_3", model, layout=tp2, config=config)
    finalize_checkpoint()
    out = reshard_training(tmp_path / "src", tmp_path / "tp1", Layout(qkv="gqa"))
    got = load_checkpoint(out.parent, "latest_if_exists", target_layout=Layout(qkv="gqa"))
    assert got is not None
    want = ckpt_child.rank_pieces(config, Layout(qkv="gqa"), Rank(), full)
    assert set(got.model) == set(want)
    for name, t in want.items():
        assert got.model[name].dtype == t.dtype and torch.equal(got.model[name], t), name


def test_ckpt_reshard_runs_on_one_torch_thread_and_gives_the_threads_back(tmp_path, monkeypatch):
    """Its tensor work is copies: torch's OpenMP threads would spin between them, taking CPU from
    the reads, writes and uploads beside them (`io.data.buffers.one_torch_thread`)."""
    import ckpt_child

    from shardkit.checkpoint import Rank, finalize_checkpoint, save_checkpoint
    from shardkit.checkpoint import reshard as reshard_module
    from shardkit.layout import Layout
    from shardkit.testing import fixture_config

    config = fixture_config("llama-trainer-tiny")
    full = ckpt_child.full_state(config, 1, seed=3)["weight"]
    tp2 = Layout(tp=2, qkv="gqa")
    model = {(r, 0): ckpt_child.rank_pieces(config, tp2, Rank(tp=r), full) for r in range(2)}
    save_checkpoint(tmp_path / "src", "step_1", model, layout=tp2, config=config)
    finalize_checkpoint()
    seen, write_rank = [], reshard_module.write_rank

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return write_rank(*args, **kwargs)

    monkeypatch.setattr(reshard_module, "write_rank", counted)
    before = torch.get_num_threads()
    threads = max(2, before)
    torch.set_num_threads(threads)
    try:
        reshard_module.reshard_training(tmp_path / "src", tmp_path / "tp1", Layout(qkv="gqa"))
        assert seen == [1]
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_one_torch_thread_gives_the_threads_back_after_an_error():
    from shardkit.io.data.buffers import one_torch_thread

    before = torch.get_num_threads()
    threads = max(2, before)
    torch.set_num_threads(threads)
    try:
        with pytest.raises(RuntimeError), one_torch_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_a_ckpt_reshard_read_is_copied_only_when_it_is_a_view_of_more():
    """A piece read into its own memory is written as it is (a copy would cost its size again in
    memory and CPU); a view into a larger tensor is copied, so that its storage (what torch.save's
    records hold) is its bytes alone."""
    from shardkit.checkpoint.reshard import _reader

    whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    class Reader:
        def __init__(self, tensor):
            self.tensor = tensor

        def read_piece(self, piece):
            return self.tensor

    assert _reader(Reader(whole), None, None)() is whole  # type: ignore[arg-type]
    view = whole[1:]
    got = _reader(Reader(view), None, None)()  # type: ignore[arg-type]
    assert torch.equal(got, view) and got.untyped_storage().nbytes() == got.numel() * 4
    assert got.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    cast = _reader(Reader(whole), None, torch.bfloat16)()  # type: ignore[arg-type]
    assert cast.dtype == torch.bfloat16 and torch.equal(cast.float(), whole)
