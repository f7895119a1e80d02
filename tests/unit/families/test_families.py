"""The newer model families: Qwen3, Qwen3-MoE, Phi-3, Gemma 2, Gemma 3, GPT-NeoX, and Llama 3.1/3.2
fixtures; and the family tables themselves (full shapes derived from the placements).

For every family, from a tiny random model made with transformers' own class:
1. convert (tp2 pp2, ep2 for MoE, a kv multiplier where GQA allows) -> merge -> transformers
   loads it and gives identical logits (torch.equal) and identical tensors;
2. a sharded forward computed from the rank files alone (NxD names and local sizes, the all-reduce
   a Python sum, no shardkit placement logic) equals the Hugging Face logits;
3. reshard between two layouts equals a direct convert, file for file;
4. `plan` per-rank numbers for one real (7B-class) config, computed by hand here;
5. qkv styles that cannot apply are refused with a one-line reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from conftest import stage_layers
from family_helpers import (
    ATOL,
    BATCH,
    SEQ,
    Spec,
    causal_mask,
    hf_model,
    hf_rope,
    layer_norm,
    load_causal,
    load_ranks,
    rotate_half,
    sharded_logits,
    token_ids,
)

from shardkit import Layout, convert, inspect, merge, reshard, verify
from shardkit.cli import cli
from shardkit.errors import ConfigMismatchError, LayoutError
from shardkit.families import family_for, known_families
from shardkit.layout import ModelDims
from shardkit.memory import plan_memory
from shardkit.testing import FIXTURES, fixture_config, make_tiny_model


@dataclass(frozen=True)
class Case:
    fixture: str
    layout: dict
    reshard_to: dict
    arch: str = "causal"

    @property
    def id(self) -> str:
        return self.fixture


CASES = [
    Case("llama-3.1-tiny", dict(tp=2, pp=2, kv_multiplier=2, qkv="gqa"), dict(tp=4, pp=1, kv_multiplier=2)),
    Case("llama-3.2-tiny", dict(tp=2, pp=2, kv_multiplier=2, kv_replication="blocked"), dict(tp=1, pp=3, qkv="fused")),
    Case("qwen3-tiny", dict(tp=2, pp=2, kv_multiplier=2, qkv="gqa"), dict(tp=4, pp=3, qkv="fused")),
    Case("qwen3-moe-tiny", dict(tp=2, pp=2, ep=2, qkv="fused"), dict(tp=4, pp=1, ep=4, kv_multiplier=1)),
    Case("phi3-tiny", dict(tp=2, pp=2, kv_multiplier=2, qkv="coalesced"), dict(tp=4, pp=3, kv_multiplier=2, qkv="gqa")),
    Case("gemma2-tiny", dict(tp=2, pp=2, kv_multiplier=2), dict(tp=4, pp=3, kv_multiplier=2, qkv="gqa")),
    Case("gemma3-tiny", dict(tp=2, pp=2, kv_multiplier=2, qkv="fused"), dict(tp=4, pp=1, kv_multiplier=2)),
    Case("dbrx-tiny", dict(tp=2, pp=2, ep=2, kv_multiplier=2, qkv="gqa"), dict(tp=4, pp=3, qkv="fused")),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shards(tiny_model, tmp_path_factory):
    """shards(case) -> (hf_dir, shard_dir), converted once per module."""
    cache: dict = {}

    def build(case: Case):
        if case.fixture not in cache:
            hf_dir = tiny_model(case.fixture)
            dst = tmp_path_factory.mktemp(f"{case.fixture}-shards") / "out"
            convert(hf_dir, dst, Layout(**case.layout))
            cache[case.fixture] = (hf_dir, dst)
        return cache[case.fixture]

    return build


# ---- 0. the family tables -----------------------------------------------------------------------


def test_new_families_are_registered():
    assert {"qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text"} <= set(known_families())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_full_shapes_from_the_placements_are_the_checkpoints(case, tiny_model):
    """Family.full_shapes (declared by the placements, each tensor named once) is exactly the
    set of tensors, with shapes, that transformers saves for the config."""
    from safetensors import safe_open

    hf_dir = tiny_model(case.fixture)
    config = json.loads((hf_dir / "config.json").read_text())
    family = family_for(config)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not family.is_ignored(k)}
    assert family.full_shapes(ModelDims.from_config(config)) == saved


def test_existing_families_shapes_by_hand():
    """The refactor keeps the old tables' shapes: Llama-2 7B and the tiny Mixtral, spelled out."""
    dims = ModelDims.from_config(json.loads((FIXTURES / "llama-2-7b.json").read_text()))
    shapes = family_for({"model_type": "llama"}).full_shapes(dims)
    H, I, V = 4096, 11008, 32000
    layer = {
        "self_attn.q_proj.weight": (H, H),
        "self_attn.k_proj.weight": (H, H),
        "self_attn.v_proj.weight": (H, H),
        "self_attn.o_proj.weight": (H, H),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }
    want = {"model.embed_tokens.weight": (V, H)}
    for i in range(32):
        want.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    want.update({"model.norm.weight": (H,), "lm_head.weight": (V, H)})
    assert shapes == want and list(shapes) == list(want)
    mix = ModelDims.from_config(fixture_config("mixtral-tiny"))
    shapes = family_for({"model_type": "mixtral"}).full_shapes(mix)
    assert shapes["model.layers.2.block_sparse_moe.gate.weight"] == (4, 64)
    assert shapes["model.layers.2.block_sparse_moe.experts.3.w2.weight"] == (64, 32)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64, 64)  # 16 heads of 4


@pytest.mark.parametrize(
    "change", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}, {"mlp_only_layers": [0], "num_local_experts": 4}]
)
def test_qwen3_moe_dense_layers_are_refused(change):
    cfg = {**fixture_config("qwen3-moe-tiny"), **change}
    with pytest.raises(ConfigMismatchError, match="dense MLP"):
        family_for(cfg).full_shapes(ModelDims.from_config(cfg))


# ---- 1. convert -> merge -> transformers: identical -------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_convert_merge_gives_identical_logits(case, shards, tmp_path):
    hf_dir, shard_dir = shards(case)
    merged = tmp_path / "merged"
    merge(shard_dir, merged)
    model = hf_model(hf_dir)
    back = load_causal(merged)
    a, b = model.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
    report = inspect(shard_dir, check_data=True)
    assert report["problems"] == [], report["problems"]
    assert verify(hf_dir, shard_dir).ok and verify(merged, shard_dir).ok


# ---- 2. the sharded forward, from rank files only ---------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_sharded_forward_from_rank_files(case, shards):
    hf_dir, shard_dir = shards(case)
    layout = Layout(**case.layout)
    s = Spec.of(json.loads((hf_dir / "config.json").read_text()))
    model = hf_model(hf_dir)
    ranks = load_ranks(shard_dir, layout)
    ids = token_ids(s.vocab)
    with torch.no_grad():
        want = model(ids).logits
        got = sharded_logits(ranks, s, layout, ids, hf_rope(model))
    assert torch.allclose(got, want, atol=ATOL, rtol=1e-4), (got - want).abs().max().item()
    # negative control: the same forward with two tp ranks' files swapped is far off
    swapped = {(e, 1 - t, p): sd for (e, t, p), sd in ranks.items()}
    with torch.no_grad():
        bad = sharded_logits(swapped, s, layout, ids, hf_rope(model))
    assert (bad - want).abs().max().item() > 1e-2


# ---- 3. reshard == direct convert, file for file ----------------------------------------------------


def same_rank_files(a: Path, b: Path) -> None:
    names_a = sorted(p.name for p in (a / "model").iterdir())
    names_b = sorted(p.name for p in (b / "model").iterdir())
    assert names_a == names_b
    for name in names_a:
        sa = torch.load(a / "model" / name, map_location="cpu", weights_only=True)
        sb = torch.load(b / "model" / name, map_location="cpu", weights_only=True)
        assert list(sa) == list(sb), name
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]), (name, k)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reshard_equals_direct_convert(case, shards, tmp_path):
    hf_dir, shard_dir = shards(case)
    target = Layout(**case.reshard_to)
    reshard(shard_dir, tmp_path / "resharded", target)
    convert(hf_dir, tmp_path / "direct", target)
    same_rank_files(tmp_path / "resharded", tmp_path / "direct")


# ---- 4. plan: per-rank numbers of real configs, by hand ---------------------------------------------


def plan_params(name: str, layout: Layout) -> list[int]:
    return [st.params for st in plan_memory(FIXTURES / f"{name}.json", layout).stages]


def test_plan_llama_3_1_8b_tp8_pp2():
    H, I, L, V, D, kv, tp = 4096, 14336, 32, 128256, 128, 8, 8
    per_layer = (H * H + 2 * kv * D * H + H * H) // tp + 3 * H * I // tp + 2 * H
    assert plan_params("llama-3.1-8b", Layout(tp=8, pp=2)) == [
        V * H // tp + L // 2 * per_layer,
        L // 2 * per_layer + H + V * H // tp,
    ]


def test_plan_llama_3_2_3b_tied_tp4():
    H, I, L, V, D, kv, tp = 3072, 8192, 28, 128256, 128, 8, 4
    per_layer = (2 * H * H + 2 * kv * D * H) // tp + 3 * H * I // tp + 2 * H
    # tied: lm_head is the embedding's slice, the same parameter on the one stage: counted once
    assert plan_params("llama-3.2-3b", Layout(tp=4)) == [V * H // tp + L * per_layer + H]


def test_plan_qwen3_8b_tp8_kv_multiplier():
    H, I, L, V, D, q, kv, tp = 4096, 12288, 36, 151936, 128, 32, 8, 8
    attn = (q * D * H + 2 * kv * D * H + H * q * D) // tp
    per_layer = attn + 3 * H * I // tp + 2 * H + 2 * D  # two norms, q_norm and k_norm
    assert plan_params("qwen3-8b", Layout(tp=8, pp=2)) == [
        V * H // tp + 18 * per_layer,
        18 * per_layer + H + V * H // tp,
    ]
    # kv multiplier 2 at tp 16: each rank holds one kv head of k and of v (8 x 2 / 16)
    attn16 = (q * D * H) // 16 + 2 * 1 * D * H + (H * q * D) // 16
    per16 = attn16 + 3 * H * I // 16 + 2 * H + 2 * D
    assert plan_params("qwen3-8b", Layout(tp=16, pp=1, kv_multiplier=2)) == [2 * V * H // 16 + L * per16 + H]


def test_plan_qwen3_30b_a3b_tp4_ep():
    H, I, L, V, D, q, kv, E, tp = 2048, 768, 48, 151936, 128, 32, 4, 128, 4
    attn = (q * D * H + 2 * kv * D * H + H * q * D) // tp
    experts = E * 3 * H * I // tp  # plan counts a replica's ep rank 0: all experts at ep 1
    per_layer = attn + 2 * D + E * H + experts + 2 * H
    assert plan_params("qwen3-30b-a3b", Layout(tp=4, pp=4)) == [
        V * H // tp + L // 4 * per_layer,
        L // 4 * per_layer,
        L // 4 * per_layer,
        L // 4 * per_layer + H + V * H // tp,
    ]


def test_plan_phi_3_mini_tp4():
    H, I, L, V, tp = 3072, 8192, 32, 32064, 4
    per_layer = 4 * H * H // tp + 3 * H * I // tp + 2 * H  # MHA: qkv_proj (3H, H) cut by heads
    assert plan_params("phi-3-mini-4k", Layout(tp=4)) == [V * H // tp + L * per_layer + H + V * H // tp]


def test_plan_gemma_2_9b_tp8_pp2():
    H, I, L, V, D, q, kv, tp = 3584, 14336, 42, 256000, 256, 16, 8, 8
    per_layer = (q * D * H + 2 * kv * D * H + H * q * D) // tp + 3 * H * I // tp + 4 * H  # four norms
    # tied embeddings: stage 0 holds the embedding slice, the last stage the lm_head slice (same values)
    assert plan_params("gemma-2-9b", Layout(tp=8, pp=2)) == [
        V * H // tp + L // 2 * per_layer,
        L // 2 * per_layer + H + V * H // tp,
    ]


def test_plan_gemma_3_1b_tp4_kv_multiplier_4():
    H, I, L, V, D, q, kv, tp = 1152, 6912, 26, 262144, 256, 4, 1, 4
    # one kv head replicated 4 times: every rank holds one q head and a whole k and v head
    per_layer = q * D * H // tp + 2 * (kv * 4 // tp) * D * H + H * q * D // tp + 3 * H * I // tp + 4 * H + 2 * D
    assert plan_params("gemma-3-1b", Layout(tp=4, kv_multiplier=4)) == [V * H // tp + L * per_layer + H]


# ---- 5. qkv styles that cannot apply; config checks --------------------------------------------------


def test_every_qkv_style_applies_to_the_llama_like_families():
    for model_type in ("qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text"):
        assert known_families()[model_type].qkv_styles == ("separate", "gqa", "fused", "coalesced")


# ---- GPT-NeoX ------------------------------------------------------------------------------------

NEOX = Case("gpt-neox-tiny", dict(tp=2, pp=2), dict(tp=4, pp=3))


def neox_sharded_logits(ranks, config: dict, layout: Layout, ids, cos, sin) -> torch.Tensor:
    """GPT-NeoX as NxD's example runs it: per rank, query_key_value's rows are the rank's heads,
    each [q; k; v] (viewed (local heads, 3 * head_dim)), rotary on the first rotary_pct of each
    head, dense row-parallel (bias once after the sum), parallel residual, vocab-parallel ends."""
    H, n, V, eps = config["hidden_size"], config["num_attention_heads"], config["vocab_size"], config["layer_norm_eps"]
    D, tp = H // n, layout.tp
    parallel = config.get("use_parallel_residual", True)
    rot = cos.shape[-1]
    act = F.gelu  # hidden_act "gelu"
    h = None
    for stage, layers in enumerate(stage_layers(config["num_hidden_layers"], layout.pp)):
        sds = [ranks[(0, t, stage)] for t in range(tp)]
        if stage == 0:
            per = V // tp
            h = 0
            for r, sd in enumerate(sds):
                local = ids - r * per
                inside = (local >= 0) & (local < per)
                h = h + sd["gpt_neox.embed_in.weight"][local.clamp(0, per - 1)] * inside[..., None]
        for layer in layers:
            p = f"gpt_neox.layers.{layer}."
            B, S, _ = h.shape
            x = layer_norm(h, sds[0], p + "input_layernorm", eps)
            attn = 0
            for sd in sds:
                w, b = sd[p + "attention.query_key_value.weight"], sd[p + "attention.query_key_value.bias"]
                assert w.shape == (3 * H // tp, H)
                qkv = F.linear(x, w, b).view(B, S, n // tp, 3 * D).transpose(1, 2)
                q, k, v = qkv.chunk(3, dim=-1)
                c, s = cos[:, None], sin[:, None]
                q = torch.cat((q[..., :rot] * c + rotate_half(q[..., :rot]) * s, q[..., rot:]), dim=-1)
                k = torch.cat((k[..., :rot] * c + rotate_half(k[..., :rot]) * s, k[..., rot:]), dim=-1)
                scores = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + causal_mask(S)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
                out = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, -1)
                attn = attn + out @ sd[p + "attention.dense.weight"].T
            attn = attn + sds[0][p + "attention.dense.bias"]
            mlp_in = h if parallel else h + attn
            y = layer_norm(mlp_in, sds[0], p + "post_attention_layernorm", eps)
            mlp = sum(
                act(F.linear(y, sd[p + "mlp.dense_h_to_4h.weight"], sd[p + "mlp.dense_h_to_4h.bias"]))
                @ sd[p + "mlp.dense_4h_to_h.weight"].T
                for sd in sds
            )
            mlp = mlp + sds[0][p + "mlp.dense_4h_to_h.bias"]
            h = h + attn + mlp if parallel else mlp_in + mlp
        if stage == layout.pp - 1:
            x = layer_norm(h, sds[0], "gpt_neox.final_layer_norm", eps)
            return torch.cat([x @ sd["embed_out.weight"].T for sd in sds], dim=-1)
    raise AssertionError("no last stage")


def test_gpt_neox_convert_merge_gives_identical_logits(shards, tmp_path):
    test_convert_merge_gives_identical_logits(NEOX, shards, tmp_path)


def test_gpt_neox_sharded_forward_from_rank_files(shards):
    hf_dir, shard_dir = shards(NEOX)
    layout = Layout(**NEOX.layout)
    config = json.loads((hf_dir / "config.json").read_text())
    model = hf_model(hf_dir)
    ranks = load_ranks(shard_dir, layout)
    ids = token_ids(config["vocab_size"])
    x = torch.zeros(1, SEQ, config["hidden_size"])
    with torch.no_grad():
        cos, sin = model.gpt_neox.rotary_emb(x, torch.arange(SEQ)[None])
        assert cos.shape[-1] == int(config["hidden_size"] // config["num_attention_heads"] * 0.5)  # rotary_pct
        want = model(ids).logits
        got = neox_sharded_logits(ranks, config, layout, ids, cos, sin)
        assert torch.allclose(got, want, atol=ATOL, rtol=1e-4), (got - want).abs().max().item()
        swapped = {(e, 1 - t, p): sd for (e, t, p), sd in ranks.items()}
        assert (neox_sharded_logits(swapped, config, layout, ids, cos, sin) - want).abs().max().item() > 1e-2


def test_gpt_neox_reshard_equals_direct_convert(shards, tmp_path):
    test_reshard_equals_direct_convert(NEOX, shards, tmp_path)


def test_plan_pythia_6_9b_tp8_pp2():
    H, I, L, V, tp = 4096, 16384, 32, 50432, 8
    per_layer = (
        (3 * H * H + 3 * H) // tp
        + H * H // tp
        + H  # query_key_value (+bias), dense, dense bias
        + (I * H + I) // tp
        + I * H // tp
        + H  # h_to_4h (+bias), 4h_to_h, its bias
        + 4 * H
    )  # two LayerNorms, weight and bias
    assert plan_params("pythia-6.9b", Layout(tp=8, pp=2)) == [
        V * H // tp + L // 2 * per_layer,
        L // 2 * per_layer + 2 * H + V * H // tp,
    ]


@pytest.mark.parametrize("qkv", ["gqa", "fused", "coalesced"])
def test_gpt_neox_refuses_other_qkv_styles(qkv, tiny_model, tmp_path):
    with pytest.raises(LayoutError, match=f"--qkv {qkv} does not apply to gpt_neox: NxD's GPT-NeoX example") as e:
        convert(tiny_model("gpt-neox-tiny"), tmp_path / "out", Layout(tp=2, qkv=qkv))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.pt"))


def test_gpt_neox_kv_multiplier_is_refused(tiny_model, tmp_path):
    with pytest.raises(LayoutError, match="kv-multiplier 2 is too large"):
        convert(tiny_model("gpt-neox-tiny"), tmp_path / "out", Layout(tp=2, kv_multiplier=2))


def test_cli_refuses_qkv_with_one_line(tiny_model, tmp_path):
    result = CliRunner().invoke(
        cli, ["-q", "convert", str(tiny_model("gpt-neox-tiny")), str(tmp_path / "out"), "--tp", "2", "--qkv", "fused"]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--qkv fused does not apply to gpt_neox" in lines[0], result.stderr


# ---- BERT ------------------------------------------------------------------------------------------

BERT = Case("bert-tiny", dict(tp=2, pp=2), dict(tp=4, pp=3), arch="bert")


def bert_inputs(config: dict):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=g)
    types = torch.randint(0, config["type_vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 6:] = 0  # padding in the second sequence: an encoder's only mask
    return ids, types, mask


def bert_model(path: Path):
    from transformers import BertForPreTraining

    return BertForPreTraining.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def bert_sharded(ranks, config: dict, layout: Layout, ids, types, mask):
    """BERT as NxD's example runs it: embeddings replicated; per rank, its heads of query/key/value
    (column-parallel, with their bias slices), attention over all positions but the padding,
    output.dense partial outputs summed (bias once), the same for the MLP; pooler and heads on the
    last stage, the MLM decoder being the word embeddings (tied)."""
    H, n, eps, tp = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"], layout.tp
    D = H // n
    B, S = ids.shape
    ext = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    h = None
    for stage, layers in enumerate(stage_layers(config["num_hidden_layers"], layout.pp)):
        sds = [ranks[(0, t, stage)] for t in range(tp)]
        if stage == 0:
            e = sds[0]
            h = (
                e["bert.embeddings.word_embeddings.weight"][ids]
                + e["bert.embeddings.token_type_embeddings.weight"][types]
                + e["bert.embeddings.position_embeddings.weight"][torch.arange(S)][None]
            )
            h = layer_norm(h, e, "bert.embeddings.LayerNorm", eps)
        for layer in layers:
            p = f"bert.encoder.layer.{layer}."
            attn = 0
            for sd in sds:
                q, k, v = (
                    F.linear(h, sd[p + f"attention.self.{w}.weight"], sd[p + f"attention.self.{w}.bias"])
                    .view(B, S, n // tp, D)
                    .transpose(1, 2)
                    for w in ("query", "key", "value")
                )
                probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + ext, dim=-1)
                ctx = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, -1)
                attn = attn + ctx @ sd[p + "attention.output.dense.weight"].T
            h1 = layer_norm(
                attn + sds[0][p + "attention.output.dense.bias"] + h, sds[0], p + "attention.output.LayerNorm", eps
            )
            mlp = sum(
                F.gelu(F.linear(h1, sd[p + "intermediate.dense.weight"], sd[p + "intermediate.dense.bias"]))
                @ sd[p + "output.dense.weight"].T
                for sd in sds
            )
            h = layer_norm(mlp + sds[0][p + "output.dense.bias"] + h1, sds[0], p + "output.LayerNorm", eps)
        if stage == layout.pp - 1:
            f = sds[0]
            pooled = torch.tanh(F.linear(h[:, 0], f["bert.pooler.dense.weight"], f["bert.pooler.dense.bias"]))
            t = F.gelu(
                F.linear(h, f["cls.predictions.transform.dense.weight"], f["cls.predictions.transform.dense.bias"])
            )
            t = layer_norm(t, f, "cls.predictions.transform.LayerNorm", eps)
            mlm = F.linear(t, f["cls.predictions.decoder.weight"], f["cls.predictions.bias"])
            nsp = F.linear(pooled, f["cls.seq_relationship.weight"], f["cls.seq_relationship.bias"])
            return mlm, nsp
    raise AssertionError("no last stage")


def test_bert_convert_merge_gives_identical_outputs(shards, tmp_path):
    hf_dir, shard_dir = shards(BERT)
    merge(shard_dir, tmp_path / "merged")
    a, b = bert_model(hf_dir), bert_model(tmp_path / "merged")
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids, types, mask = bert_inputs(json.loads((hf_dir / "config.json").read_text()))
    with torch.no_grad():
        oa, ob = a(ids, token_type_ids=types, attention_mask=mask), b(ids, token_type_ids=types, attention_mask=mask)
    assert torch.equal(oa.prediction_logits, ob.prediction_logits)
    assert torch.equal(oa.seq_relationship_logits, ob.seq_relationship_logits)
    assert inspect(shard_dir, check_data=True)["problems"] == []
    assert verify(hf_dir, shard_dir).ok


def test_bert_sharded_forward_from_rank_files(shards):
    hf_dir, shard_dir = shards(BERT)
    layout = Layout(**BERT.layout)
    config = json.loads((hf_dir / "config.json").read_text())
    ranks = load_ranks(shard_dir, layout)
    ids, types, mask = bert_inputs(config)
    with torch.no_grad():
        want = bert_model(hf_dir)(ids, token_type_ids=types, attention_mask=mask)
        mlm, nsp = bert_sharded(ranks, config, layout, ids, types, mask)
        assert torch.allclose(mlm, want.prediction_logits, atol=ATOL, rtol=1e-4), (
            (mlm - want.prediction_logits).abs().max()
        )
        assert torch.allclose(nsp, want.seq_relationship_logits, atol=ATOL, rtol=1e-4)
        # negative control: rank 0's keys with rank 1's queries (heads mismatched) is far off
        swapped = {key: dict(sd) for key, sd in ranks.items()}
        for stage in range(layout.pp):
            for name in ranks[(0, 0, stage)]:
                if name.endswith("attention.self.key.weight"):
                    swapped[(0, 0, stage)][name], swapped[(0, 1, stage)][name] = (
                        ranks[(0, 1, stage)][name],
                        ranks[(0, 0, stage)][name],
                    )
        bad, _ = bert_sharded(swapped, config, layout, ids, types, mask)
        assert (bad - want.prediction_logits).abs().max().item() > 10 * ATOL, (bad - want.prediction_logits).abs().max()


def test_bert_reshard_equals_direct_convert(shards, tmp_path):
    test_reshard_equals_direct_convert(BERT, shards, tmp_path)


def test_plan_bert_large_tp2():
    H, I, L, V, P, T, tp = 1024, 4096, 24, 30522, 512, 2, 2
    embeddings = V * H + P * H + T * H + 2 * H  # replicated on every tp rank
    per_layer = (
        3 * (H * H + H) // tp
        + H * H // tp
        + H
        + 2 * H  # q k v (+biases), output.dense (+bias), LN
        + (I * H + I) // tp
        + I * H // tp
        + H
        + 2 * H
    )  # intermediate (+bias), output (+bias), LN
    heads = (H * H + H) + (H * H + H) + 2 * H + V + (2 * H + 2)  # pooler, transform, its LN, MLM bias, NSP
    # one stage: the tied MLM decoder is the word embeddings, counted once
    assert plan_params("bert-large-uncased", Layout(tp=2)) == [embeddings + L * per_layer + heads]
    # two stages: the last one holds its own copy of the decoder (V x H)
    assert plan_params("bert-large-uncased", Layout(tp=2, pp=2)) == [
        embeddings + 12 * per_layer,
        12 * per_layer + heads + V * H,
    ]


BERT_HEADS = {  # architecture -> config changes: the variants of the table the config's architecture chooses
    "BertForSequenceClassification": {
        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
        "label2id": {"negative": 0, "neutral": 1, "positive": 2},
    },
    "BertModel": {},
}


def bert_outputs(model, config: dict) -> list[torch.Tensor]:
    ids, types, mask = bert_inputs(config)
    with torch.no_grad():
        out = model(ids, token_type_ids=types, attention_mask=mask)
    return [out.logits] if hasattr(out, "logits") else [out.last_hidden_state, out.pooler_output]


@pytest.mark.parametrize("arch", list(BERT_HEADS))
def test_bert_variants_round_trip(arch, tmp_path):
    """A BertForSequenceClassification (pooler and classifier, no cls.* heads) and a bare BertModel
    (no `bert.` prefix): the table is exactly what transformers saves; convert tp2 pp2 -> merge gives
    identical tensors and outputs; reshard equals a direct convert; the classifier is replicated."""
    import transformers
    from safetensors import safe_open

    config = {**fixture_config("bert-tiny"), "architectures": [arch], **BERT_HEADS[arch]}
    hf_dir = make_tiny_model(config, tmp_path / "hf")
    family = family_for(config)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not family.is_ignored(k)}
    assert family.full_shapes(ModelDims.from_config(config)) == saved
    layout = Layout(tp=2, pp=2)
    convert(hf_dir, tmp_path / "shards", layout)
    merge(tmp_path / "shards", tmp_path / "merged")
    load = getattr(transformers, arch).from_pretrained
    a, b = (load(d, attn_implementation="eager", dtype=torch.float32).eval() for d in (hf_dir, tmp_path / "merged"))
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for x, y in zip(bert_outputs(a, config), bert_outputs(b, config)))
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == [arch]
    if arch == "BertForSequenceClassification":
        last = load_ranks(tmp_path / "shards", layout)
        for t in range(2):
            assert torch.equal(last[(0, t, 1)]["classifier.weight"], sa["classifier.weight"])
            assert not any(k.startswith("cls.") for k in last[(0, t, 1)])
    target = Layout(tp=4, pp=3)
    reshard(tmp_path / "shards", tmp_path / "resharded", target)
    convert(hf_dir, tmp_path / "direct", target)
    same_rank_files(tmp_path / "resharded", tmp_path / "direct")


def test_bert_classification_labels_are_checked():
    """A classification config whose label count is not one: one line naming the field."""
    base = {**fixture_config("bert-tiny"), "architectures": ["BertForSequenceClassification"]}
    assert family_for(base).full_shapes(ModelDims.from_config(base))["classifier.weight"] == (2, 64)  # default 2
    for bad, what in (
        ({"num_labels": 3, "id2label": {"0": "a", "1": "b"}}, "num_labels is 3 but id2label names 2"),
        ({"num_labels": 0}, "num_labels must be a whole number"),
        ({"id2label": ["a", "b"]}, "id2label must be an object"),
    ):
        with pytest.raises(ConfigMismatchError, match=what) as e:
            family_for({**base, **bad})
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("qkv", ["gqa", "fused"])
def test_bert_refuses_other_qkv_styles(qkv, tiny_model, tmp_path):
    with pytest.raises(LayoutError, match=f"--qkv {qkv} does not apply to bert: NxD's BERT example"):
        convert(tiny_model("bert-tiny"), tmp_path / "out", Layout(tp=2, qkv=qkv))


def test_tied_by_default_model_types():
    """Real Gemma and BERT config.json files omit tie_word_embeddings: transformers' default (True)."""
    for name in ("gemma-2-9b", "bert-large-uncased"):
        config = json.loads((FIXTURES / f"{name}.json").read_text())
        assert "tie_word_embeddings" not in config and ModelDims.from_config(config).tie_word_embeddings
    assert not ModelDims.from_config(json.loads((FIXTURES / "pythia-6.9b.json").read_text())).tie_word_embeddings
    H, I, L, V, D, q, kv, tp = 3584, 14336, 42, 256000, 256, 16, 8, 8
    per_layer = (q * D * H + 2 * kv * D * H + H * q * D) // tp + 3 * H * I // tp + 4 * H
    assert plan_params("gemma-2-9b", Layout(tp=8)) == [V * H // tp + L * per_layer + H]  # lm_head is the embedding


# ---- DBRX --------------------------------------------------------------------------------------------


def test_dbrx_names_follow_nxd_and_experts_are_segments_of_the_flat_tensors(shards):
    """Rank files keep Hugging Face's tree with NxD's layer names (as NxD's DBRX model and example
    converter have them); expert e's gate/up are rows [e*I, (e+1)*I) of the flat w1/v1,
    transposed, and its down is those rows of w2 as stored."""
    from safetensors.torch import load_file

    case = next(c for c in CASES if c.fixture == "dbrx-tiny")
    hf_dir, shard_dir = shards(case)
    hf = load_file(hf_dir / "model.safetensors")
    layout = Layout(**case.layout)
    ranks = load_ranks(shard_dir, layout)
    E, I, tp = 4, 32, layout.tp
    per_ep, local = E // layout.ep, I // tp
    for (ep, t, stage), sd in ranks.items():
        for name in sd:
            assert name.startswith(("transformer.blocks.", "transformer.wte.", "transformer.norm_f.", "lm_head.")), name
            assert ".Wqkv." not in name and ".out_proj." not in name and ".experts.mlp." not in name, name
        for layer in stage_layers(3, layout.pp)[stage]:
            src = f"transformer.blocks.{layer}.ffn.experts.mlp."
            gu = sd[f"transformer.blocks.{layer}.ffn.expert_mlps.mlp_op.gate_up_proj.weight"]
            dn = sd[f"transformer.blocks.{layer}.ffn.expert_mlps.mlp_op.down_proj.weight"]
            for j in range(per_ep):
                e = ep * per_ep + j
                rows = slice(e * I + t * local, e * I + (t + 1) * local)
                assert torch.equal(gu[j], torch.cat([hf[src + "w1"][rows].T, hf[src + "v1"][rows].T], dim=1))
                assert torch.equal(dn[j], hf[src + "w2"][rows])


def test_plan_dbrx_base_tp8_pp4():
    H, I, L, V, D, q, kv, E, tp = 6144, 10752, 40, 100352, 128, 48, 8, 16, 8
    attn = (q * D * H + 2 * kv * D * H + H * q * D) // tp
    per_layer = attn + E * H + E * 3 * I * H // tp + 2 * H  # router replicated, every expert at ep 1, two norms
    assert plan_params("dbrx-base", Layout(tp=8, pp=4)) == [
        V * H // tp + L // 4 * per_layer,
        L // 4 * per_layer,
        L // 4 * per_layer,
        L // 4 * per_layer + H + V * H // tp,
    ]


# ---- the training checkpoint API ------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if "ep" not in c.layout] + [NEOX, BERT] + [c for c in CASES if "ep" in c.layout],
    ids=lambda c: c.id,
)
def test_training_checkpoint_saves_and_loads_on_another_layout(case, shards, tmp_path):
    """save_checkpoint of the rank files of one layout (one process, every rank), then
    load_checkpoint on the reshard target layout gives each rank what a direct convert writes."""
    from shardkit import load_checkpoint, save_checkpoint

    hf_dir, shard_dir = shards(case)
    layout, target = Layout(**case.layout), Layout(**case.reshard_to)
    config = json.loads((hf_dir / "config.json").read_text())
    ranks = load_ranks(shard_dir, layout)
    state = {(e, t, p) if layout.ep > 1 else (t, p): sd for (e, t, p), sd in ranks.items()}
    save_checkpoint(tmp_path / "ckpt", "step_1", state, layout=layout, config=config)
    convert(hf_dir, tmp_path / "direct", target)
    want = load_ranks(tmp_path / "direct", target)
    for (e, t, p), sd in want.items():
        got = load_checkpoint(tmp_path / "ckpt", "step_1", target_layout=target, rank=(e, t, p), optimizer=False)
        assert list(got.model) == list(sd)
        for k in sd:
            assert torch.equal(got.model[k], sd[k]), (e, t, p, k)


def test_trainer_refuses_the_families_it_cannot_express():
    from trainer.errors import TrainerError
    from trainer.model import ModelSpec

    with pytest.raises(TrainerError, match="the trainer supports the decoder families .* not ") as e:
        ModelSpec.from_config(fixture_config("bert-tiny"), Layout())
    assert "\n" not in str(e.value) and "convert/merge/reshard still work" in str(e.value)


@pytest.mark.parametrize(
    "fixture", ["qwen3-tiny", "phi3-tiny", "gemma2-tiny", "gemma3-tiny", "gpt-neox-tiny", "dbrx-tiny"]
)
def test_trainer_accepts_every_decoder_family(fixture):
    from trainer.model import ModelSpec

    ModelSpec.from_config(fixture_config(fixture), Layout())  # tests/unit/trainer/test_trainer_families.py trains them


def test_trainer_accepts_llama_3_1_and_3_2():
    from trainer.model import ModelSpec

    for fixture in ("llama-3.1-tiny", "llama-3.2-tiny"):
        spec = ModelSpec.from_config(fixture_config(fixture), Layout(tp=2, kv_multiplier=2))
        assert spec.family.name == "llama" and spec.rope_parameters()[0] == "llama3"
