"""Helpers of the model-family tests (tests/unit/families/test_families.py,
tests/system/golden/test_dbrx_reference.py): transformers' model of a folder, token ids, the
rank files of a layout, and a sharded forward pass computed from rank files only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import stage_layers

from shardkit import Layout

BATCH, SEQ = 2, 9


ATOL = 1e-4


_HF: dict = {}


def fresh(model):
    """The model with every parameter copied out of the memory-mapped file into fresh memory: the
    same values at a different address can round differently in vectorised kernels (seen with
    DBRX: 6e-8 between two loads of equal tensors whose mmap offsets differ mod 64), and the
    logits comparison must see the weights, not where the loader left them."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def load_causal(path: Path):
    from transformers import AutoModelForCausalLM

    return fresh(AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval())


def hf_model(path: Path):
    if str(path) not in _HF:
        _HF[str(path)] = load_causal(path)
    return _HF[str(path)]


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


QKV_WEIGHTS = {
    "separate": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "gqa": ("qkv_proj.weight_q", "qkv_proj.weight_k", "qkv_proj.weight_v"),
    "fused": ("qkv_proj.weight_qkv",),
    "coalesced": ("qkv_proj.weight",),
}


@dataclass
class Spec:
    """What the forward needs, read from config.json (not from shardkit)."""

    config: dict
    hidden: int = 0
    heads: int = 0
    kv: int = 0
    head_dim: int = 0
    inter: int = 0
    vocab: int = 0
    layers: int = 0
    eps: float = 1e-6
    gemma: bool = False
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    norm_topk: bool = False
    norm_p: float | None = None
    layer_norm: bool = False
    clip: float | None = None
    act: object = F.silu
    scale: float = 0.0
    attn_cap: float | None = None
    final_cap: float | None = None
    extra: dict = field(default_factory=dict)
    # rank-file names: NxD's Llama names, or the family's own (DBRX keeps Hugging Face's tree)
    embed: str = "model.embed_tokens.weight"
    layer_prefix: str = "model.layers.{i}."
    attn_scope: str = "self_attn."
    mlp_scope: str = "mlp."
    norm_1: str = "input_layernorm.weight"
    norm_2: str = "post_attention_layernorm.weight"
    final_norm: str = "model.norm.weight"

    @classmethod
    def of(cls, config: dict) -> Spec:
        t = config["model_type"]
        if t == "dbrx":  # DBRX's own config names
            attn, ffn = config["attn_config"], config["ffn_config"]
            s = cls(
                config,
                hidden=config["d_model"],
                heads=config["n_heads"],
                kv=attn["kv_n_heads"],
                head_dim=config["d_model"] // config["n_heads"],
                vocab=config["vocab_size"],
                layers=config["n_layers"],
                eps=1e-5,
                layer_norm=True,
                clip=attn.get("clip_qkv"),
                experts=ffn["moe_num_experts"],
                top_k=ffn["moe_top_k"],
                moe_inter=ffn["ffn_hidden_size"],
                norm_p=ffn.get("moe_normalize_expert_weights"),
                embed="transformer.wte.weight",
                layer_prefix="transformer.blocks.{i}.",
                attn_scope="norm_attn_norm.attn.",
                mlp_scope="ffn.",
                norm_1="norm_attn_norm.norm_1.weight",
                norm_2="norm_attn_norm.norm_2.weight",
                final_norm="transformer.norm_f.weight",
            )
            s.scale = s.head_dim**-0.5
            return s
        s = cls(config)
        s.hidden, s.heads = config["hidden_size"], config["num_attention_heads"]
        s.kv = config.get("num_key_value_heads") or s.heads
        s.head_dim = config.get("head_dim") or s.hidden // s.heads
        s.inter, s.vocab, s.layers = config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
        s.eps = config["rms_norm_eps"]
        s.gemma = t in ("gemma2", "gemma3_text")
        s.qk_norm = t in ("qwen3", "qwen3_moe", "gemma3_text")
        if t == "qwen3_moe":
            s.experts = config.get("num_experts") or config["num_local_experts"]
            s.top_k = config["num_experts_per_tok"]
            s.moe_inter, s.norm_topk = config["moe_intermediate_size"], config["norm_topk_prob"]
        if s.gemma:
            s.act = lambda x: F.gelu(x, approximate="tanh")
            s.scale = config["query_pre_attn_scalar"] ** -0.5
            s.attn_cap, s.final_cap = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
        else:
            s.scale = s.head_dim**-0.5
        return s


def rank_path(shard_dir: Path, layout: Layout, ep: int, tp: int, pp: int) -> Path:
    if layout.ep > 1:
        return shard_dir / "model" / f"dp_rank_00_ep_rank_{ep:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
    return shard_dir / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def load_ranks(shard_dir: Path, layout: Layout) -> dict[tuple[int, int, int], dict]:
    return {
        (e, t, p): torch.load(rank_path(shard_dir, layout, e, t, p), map_location="cpu", weights_only=True)
        for e in range(layout.ep)
        for t in range(layout.tp)
        for p in range(layout.pp)
    }


def rms(x, w, eps, gemma: bool):
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (n * (1.0 + w.float())).type_as(x) if gemma else w * n.to(x.dtype)


def norm(s: Spec, x, w):
    """The model's norm: RMSNorm (Gemma's with 1 + w), or DBRX's LayerNorm without bias."""
    return F.layer_norm(x, x.shape[-1:], w, None, s.eps) if s.layer_norm else rms(x, w, s.eps, s.gemma)


def rotate_half(x):
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-b, a), dim=-1)


def causal_mask(seq: int) -> torch.Tensor:
    upper = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    return torch.zeros(seq, seq).masked_fill(upper, torch.finfo(torch.float32).min)[None, None]


def local_qkv(sd, attn, s: Spec, layout: Layout):
    nq, nkv = s.heads // layout.tp, s.kv * layout.kv_multiplier // layout.tp
    names = QKV_WEIGHTS[layout.qkv]
    if len(names) == 3:
        parts = [sd[attn + n] for n in names]
    else:
        parts = list(torch.split(sd[attn + names[0]], [nq * s.head_dim, nkv * s.head_dim, nkv * s.head_dim]))
    assert [p.shape for p in parts] == [
        (nq * s.head_dim, s.hidden),
        (nkv * s.head_dim, s.hidden),
        (nkv * s.head_dim, s.hidden),
    ]
    return parts


def attention_partial(sd, layer, h, cos, sin, s: Spec, layout: Layout):
    attn = s.layer_prefix.format(i=layer) + s.attn_scope
    wq, wk, wv = local_qkv(sd, attn, s, layout)
    B, S, _ = h.shape
    d = s.head_dim
    q, k, v = (F.linear(h, w).view(B, S, -1, d) for w in (wq, wk, wv))
    if s.clip is not None:  # elementwise: clamping each rank's q, k, v = clamping the fused output
        q, k, v = (t.clamp(-s.clip, s.clip) for t in (q, k, v))
    if s.qk_norm:  # one (head_dim,) weight for every head: the same on every rank
        q, k = rms(q, sd[attn + "q_norm.weight"], s.eps, s.gemma), rms(k, sd[attn + "k_norm.weight"], s.eps, s.gemma)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    c, sn = cos[:, None], sin[:, None]
    q, k = q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * s.scale
    if s.attn_cap:
        scores = torch.tanh(scores / s.attn_cap) * s.attn_cap
    probs = torch.softmax(scores + causal_mask(S), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, -1)
    return out @ sd[attn + "o_proj.weight"].T


def dense_mlp_partial(sd, layer, h, s: Spec, layout: Layout):
    p = s.layer_prefix.format(i=layer) + s.mlp_scope
    local = s.inter // layout.tp
    w = sd[p + "gate_up_proj.weight"]
    assert w.shape == (2 * local, s.hidden)
    gate, up = F.linear(h, w).split(local, dim=-1)  # [gate_r; up_r]
    return (s.act(gate) * up) @ sd[p + "down_proj.weight"].T


def moe_mlp(ranks, stage, layer, h, s: Spec, layout: Layout):
    """Router from ep rank 0 (replicated over tp); each (ep, tp) rank runs its local experts on its
    tp slice; the partial outputs are summed over tp and ep."""
    p = s.layer_prefix.format(i=layer) + s.mlp_scope
    router = ranks[(0, 0, stage)][p + "router.linear_router.weight"]
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, s.top_k, dim=-1)
    if s.norm_topk:
        top = top / top.sum(-1, keepdim=True)
    if s.norm_p is not None:
        top = top / torch.norm(top, p=s.norm_p, dim=-1, keepdim=True)
    top = top.to(h.dtype)
    per_ep, local = s.experts // layout.ep, s.moe_inter // layout.tp
    out = torch.zeros_like(h)
    for ep in range(layout.ep):
        for tp in range(layout.tp):
            sd = ranks[(ep, tp, stage)]
            gu, dn = sd[p + "expert_mlps.mlp_op.gate_up_proj.weight"], sd[p + "expert_mlps.mlp_op.down_proj.weight"]
            assert gu.shape == (per_ep, s.hidden, 2 * local) and dn.shape == (per_ep, local, s.hidden)
            for j in range(per_ep):
                e = ep * per_ep + j
                weight = (top * (idx == e)).sum(-1, keepdim=True)
                gate, up = (h @ gu[j]).split(local, dim=-1)
                out = out + weight * ((s.act(gate) * up) @ dn[j])
    return out


def sharded_logits(ranks, s: Spec, layout: Layout, ids, rope) -> torch.Tensor:
    h = None
    for stage, layers in enumerate(stage_layers(s.layers, layout.pp)):
        sds = [ranks[(0, tp, stage)] for tp in range(layout.tp)]
        if stage == 0:
            per = s.vocab // layout.tp
            h = 0
            for r, sd in enumerate(sds):
                local = ids - r * per
                inside = (local >= 0) & (local < per)
                h = h + sd[s.embed][local.clamp(0, per - 1)] * inside[..., None]
            if s.gemma:
                h = h * torch.tensor(s.hidden**0.5, dtype=h.dtype)
        for layer in layers:
            pre = s.layer_prefix.format(i=layer)
            cos, sin = rope(layer)
            x = norm(s, h, sds[0][pre + s.norm_1])
            attn = sum(attention_partial(sd, layer, x, cos, sin, s, layout) for sd in sds)  # all-reduce
            if s.gemma:
                attn = norm(s, attn, sds[0][pre + "post_attention_layernorm.weight"])
                h1 = h + attn
                x = norm(s, h1, sds[0][pre + "pre_feedforward_layernorm.weight"])
            else:
                h1 = h + attn
                x = norm(s, h1, sds[0][pre + s.norm_2])
            if s.experts:
                mlp = moe_mlp(ranks, stage, layer, x, s, layout)
            else:
                mlp = sum(dense_mlp_partial(sd, layer, x, s, layout) for sd in sds)
            if s.gemma:
                mlp = norm(s, mlp, sds[0][pre + "post_feedforward_layernorm.weight"])
            h = h1 + mlp
        if stage == layout.pp - 1:
            x = norm(s, h, sds[0][s.final_norm])
            logits = torch.cat([x @ sd["lm_head.weight"].T for sd in sds], dim=-1)
            if s.final_cap:
                logits = torch.tanh(logits / s.final_cap) * s.final_cap
            return logits
    raise AssertionError("no last stage")


def hf_rope(model):
    """cos/sin of each layer from the model's rotary module (computed from config.json numbers,
    no weights: rotary buffers are not in the shards)."""
    x = torch.zeros(1, SEQ, model.config.hidden_size)
    pos = torch.arange(SEQ)[None]
    types = getattr(model.config, "layer_types", None)
    rotary = (model.transformer if model.config.model_type == "dbrx" else model.model).rotary_emb

    def rope(layer: int):
        with torch.no_grad():
            if types is not None and model.config.model_type == "gemma3_text":  # one rope per layer type
                return rotary(x, pos, types[layer])
            return rotary(x, pos)

    return rope


def layer_norm(x, sd, name, eps):
    return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)
