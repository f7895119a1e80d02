"""GPT-NeoX (model_type "gpt_neox": Pythia, GPT-NeoX-20B), as NxD's `tp_dp_gpt_neox_hf_pretrain`
example holds it: the Hugging Face module names, with
- `attention.query_key_value` (weight and bias) a ColumnParallelLinear over Hugging Face's fused
  tensor, whose rows are per head [q_h; k_h; v_h]: a contiguous tp split of those rows gives each
  rank whole heads with their q, k and v, in the same per-head order its forward views them in;
- `attention.dense` row-parallel by the same heads (bias replicated, added once);
- `mlp.dense_h_to_4h` column-parallel (weight and bias), `mlp.dense_4h_to_h` row-parallel (bias
  replicated);
- LayerNorms with biases replicated; `gpt_neox.embed_in` and `embed_out` vocab-parallel.

Partial rotary (`rotary_pct`) and the parallel residual are computations, not weights. The qkv
storage is the example's own: the layout's other qkv styles are refused. GPT-NeoX is multi-head
(no kv heads to replicate), so no kv multiplier applies either.
"""

from ..placements import Replicated, Split
from .base import Family, register
from .llama import norms

H, V, I, Q = "hidden_size", "vocab_size", "intermediate_size", "q_size"


def _qkv_rows(dims) -> int:
    return 3 * dims.q_size


FAMILY = register(
    Family(
        name="gpt_neox",
        first=(Split("gpt_neox.embed_in.weight", 0, (V, H)),),
        layer=(
            *norms("input_layernorm", "post_attention_layernorm", bias=True),
            Split("attention.query_key_value.weight", 0, (_qkv_rows, H)),
            Split("attention.query_key_value.bias", 0, (_qkv_rows,)),
            Split("attention.dense.weight", 1, (H, Q)),
            Replicated("attention.dense.bias", (H,)),
            Split("mlp.dense_h_to_4h.weight", 0, (I, H)),
            Split("mlp.dense_h_to_4h.bias", 0, (I,)),
            Split("mlp.dense_4h_to_h.weight", 1, (H, I)),
            Replicated("mlp.dense_4h_to_h.bias", (H,)),
        ),
        final=(
            *norms("gpt_neox.final_layer_norm", bias=True),
            Split("embed_out.weight", 0, (V, H), tied_to="gpt_neox.embed_in.weight"),
        ),
        ignored=("*.attention.bias", "*.attention.masked_bias", "*.rotary_emb.inv_freq"),
        layer_prefix="gpt_neox.layers.{i}.",
        qkv_styles=("separate",),
        qkv_reason=(
            "NxD's GPT-NeoX example keeps attention.query_key_value fused per head "
            "(each rank's heads, q/k/v interleaved per head): leave --qkv at its default"
        ),
    )
)
