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

The config's `architectures` chooses the table's heads (`variant`): `BertForSequenceClassification`
holds the pooler and `classifier.weight` / `classifier.bias` (num_labels x hidden, replicated; the
number of labels is the config's `id2label`'s, else `num_labels`, else 2) and no `cls.*` heads;
`BertModel` is the bare encoder saved without the `bert.` prefix (`embeddings.*`,
`encoder.layer.{i}.*`, `pooler.*`). Every other BERT config (`BertForPreTraining`,
`BertForMaskedLM`, none) is the pre-training table above.
"""

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ..errors import ConfigMismatchError
from ..placements import Placement, Replicated, Split
from .base import VARIANT_PREFIXES, Family, register

H, V, I = "hidden_size", "vocab_size", "intermediate_size"
WORDS = "bert.embeddings.word_embeddings.weight"


def _layer_norm(name: str) -> tuple[Replicated, Replicated]:
    return Replicated(f"{name}.weight", (H,)), Replicated(f"{name}.bias", (H,))


def _column(name: str, rows, cols) -> tuple[Split, Split]:
    return Split(f"{name}.weight", 0, (rows, cols)), Split(f"{name}.bias", 0, (rows,))


def _row(name: str, rows, cols) -> tuple[Split, Replicated]:
    return Split(f"{name}.weight", 1, (rows, cols)), Replicated(f"{name}.bias", (rows,))


MAX_LABELS = 1 << 20
"""More labels than any classification data set has: a config beyond it is a mistake."""
CLASSIFICATION = "BertForSequenceClassification"
BASE = "BertModel"
QKV_REASON = (
    "NxD's BERT example keeps attention.self.query/key/value as three column-parallel linears "
    "under their Hugging Face names: leave --qkv at its default"
)


def _embeddings(prefix: str) -> tuple[Placement, ...]:
    return (
        Replicated(f"{prefix}embeddings.word_embeddings.weight", (V, H)),
        Replicated(f"{prefix}embeddings.position_embeddings.weight", ("max_position_embeddings", H)),
        Replicated(f"{prefix}embeddings.token_type_embeddings.weight", ("type_vocab_size", H)),
        *_layer_norm(f"{prefix}embeddings.LayerNorm"),
    )


def _pooler(prefix: str) -> tuple[Placement, ...]:
    return Replicated(f"{prefix}pooler.dense.weight", (H, H)), Replicated(f"{prefix}pooler.dense.bias", (H,))


LAYER: tuple[Placement, ...] = (
    *_column("attention.self.query", "q_size", H),
    *_column("attention.self.key", "q_size", H),
    *_column("attention.self.value", "q_size", H),
    *_row("attention.output.dense", H, "q_size"),
    *_layer_norm("attention.output.LayerNorm"),
    *_column("intermediate.dense", I, H),
    *_row("output.dense", H, I),
    *_layer_norm("output.LayerNorm"),
)


def num_labels(config: Mapping[str, Any]) -> int:
    """A sequence-classification config's number of labels: its `id2label`'s, else `num_labels`,
    else 2 (transformers' default); ConfigMismatchError when they disagree or are not a count."""
    id2label, given = config.get("id2label"), config.get("num_labels")
    if id2label is not None and not (isinstance(id2label, Mapping) and id2label):
        raise ConfigMismatchError("config.json: id2label must be an object of label ids to names: fix the config")
    count = len(id2label) if isinstance(id2label, Mapping) else given if given is not None else 2
    if given is not None and given != count:
        raise ConfigMismatchError(
            f"config.json: num_labels is {given!r} but id2label names {count} labels: make them agree"
        )
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LABELS:
        raise ConfigMismatchError(
            f"config.json: num_labels must be a whole number from 1 to {MAX_LABELS}, got {count!r}: fix the config"
        )
    return count


def architecture(config: Mapping[str, Any]) -> str:
    """The config's first `architectures` entry ("" when it has none)."""
    names = config.get("architectures")
    return str(names[0]) if isinstance(names, list) and names and isinstance(names[0], str) else ""


@lru_cache(maxsize=64)
def classification_family(labels: int) -> Family:
    """`BertForSequenceClassification` with `labels` labels: the pooler and the classifier replicated."""
    return Family(
        name="bert",
        first=_embeddings("bert."),
        layer=LAYER,
        final=(
            *_pooler("bert."),
            Replicated("classifier.weight", (labels, H)),
            Replicated("classifier.bias", (labels,)),
        ),
        ignored=("bert.embeddings.position_ids",),
        layer_prefix="bert.encoder.layer.{i}.",
        qkv_styles=("separate",),
        qkv_reason=QKV_REASON,
    )


BASE_FAMILY = Family(
    name="bert",
    first=_embeddings(""),
    layer=LAYER,
    final=_pooler(""),
    ignored=("embeddings.position_ids",),
    layer_prefix="encoder.layer.{i}.",
    qkv_styles=("separate",),
    qkv_reason=QKV_REASON,
)
VARIANT_PREFIXES.add(BASE_FAMILY.layer_prefix)


def variant(config: Mapping[str, Any]) -> Family | None:
    """The table of the config's architecture (module doc); None: the pre-training table."""
    arch = architecture(config)
    if arch == CLASSIFICATION:
        return classification_family(num_labels(config))
    return BASE_FAMILY if arch == BASE else None


FAMILY = register(
    Family(
        name="bert",
        first=_embeddings("bert."),
        layer=LAYER,
        final=(
            *_pooler("bert."),
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
        qkv_reason=QKV_REASON,
        variant=variant,
    )
)
