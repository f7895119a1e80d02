"""BERT (model_type "bert"), as NxD's `tp_dp_bert_hf_pretrain` example holds it: the encoder layers'
attention and MLP tensor-parallel under their Hugging Face names, everything else replicated.

- `attention.self.query/key/value` column-parallel by heads (weights and biases), the output
  projection `attention.output.dense` row-parallel (bias replicated, added once);
- `intermediate.dense` column-parallel (weight and bias), `output.dense` row-parallel (bias
  replicated); every LayerNorm (weight and bias) replicated;
- the embeddings (word, absolute position, token type, LayerNorm), the pooler and the pre-training
  heads (`cls.predictions.transform`, `cls.predictions.bias`, `cls.seq_relationship`) replicated:
  they live on the first stage (embeddings) and the last stage (pooler and heads).
- the MLM decoder `cls.predictions.decoder.weight` is tied to the word embeddings: when the
  config ties them the rank files of the last stage hold it cut from the word embeddings (as a
  tied Llama's lm_head), and merge does not write it (Hugging Face does not save it).

The encoder has no causal mask; that is a computation, not a weight. q, k and v stay three
tensors (the example's storage): the other qkv styles are refused.
"""

from ..placements import Replicated, Split
from .base import Family, register

H, V, I = "hidden_size", "vocab_size", "intermediate_size"
WORDS = "bert.embeddings.word_embeddings.weight"


def _layer_norm(name: str) -> tuple[Replicated, Replicated]:
    return Replicated(f"{name}.weight", (H,)), Replicated(f"{name}.bias", (H,))


def _column(name: str, rows, cols) -> tuple[Split, Split]:
    return Split(f"{name}.weight", 0, (rows, cols)), Split(f"{name}.bias", 0, (rows,))


def _row(name: str, rows, cols) -> tuple[Split, Replicated]:
    return Split(f"{name}.weight", 1, (rows, cols)), Replicated(f"{name}.bias", (rows,))


FAMILY = register(
    Family(
        name="bert",
        first=(
            Replicated(WORDS, (V, H)),
            Replicated("bert.embeddings.position_embeddings.weight", ("max_position_embeddings", H)),
            Replicated("bert.embeddings.token_type_embeddings.weight", ("type_vocab_size", H)),
            *_layer_norm("bert.embeddings.LayerNorm"),
        ),
        layer=(
            *_column("attention.self.query", "q_size", H),
            *_column("attention.self.key", "q_size", H),
            *_column("attention.self.value", "q_size", H),
            *_row("attention.output.dense", H, "q_size"),
            *_layer_norm("attention.output.LayerNorm"),
            *_column("intermediate.dense", I, H),
            *_row("output.dense", H, I),
            *_layer_norm("output.LayerNorm"),
        ),
        final=(
            Replicated("bert.pooler.dense.weight", (H, H)),
            Replicated("bert.pooler.dense.bias", (H,)),
            Replicated("cls.predictions.transform.dense.weight", (H, H)),
            Replicated("cls.predictions.transform.dense.bias", (H,)),
            *_layer_norm("cls.predictions.transform.LayerNorm"),
            Replicated("cls.predictions.decoder.weight", (V, H), tied_to=WORDS),
            Replicated("cls.predictions.bias", (V,)),
            Replicated("cls.seq_relationship.weight", (2, H)),
            Replicated("cls.seq_relationship.bias", (2,)),
        ),
        ignored=("bert.embeddings.position_ids", "cls.predictions.decoder.bias"),
        layer_prefix="bert.encoder.layer.{i}.",
        qkv_styles=("separate",),
        qkv_reason=(
            "NxD's BERT example keeps attention.self.query/key/value as three column-parallel linears "
            "under their Hugging Face names: leave --qkv at its default"
        ),
    )
)
