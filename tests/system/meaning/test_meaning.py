"""Shards must COMPUTE what the Hugging Face model computes, not only round-trip bytes.

Every forward here is written the way a tensor-parallel trainer runs it: tp rank r reads only its
own rank file (`model/dp_rank_00_tp_rank_RR_pp_rank_SS.pt`), unpacks its local q/k/v by name for
the qkv style, attends with its local q heads against its local kv heads (standard repeat_kv
grouping inside the rank), and produces row-parallel partial outputs (o_proj, down_proj) that are
summed over the tp ranks (an all-reduce); replicated biases and residuals are added once.

Nothing here asks shardkit which heads a rank holds (no Layout.q_heads / kv_entries / placements):
the only knowledge used is the public NxD convention (names, local sizes, partition dims), so the
tests check that the written shards *mean* the right thing.

1. one decoder layer, many layouts, single process (all-reduce = a Python sum), plus negative
   controls that prove the comparison can fail, plus a direct check of the kv replica order
   (which a forward cannot see) against FORMATS.md;
2. the same with real torch.distributed gloo process groups, one process per tp rank;
3. the whole model stage by stage (vocab-parallel embedding and lm_head), then merge back and
   reload with transformers: logits bit-identical.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import stage_layers

from shardkit import Layout, convert, merge

ATOL_LAYER = 1e-5
ATOL_LOGITS = 1e-4
FILE = "dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
BATCH, SEQ = 2, 7

# Names of the local q/k/v tensors by qkv style (NxD conventions, FORMATS.md); a single name means
# the rank's q, k and v pieces are concatenated along rows.
QKV_WEIGHTS = {
    "separate": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "gqa": ("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v"),
    "fused": ("qkv_proj.weight_qkv",),
    "coalesced": ("qkv_proj.weight",),
}
QKV_BIASES = {
    "separate": ("q_proj.bias", "k_proj.bias", "v_proj.bias"),
    "gqa": ("qkv_proj.bias_q", "qkv_proj.bias_k", "qkv_proj.bias_v"),
    "fused": ("qkv_proj.bias_qkv",),
    "coalesced": ("qkv_proj.bias",),
}


# ---- model dimensions, read from config.json (not from shardkit) -------------------------------


class Dims:
    def __init__(self, config: dict):
        self.hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.inter = config["intermediate_size"]
        self.vocab = config["vocab_size"]
        self.layers = config["num_hidden_layers"]
        self.eps = config["rms_norm_eps"]
        self.attention_bias = bool(config.get("attention_bias", False))
        self.mlp_bias = bool(config.get("mlp_bias", False))
        rope = config.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def read_dims(hf_dir: Path) -> Dims:
    return Dims(json.loads((Path(hf_dir) / "config.json").read_text()))


# ---- reading rank files ------------------------------------------------------------------------


def rank_file(shard_dir: Path, tp: int, pp: int) -> Path:
    return Path(shard_dir) / "model" / FILE.format(tp=tp, pp=pp)


def load_rank(shard_dir: Path, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """What tp rank `tp` of stage `pp` loads: its own file, nothing else."""
    sd = torch.load(rank_file(shard_dir, tp, pp), map_location="cpu", weights_only=True)
    assert isinstance(sd, dict) and all(isinstance(v, torch.Tensor) for v in sd.values())
    return sd


def layers_in(sd: dict) -> set[int]:
    return {int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")}


def load_stages(shard_dir: Path, dims: Dims, layout: Layout) -> list[list[dict]]:
    """Every stage's rank dicts ([stage][tp], each loaded from that rank's own file), after checking:
    exactly tp*pp files, each stage's files holding exactly that stage's layers (global index)."""
    names = sorted(p.name for p in (Path(shard_dir) / "model").iterdir())
    assert names == sorted(FILE.format(tp=t, pp=p) for t in range(layout.tp) for p in range(layout.pp))
    stages = [[load_rank(shard_dir, tp, pp) for tp in range(layout.tp)] for pp in range(layout.pp)]
    for pp, layers in enumerate(stage_layers(dims.layers, layout.pp)):
        for tp in range(layout.tp):
            sd = stages[pp][tp]
            assert layers_in(sd) == set(layers), (tp, pp)
            assert ("model.embed_tokens.weight" in sd) == (pp == 0)
            assert ("model.norm.weight" in sd) == (pp == layout.pp - 1)
            assert ("lm_head.weight" in sd) == (pp == layout.pp - 1)
    return stages


# ---- the tensor-parallel forward, per rank ------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-b, a), dim=-1)


def rope_cos_sin(dims: Dims, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Default Llama rotary embedding, computed from config numbers (rotary buffers are not shards)."""
    d = dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    """Additive (batch, 1, seq, seq) mask: 0 on and below the diagonal, dtype min above."""
    upper = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    mask = torch.zeros(seq, seq).masked_fill(upper, torch.finfo(torch.float32).min)
    return mask[None, None].expand(batch, 1, seq, seq)


def local_sizes(dims: Dims, layout: Layout) -> tuple[int, int]:
    """(local q heads, local kv heads) of every tp rank."""
    return dims.heads // layout.tp, dims.kv_heads * layout.kv_multiplier // layout.tp


def unpack_qkv(sd: dict, prefix: str, dims: Dims, layout: Layout):
    """The rank's local (wq, wk, wv, bq, bk, bv) by name for the qkv style (biases None if absent)."""
    nq, nkv = local_sizes(dims, layout)
    q_rows, kv_rows = nq * dims.head_dim, nkv * dims.head_dim
    attn = prefix + "self_attn."
    expected = {attn + n for n in QKV_WEIGHTS[layout.qkv]} | {attn + "o_proj.weight"}
    if dims.attention_bias:
        expected |= {attn + n for n in QKV_BIASES[layout.qkv]} | {attn + "o_proj.bias"}
    assert {k for k in sd if k.startswith(attn)} == expected, f"unexpected attention names for {layout.qkv}"

    def split(names, what):
        if len(names) == 3:
            parts = [sd[attn + n] for n in names]
        else:
            fused = sd[attn + names[0]]
            assert fused.shape[0] == q_rows + 2 * kv_rows, (what, tuple(fused.shape))
            parts = list(torch.split(fused, [q_rows, kv_rows, kv_rows], dim=0))
        assert [p.shape[0] for p in parts] == [q_rows, kv_rows, kv_rows], (what, [tuple(p.shape) for p in parts])
        return parts

    wq, wk, wv = split(QKV_WEIGHTS[layout.qkv], "weight")
    bq = bk = bv = None
    if dims.attention_bias:
        bq, bk, bv = split(QKV_BIASES[layout.qkv], "bias")
    return wq, wk, wv, bq, bk, bv


def attention_partial(sd, layer, x, cos, sin, mask, dims: Dims, layout: Layout, qkv=None) -> torch.Tensor:
    """Rank-local attention: row-parallel o_proj partial output (no o_proj bias: it is added once)."""
    prefix = f"model.layers.{layer}."
    wq, wk, wv, bq, bk, bv = qkv if qkv is not None else unpack_qkv(sd, prefix, dims, layout)
    h = rms_norm(x, sd[prefix + "input_layernorm.weight"], dims.eps)
    B, S, _ = x.shape
    d = dims.head_dim
    q = F.linear(h, wq, bq).view(B, S, -1, d).transpose(1, 2)
    k = F.linear(h, wk, bk).view(B, S, -1, d).transpose(1, 2)
    v = F.linear(h, wv, bv).view(B, S, -1, d).transpose(1, 2)
    nq, nkv = q.shape[1], k.shape[1]
    assert nq % nkv == 0
    c, s = cos[:, None], sin[:, None]
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    # local q head i attends with local kv head i // (nq / nkv): repeat_kv inside the rank
    k = k.repeat_interleave(nq // nkv, dim=1)
    v = v.repeat_interleave(nq // nkv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * d**-0.5 + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, nq * d)
    wo = sd[prefix + "self_attn.o_proj.weight"]
    assert wo.shape == (dims.hidden, nq * d), tuple(wo.shape)
    return out @ wo.T


def mlp_partial(sd, layer, x1, dims: Dims, layout: Layout) -> torch.Tensor:
    """Rank-local MLP: gate_up column parallel (first half gate, second up), down row parallel."""
    prefix = f"model.layers.{layer}."
    inter_local = dims.inter // layout.tp
    h = rms_norm(x1, sd[prefix + "post_attention_layernorm.weight"], dims.eps)
    w = sd[prefix + "mlp.gate_up_proj.weight"]
    assert w.shape == (2 * inter_local, dims.hidden), tuple(w.shape)
    b = sd[prefix + "mlp.gate_up_proj.bias"] if dims.mlp_bias else None
    assert (prefix + "mlp.gate_up_proj.bias" in sd) == dims.mlp_bias
    gate, up = F.linear(h, w, b).split(inter_local, dim=-1)
    down = sd[prefix + "mlp.down_proj.weight"]
    assert down.shape == (dims.hidden, inter_local), tuple(down.shape)
    return (F.silu(gate) * up) @ down.T


def replicated_bias(sd, name: str, present: bool):
    assert (name in sd) == present, name
    return sd[name] if present else None


def layer_forward_tp(rank_sds, layer, x, cos, sin, mask, dims, layout, qkv_override=None) -> torch.Tensor:
    """One decoder layer from a stage's rank dicts; the all-reduce is a sum over ranks."""
    prefix = f"model.layers.{layer}."
    for name in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.bias",
        "mlp.down_proj.bias",
    ):
        if prefix + name in rank_sds[0]:  # replicated tensors are the same on every rank
            assert all(torch.equal(sd[prefix + name], rank_sds[0][prefix + name]) for sd in rank_sds), name
    attn = sum(
        attention_partial(
            sd, layer, x, cos, sin, mask, dims, layout, qkv=None if qkv_override is None else qkv_override[r]
        )
        for r, sd in enumerate(rank_sds)
    )
    o_bias = replicated_bias(rank_sds[0], prefix + "self_attn.o_proj.bias", dims.attention_bias)
    if o_bias is not None:
        attn = attn + o_bias  # once, after the all-reduce
    x1 = x + attn
    mlp = sum(mlp_partial(sd, layer, x1, dims, layout) for sd in rank_sds)
    d_bias = replicated_bias(rank_sds[0], prefix + "mlp.down_proj.bias", dims.mlp_bias)
    if d_bias is not None:
        mlp = mlp + d_bias
    return x1 + mlp


# ---- the Hugging Face reference ------------------------------------------------------------------

_HF_CACHE: dict = {}


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
        _HF_CACHE[key] = model.eval()
    return _HF_CACHE[key]


def hf_layer_io(model, layer: int, seed: int = 1234):
    """A seeded hidden-state input, HF's own rotary embeddings and mask, and HF's layer output."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed + layer)
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=g)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    cos, sin = model.model.rotary_emb(x, position_ids)
    mask = causal_mask(BATCH, SEQ)
    with torch.no_grad():
        out = model.model.layers[layer](
            x, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin)
        )
    if isinstance(out, tuple):
        out = out[0]
    return x, cos, sin, mask, out


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory):
    """sharded(config_name, **layout) -> (hf_dir, shard_dir, Layout), converted once per module."""
    cache: dict = {}

    def build(name: str, **layout_kw):
        layout = Layout(**layout_kw)
        key = (name, layout)
        if key not in cache:
            hf_dir = tiny_model(name)
            dst = tmp_path_factory.mktemp(f"{name}-shards") / "out"
            convert(hf_dir, dst, layout)
            cache[key] = (hf_dir, dst, layout)
        return cache[key]

    return build


def stage_rank_dicts(shard_dir, layout, stage):
    return [load_rank(shard_dir, tp, stage) for tp in range(layout.tp)]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ---- 1. one decoder layer, single process -------------------------------------------------------

LAYER_CASES = [
    ("llama-gqa64", dict(tp=32, pp=4, kv_multiplier=4, kv_replication="interleaved", qkv="gqa")),
    ("llama-gqa64", dict(tp=32, pp=4, kv_multiplier=4, kv_replication="blocked", qkv="gqa")),
    ("llama-gqa64", dict(tp=32, pp=4, kv_multiplier=4, kv_replication="interleaved", qkv="fused")),
    ("llama-gqa64", dict(tp=32, pp=4, kv_multiplier=4, kv_replication="blocked", qkv="separate")),
    ("llama-gqa64", dict(tp=16, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="gqa")),
    ("llama-gqa64", dict(tp=16, pp=2, kv_multiplier=2, kv_replication="blocked", qkv="gqa")),
    ("llama-gqa64", dict(tp=16, pp=3, kv_multiplier=2, kv_replication="interleaved", qkv="separate")),
    ("llama-gqa64", dict(tp=16, pp=1, kv_multiplier=2, kv_replication="blocked", qkv="fused")),
    ("llama-gqa64", dict(tp=8, pp=2, kv_multiplier=1, qkv="separate")),
    ("llama-gqa64", dict(tp=8, pp=1, kv_multiplier=1, qkv="fused")),
    # kv heads > tp with replication: several (kv head, replica) entries per rank
    ("llama-gqa64", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="gqa")),
    ("llama-gqa64", dict(tp=4, pp=1, kv_multiplier=2, kv_replication="blocked", qkv="fused")),
    ("llama-kv8-tied", dict(tp=4, pp=2, qkv="gqa")),
    ("llama-kv8-tied", dict(tp=2, pp=1, qkv="fused")),
    ("llama-mha", dict(tp=4, pp=1, qkv="coalesced")),
    ("llama-mha", dict(tp=2, pp=3, qkv="separate")),
    ("llama-bias", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="blocked", qkv="fused")),
    ("llama-bias", dict(tp=4, pp=1, kv_multiplier=2, kv_replication="interleaved", qkv="fused")),
    ("llama-bias", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="gqa")),
    ("llama-bias", dict(tp=4, pp=1, kv_multiplier=2, kv_replication="blocked", qkv="gqa")),
    ("llama-bias", dict(tp=2, pp=1, kv_multiplier=1, qkv="separate")),
]


def case_id(case) -> str:
    name, kw = case
    rep = f"-m{kw.get('kv_multiplier', 1)}{kw.get('kv_replication', 'interleaved')[0]}"
    return f"{name}-tp{kw['tp']}-pp{kw['pp']}{rep}-{kw['qkv']}"


@pytest.mark.parametrize("case", LAYER_CASES, ids=case_id)
def test_layer_forward_matches_hf(case, sharded):
    name, kw = case
    hf_dir, shard_dir, layout = sharded(name, **kw)
    dims = read_dims(hf_dir)
    stage_sds = load_stages(shard_dir, dims, layout)
    model = hf_model(hf_dir)
    for stage, layers in enumerate(stage_layers(dims.layers, layout.pp)):
        rank_sds = stage_sds[stage]  # the stage's tp ranks, each from its own file
        for layer in layers:
            x, cos, sin, mask, expected = hf_layer_io(model, layer)
            got = layer_forward_tp(rank_sds, layer, x, cos, sin, mask, dims, layout)
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, atol=ATOL_LAYER, rtol=1e-5), (
                f"layer {layer} (stage {stage}): max |diff| {max_diff(got, expected):.3g}"
            )


# ---- the replica order itself ------------------------------------------------------------------
# A forward cannot tell which rank holds which kv replica (any consistent relabelling of q, k, v and
# o over ranks computes the same thing), but NxD groups replicas by the hardware convention, so the
# order is checked directly against FORMATS.md, from the HF tensors, without shardkit's functions.

REPLICA_CASES = (
    [
        ("llama-gqa64", dict(tp=32, pp=4, kv_multiplier=4, kv_replication=rep, qkv="gqa"))
        for rep in ("interleaved", "blocked")
    ]
    + [
        ("llama-gqa64", dict(tp=16, pp=2, kv_multiplier=2, kv_replication=rep, qkv="gqa"))
        for rep in ("interleaved", "blocked")
    ]
    + [
        ("llama-gqa64", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="gqa")),
        ("llama-bias", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="blocked", qkv="fused")),
        ("llama-bias", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="gqa")),
    ]
)


@pytest.mark.parametrize("case", REPLICA_CASES, ids=case_id)
def test_kv_replica_order_follows_formats(case, sharded):
    from safetensors.torch import load_file

    name, kw = case
    hf_dir, shard_dir, layout = sharded(name, **kw)
    dims = read_dims(hf_dir)
    full = load_file(str(Path(hf_dir) / "model.safetensors"))
    kv, m, t, d = dims.kv_heads, layout.kv_multiplier, layout.tp, dims.head_dim
    # the replicated kv head order: interleaved = `repeat`, blocked = `repeat_interleave`
    order = list(range(kv)) * m if layout.kv_replication == "interleaved" else [h for h in range(kv) for _ in range(m)]
    replica = (
        [i // kv for i in range(kv * m)] if layout.kv_replication == "interleaved" else [i % m for i in range(kv * m)]
    )
    per_rank, group, serve = kv * m // t, dims.heads // kv, dims.heads // (kv * m)
    layer = stage_layers(dims.layers, layout.pp)[-1][-1]
    attn = f"model.layers.{layer}.self_attn."

    def rows(tensor, heads):
        return torch.cat([tensor[h * d : (h + 1) * d] for h in heads], dim=0)

    for r in range(t):
        sd = load_rank(shard_dir, r, layout.pp - 1)
        wq, wk, wv, bq, bk, bv = unpack_qkv(sd, f"model.layers.{layer}.", dims, layout)
        entries = range(r * per_rank, (r + 1) * per_rank)
        kv_heads = [order[i] for i in entries]
        q_heads = [order[i] * group + replica[i] * serve + j for i in entries for j in range(serve)]
        assert torch.equal(wk, rows(full[attn + "k_proj.weight"], kv_heads)), r
        assert torch.equal(wv, rows(full[attn + "v_proj.weight"], kv_heads)), r
        assert torch.equal(wq, rows(full[attn + "q_proj.weight"], q_heads)), r
        assert torch.equal(sd[attn + "o_proj.weight"], rows(full[attn + "o_proj.weight"].T, q_heads).T), r
        if dims.attention_bias:
            assert torch.equal(bk, rows(full[attn + "k_proj.bias"], kv_heads)), r
            assert torch.equal(bq, rows(full[attn + "q_proj.bias"], q_heads)), r


# ---- negative controls: the comparison above must be able to fail ---------------------------------


def _mismatch(name, layout_kw, tamper, sharded):
    """Run layer 0 with tampered rank dicts; return (max diff tampered, max diff honest)."""
    hf_dir, shard_dir, layout = sharded(name, **layout_kw)
    dims = read_dims(hf_dir)
    model = hf_model(hf_dir)
    layer = 0
    x, cos, sin, mask, expected = hf_layer_io(model, layer)
    rank_sds = stage_rank_dicts(shard_dir, layout, 0)
    honest = layer_forward_tp(rank_sds, layer, x, cos, sin, mask, dims, layout)
    qkv = [unpack_qkv(sd, f"model.layers.{layer}.", dims, layout) for sd in rank_sds]
    rank_sds, qkv = tamper(rank_sds, qkv, dims, layout, sharded)
    bad = layer_forward_tp(rank_sds, layer, x, cos, sin, mask, dims, layout, qkv_override=qkv)
    return max_diff(bad, expected), max_diff(honest, expected)


def test_negative_nxd_trn2_bug_kv_interleaved_q_blocked(sharded):
    """NxD's converter with Trn2 and m > 1: K/V in interleaved order but Q (and o) in blocked order.
    Emulated from shardkit's own files: q/o from the blocked set, k/v from the interleaved set."""
    kw = dict(tp=16, pp=2, kv_multiplier=2, qkv="gqa")

    def tamper(rank_sds, qkv, dims, layout, sharded):
        _, inter_dir, inter_layout = sharded("llama-gqa64", kv_replication="interleaved", **kw)
        out = []
        for r, (wq, _wk, _wv, bq, bk, bv) in enumerate(qkv):
            isd = load_rank(inter_dir, r, 0)
            iwq, iwk, iwv, _, _, _ = unpack_qkv(isd, "model.layers.0.", dims, inter_layout)
            out.append((wq, iwk, iwv, bq, bk, bv))
        assert any(not torch.equal(a[1], b[1]) for a, b in zip(qkv, out))
        return rank_sds, out

    bad, honest = _mismatch("llama-gqa64", dict(kv_replication="blocked", **kw), tamper, sharded)
    assert honest <= ATOL_LAYER
    assert bad > 1e-2, f"mixed-order shards still matched HF (max diff {bad:.3g}): the test cannot fail"


def test_negative_swapped_rank_k_pieces(sharded):
    """Swap two ranks' k pieces in a blocked shard set: output must no longer match."""

    def tamper(rank_sds, qkv, dims, layout, sharded):
        qkv = [list(t) for t in qkv]
        a, b = 0, layout.tp - 1
        assert not torch.equal(qkv[a][1], qkv[b][1])
        qkv[a][1], qkv[b][1] = qkv[b][1], qkv[a][1]
        return rank_sds, [tuple(t) for t in qkv]

    bad, honest = _mismatch(
        "llama-gqa64", dict(tp=16, pp=2, kv_multiplier=2, kv_replication="blocked", qkv="gqa"), tamper, sharded
    )
    assert honest <= ATOL_LAYER
    assert bad > 1e-2, f"swapped k pieces still matched HF (max diff {bad:.3g})"


def test_negative_contiguous_q_order_on_interleaved_shards(sharded):
    """Read an interleaved m=2 shard set as if each rank held q heads in naive contiguous order
    (rank r: heads r*q/tp ...): q and o columns from a plain contiguous split of the HF weights."""
    from safetensors.torch import load_file

    def tamper(rank_sds, qkv, dims, layout, sharded):
        hf_dir, _, _ = sharded("llama-gqa64", **kw)
        full = load_file(str(Path(hf_dir) / "model.safetensors"))
        rows = dims.heads // layout.tp * dims.head_dim
        new_sds, new_qkv = [], []
        for r, (sd, t) in enumerate(zip(rank_sds, qkv)):
            sl = slice(r * rows, (r + 1) * rows)
            sd = dict(sd)
            sd["model.layers.0.self_attn.o_proj.weight"] = full["model.layers.0.self_attn.o_proj.weight"][:, sl]
            new_qkv.append((full["model.layers.0.self_attn.q_proj.weight"][sl],) + tuple(t[1:]))
            new_sds.append(sd)
        return new_sds, new_qkv

    kw = dict(tp=16, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="gqa")
    bad, honest = _mismatch("llama-gqa64", kw, tamper, sharded)
    assert honest <= ATOL_LAYER
    assert bad > 1e-2, f"contiguous q order still matched HF on interleaved shards (max diff {bad:.3g})"


def test_negative_within_rank_q_head_order(sharded):
    """kv 8 at tp 4: each rank holds 2 kv heads; reversing the local q head order pairs local q heads
    with the wrong local kv head."""

    def tamper(rank_sds, qkv, dims, layout, sharded):
        d = dims.head_dim
        out = []
        for wq, *rest in qkv:
            heads = wq.view(-1, d, wq.shape[1]).flip(0).reshape_as(wq)
            out.append((heads, *rest))
        new_sds = []
        for sd in rank_sds:  # o columns follow q, so the only error left is the q<->kv pairing
            sd = dict(sd)
            wo = sd["model.layers.0.self_attn.o_proj.weight"]
            sd["model.layers.0.self_attn.o_proj.weight"] = wo.view(wo.shape[0], -1, d).flip(1).reshape_as(wo)
            new_sds.append(sd)
        return new_sds, out

    bad, honest = _mismatch("llama-kv8-tied", dict(tp=4, pp=2, qkv="gqa"), tamper, sharded)
    assert honest <= ATOL_LAYER
    assert bad > 1e-2, f"reversed local q heads still matched HF (max diff {bad:.3g})"


# ---- 2. real torch.distributed (gloo), one process per tp rank ---------------------------------------

DIST_TIMEOUT_S = 120


def _dist_worker(rank: int, world: int, init_method: str, jobs: list[dict], result_dir: str) -> None:
    """One tp rank of a real gloo process group. For each job it loads only its own rank file of the
    job's stage, runs the stage's layers with all-reduced partial outputs, and compares with HF."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        report = {"rank": rank}
        for job in jobs:
            io = torch.load(job["io"], weights_only=True)
            dims = Dims(io["config"])
            layout = Layout(**job["layout"])
            assert layout.tp == world
            sd = load_rank(Path(job["shards"]), rank, job["stage"])
            assert layers_in(sd) == set(io["layers"])
            x = io["x"]
            lone = None  # this rank's partials without the all-reduce: must NOT match
            for layer in io["layers"]:
                prefix = f"model.layers.{layer}."
                attn = attention_partial(sd, layer, x, io["cos"], io["sin"], io["mask"], dims, layout)
                if lone is None:
                    lone = attn.clone()
                dist.all_reduce(attn, op=dist.ReduceOp.SUM)
                if dims.attention_bias:
                    attn = attn + sd[prefix + "self_attn.o_proj.bias"]  # once, after the all-reduce
                x1 = x + attn
                mlp = mlp_partial(sd, layer, x1, dims, layout)
                dist.all_reduce(mlp, op=dist.ReduceOp.SUM)
                if dims.mlp_bias:
                    mlp = mlp + sd[prefix + "mlp.down_proj.bias"]
                x = x1 + mlp
            diff = (x - io["expected"]).abs().max().item()
            report[job["name"]] = diff
            assert torch.allclose(x, io["expected"], atol=ATOL_LAYER, rtol=1e-5), (
                f"{job['name']} rank {rank}: max |diff| {diff:.3g}"
            )
            # without the sum over ranks one rank's attention is far from the full attention output
            full_attn = io["attn0"]
            if dims.attention_bias:
                full_attn = full_attn - sd[f"model.layers.{io['layers'][0]}.self_attn.o_proj.bias"]
            assert (lone - full_attn).abs().max().item() > 1e-2, "one rank's partial equals the full output"
        dist.barrier()
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _run_workers(fn, args, nprocs: int, timeout: float) -> None:
    """torch.multiprocessing's processes with a deadline; a child's exception or exit fails the
    caller (ProcessContext.join raises and terminates the remaining children). They are forked from
    the tests' fork server, which has imported torch and transformers once for them all."""
    import torch.multiprocessing as mp
    from trainer_helpers import fork_server

    fork_server()
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed workers did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


DIST_CASES = [
    ("llama-gqa64", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="blocked", qkv="gqa")),
    ("llama-bias", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="interleaved", qkv="fused")),
]


def test_layer_forward_torch_distributed_gloo(sharded, tmp_path):
    """tp 4 worlds over gloo (one process group, several layouts): each process loads only its own
    rank file of the LAST stage and runs that stage's layers; the parent saved HF's output."""
    jobs = []
    for name, layout_kw in DIST_CASES:
        hf_dir, shard_dir, layout = sharded(name, **layout_kw)
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        dims = Dims(config)
        model = hf_model(hf_dir)
        stage = layout.pp - 1
        layers = stage_layers(dims.layers, layout.pp)[stage]
        x, cos, sin, mask, _ = hf_layer_io(model, layers[0])
        expected = x
        with torch.no_grad():
            first = model.model.layers[layers[0]]
            attn0, _ = first.self_attn(first.input_layernorm(x), attention_mask=mask, position_embeddings=(cos, sin))
            for layer in layers:
                expected = model.model.layers[layer](expected, attention_mask=mask, position_embeddings=(cos, sin))
                if isinstance(expected, tuple):
                    expected = expected[0]
        io_path = tmp_path / f"{name}-io.pt"
        torch.save(
            {
                "config": config,
                "layers": layers,
                "x": x,
                "cos": cos,
                "sin": sin,
                "mask": mask.contiguous(),
                "expected": expected,
                "attn0": attn0,
            },
            io_path,
        )
        jobs.append(
            {
                "name": case_id((name, layout_kw)),
                "io": str(io_path),
                "shards": str(shard_dir),
                "stage": stage,
                "layout": layout_kw,
            }
        )
    world = DIST_CASES[0][1]["tp"]
    results = tmp_path / "results"
    results.mkdir()
    init_method = f"file://{tmp_path / 'store'}"
    _run_workers(_dist_worker, (world, init_method, jobs, str(results)), world, DIST_TIMEOUT_S)
    reports = [json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(world)), "not every tp rank reported"
    for r in reports:
        for job in jobs:
            assert r[job["name"]] <= ATOL_LAYER + 1e-5, (r["rank"], job["name"], r[job["name"]])


# ---- 3. the whole model, stage by stage; then merge ----------------------------------------------


def embed_vocab_parallel(rank_sds, ids, dims: Dims, tp: int) -> torch.Tensor:
    """Each rank looks up the ids of its vocab rows [r*V/tp, (r+1)*V/tp), zeros elsewhere; summed."""
    per = dims.vocab // tp
    out = 0
    for r, sd in enumerate(rank_sds):
        w = sd["model.embed_tokens.weight"]
        assert w.shape == (per, dims.hidden), tuple(w.shape)
        local = ids - r * per
        inside = (local >= 0) & (local < per)
        out = out + w[local.clamp(0, per - 1)] * inside[..., None]
    return out


def lm_head_vocab_parallel(rank_sds, h, dims: Dims, tp: int) -> torch.Tensor:
    per = dims.vocab // tp
    norm = rank_sds[0]["model.norm.weight"]
    assert all(torch.equal(sd["model.norm.weight"], norm) for sd in rank_sds)
    h = rms_norm(h, norm, dims.eps)
    pieces = []
    for sd in rank_sds:
        w = sd["lm_head.weight"]
        assert w.shape == (per, dims.hidden), tuple(w.shape)
        pieces.append(h @ w.T)
    return torch.cat(pieces, dim=-1)


def sharded_model_logits(stage_sds, dims: Dims, layout: Layout, ids: torch.Tensor) -> torch.Tensor:
    B, S = ids.shape
    position_ids = torch.arange(S)[None].expand(B, S)
    cos, sin = rope_cos_sin(dims, position_ids)
    mask = causal_mask(B, S)
    h = None
    for stage, layers in enumerate(stage_layers(dims.layers, layout.pp)):
        rank_sds = stage_sds[stage]  # only this stage's files
        if stage == 0:
            h = embed_vocab_parallel(rank_sds, ids, dims, layout.tp)
        for layer in layers:
            h = layer_forward_tp(rank_sds, layer, h, cos, sin, mask, dims, layout)
        if stage == layout.pp - 1:
            return lm_head_vocab_parallel(rank_sds, h, dims, layout.tp)
    raise AssertionError("no last stage")


WHOLE_CASES = [
    ("llama-kv8-tied", dict(tp=4, pp=3, qkv="gqa")),
    ("llama-gqa64", dict(tp=16, pp=4, kv_multiplier=2, kv_replication="interleaved", qkv="fused")),
    ("llama-bias", dict(tp=4, pp=2, kv_multiplier=2, kv_replication="blocked", qkv="fused")),
    ("llama-mha", dict(tp=4, pp=2, qkv="coalesced")),
]


@pytest.mark.parametrize("case", WHOLE_CASES, ids=case_id)
def test_whole_model_logits_and_merge(case, sharded, tmp_path):
    from transformers import AutoModelForCausalLM

    name, kw = case
    hf_dir, shard_dir, layout = sharded(name, **kw)
    dims = read_dims(hf_dir)
    stage_sds = load_stages(shard_dir, dims, layout)
    model = hf_model(hf_dir)
    ids = torch.randint(0, dims.vocab, (BATCH, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(ids).logits
    got = sharded_model_logits(stage_sds, dims, layout, ids)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=ATOL_LOGITS, rtol=1e-4), (
        f"whole-model logits: max |diff| {max_diff(got, expected):.3g}"
    )

    merged = tmp_path / "merged"
    merge(shard_dir, merged)
    back = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager", dtype=torch.float32).eval()
    src_state, back_state = model.state_dict(), back.state_dict()
    assert set(src_state) == set(back_state)
    for k in src_state:
        assert torch.equal(src_state[k], back_state[k]), k
    with torch.no_grad():
        assert torch.equal(back(ids).logits, expected)
