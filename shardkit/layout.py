"""The layout value: how one model is cut over tensor (tp), pipeline (pp) and expert (ep) ranks.

A Layout is a small frozen value. Everything that depends on the parallel layout and not on a
particular tensor lives here: validation against a model's dimensions, the pipeline stage rule
(with virtual stages: which layers each (pp rank, chunk) holds), and which attention heads each
tp rank holds under kv replication. How individual tensors are
cut is in placements.py; which tensor gets which placement is in families/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigMismatchError, LayoutError, ShardkitError

QKV_STYLES = ("separate", "gqa", "fused", "coalesced")
REPLICATIONS = ("interleaved", "blocked")
HW_TO_REPLICATION = {"trn1": "interleaved", "trn2": "blocked"}


@dataclass(frozen=True)
class ModelDims:
    """The few numbers of a model config that layouts care about."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    # fields some families need (all optional, read by _family_fields)
    moe_intermediate_size: int = 0  # one expert's intermediate size when it differs (Qwen3-MoE)
    dense_mlp_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model (Qwen3-MoE mlp_only_layers)
    moe_every: int = 1  # every n-th layer is MoE (Qwen3-MoE decoder_sparse_step)
    rotary_pct: float = 1.0  # the share of each head that gets rotary (GPT-NeoX rotary_pct, Phi partial_rotary_factor)
    max_position_embeddings: int = 0  # absolute position embeddings (BERT; 0 for rotary models)
    type_vocab_size: int = 0  # token-type embeddings (BERT)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "config.json") -> ModelDims:
        """Read the dimensions from a Hugging Face config.json dict (`where` names it in errors).

        Every size must be a whole number (not a string, a float, null or a list), positive, and
        below a sane bound (so that an absurd config fails at once instead of allocating without
        bound): ConfigMismatchError naming the field otherwise."""
        if not isinstance(config, Mapping):
            raise ConfigMismatchError(f"{where} is not a JSON object: pass the model's Hugging Face config.json")
        config = _aliased(config)

        def whole(key: str, value: Any, minimum: int = 1) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigMismatchError(
                    f"{where}: {key} must be a whole number, got {_short(value)}: fix it in the config "
                    "(or pass the model's config with --config)"
                )
            if value < minimum:
                raise ConfigMismatchError(
                    f"{where}: {key} is {value} but must be at least {minimum}: fix it in the config"
                )
            bound = _MAX_DIMS.get(key)
            if bound is not None and value > bound:
                raise ConfigMismatchError(
                    f"{where}: {key} is {value}, more than any real model ({bound} at most): fix it in the config"
                )
            return value

        def required(key: str) -> int:
            if key not in config:
                raise ConfigMismatchError(
                    f"{where} has no {key!r}: pass the model's Hugging Face config.json (--config)"
                )
            return whole(key, config[key])

        def optional(key: str, default: int, minimum: int = 1) -> int:
            value = config.get(key)
            return default if value is None else whole(key, value, minimum)

        def flag(key: str) -> bool:
            value = config.get(key, False)
            if value is None:
                return False
            if not isinstance(value, bool):
                raise ConfigMismatchError(
                    f"{where}: {key} must be true or false, got {_short(value)}: fix it in the config"
                )
            return value

        model_type = config.get("model_type", "")
        if not isinstance(model_type, str):
            raise ConfigMismatchError(
                f"{where}: model_type must be a string, got {_short(model_type)}: fix it in the config"
            )
        num_heads = required("num_attention_heads")
        hidden = required("hidden_size")
        num_layers = required("num_hidden_layers")
        intermediate = required("intermediate_size")
        vocab = required("vocab_size")
        if config.get("head_dim") is None and hidden % num_heads:
            raise ConfigMismatchError(
                f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {num_heads} and there is no "
                "head_dim: fix the config"
            )
        head_dim = optional("head_dim", hidden // num_heads)
        num_kv_heads = optional("num_key_value_heads", num_heads)
        experts = optional("num_local_experts", 0, minimum=0) or optional("num_experts", 0, minimum=0)
        per_layer = 16 + 4 * experts
        if num_layers * per_layer > _MAX_TENSORS:
            raise ConfigMismatchError(
                f"{where}: num_hidden_layers {num_layers} x num_local_experts {experts} means more than "
                f"{_MAX_TENSORS:,} tensors: fix the config"
            )
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            tie_word_embeddings=flag("tie_word_embeddings")
            if "tie_word_embeddings" in config
            else _tied_by_default(config),
            attention_bias=flag("attention_bias"),
            mlp_bias=flag("mlp_bias"),
            num_experts=experts,
            **_family_fields(config),
        )


_MAX_DIMS = {
    "num_hidden_layers": 4096,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 24,
    "num_local_experts": 4096,
    "num_experts": 4096,
}
"""Upper bounds far above any real model (the largest have ~130 layers, ~256k vocabularies):
a config beyond them is a mistake, refused before anything is sized from it."""

_MAX_TENSORS = 1 << 20


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


TIED_BY_DEFAULT = ("bert", "gemma", "gemma2", "gemma3_text")
"""Model types whose transformers config defaults tie_word_embeddings to True (their real
config.json files usually omit the key)."""


def _tied_by_default(config: Mapping[str, Any]) -> bool:
    return str(config.get("model_type", "")) in TIED_BY_DEFAULT


_ALIASES = {  # a config's own names for the standard keys (DBRX), nested keys as "section.key"
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_hidden_layers": "n_layers",
    "num_key_value_heads": "attn_config.kv_n_heads",
    "intermediate_size": "ffn_config.ffn_hidden_size",
    "num_local_experts": "ffn_config.moe_num_experts",
}


def _aliased(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config with the standard keys filled from a family's own names where it lacks them."""
    extra = {}
    for key, alias in _ALIASES.items():
        if key in config:
            continue
        section, _, name = alias.rpartition(".")
        holder = config.get(section) if section else config
        if isinstance(holder, Mapping) and holder.get(name) is not None:
            extra[key] = holder[name]
    return {**config, **extra} if extra else config


def _family_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The optional ModelDims fields of the newer families, from a config dict."""
    out: dict[str, Any] = {}
    if config.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = int(config["moe_intermediate_size"])
    if config.get("mlp_only_layers"):
        out["dense_mlp_layers"] = tuple(int(i) for i in config["mlp_only_layers"])
    if config.get("decoder_sparse_step"):
        out["moe_every"] = int(config["decoder_sparse_step"])
    rope_parameters = config.get("rope_parameters")
    rope: Mapping[str, Any] = rope_parameters if isinstance(rope_parameters, Mapping) else {}
    pct = config.get("rotary_pct", config.get("partial_rotary_factor", rope.get("partial_rotary_factor")))
    if pct is not None:
        out["rotary_pct"] = float(pct)
    if config.get("type_vocab_size"):  # absolute position and token-type embeddings are weights (BERT)
        out["type_vocab_size"] = int(config["type_vocab_size"])
        out["max_position_embeddings"] = int(config["max_position_embeddings"])
    return out


@dataclass(frozen=True)
class Layout:
    """A parallel layout. tp=pp=ep=1 with separate q/k/v is the full (unsharded) model."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    kv_multiplier: int = 1
    kv_replication: str = "interleaved"
    qkv: str = "separate"
    vpp: int = 1  # virtual pipeline stages (chunks) per pp rank, NxD's virtual_pipeline_size

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "ep", "kv_multiplier", "vpp"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{field} must be a positive whole number, got {value!r}")
        if self.kv_replication not in REPLICATIONS:
            raise LayoutError(
                f"kv replication {self.kv_replication!r} is unknown: use one of {', '.join(REPLICATIONS)}"
            )
        if self.qkv not in QKV_STYLES:
            raise LayoutError(f"qkv style {self.qkv!r} is unknown: use one of {', '.join(QKV_STYLES)}")

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; vpp only when it is not 1 (so plain layouts read as before)."""
        data = dataclasses.asdict(self)
        if self.vpp == 1:
            del data["vpp"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def describe(self) -> str:
        parts = [f"tp {self.tp}", f"pp {self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp {self.vpp}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.kv_multiplier > 1:
            parts.append(f"kv-multiplier {self.kv_multiplier} ({self.kv_replication})")
        parts.append(f"qkv {self.qkv}")
        return ", ".join(parts)

    # ---- validation ----------------------------------------------------------------------
    def validate(self, dims: ModelDims) -> None:
        """Raise LayoutError with the reason when this layout cannot hold the model.

        Rules that depend on how the family places its tensors (a vocabulary split over tp must
        divide by tp; qkv styles) are the family's: `Family.validate` checks both."""
        q, kv, m, t = dims.num_heads, dims.num_kv_heads, self.kv_multiplier, self.tp
        if q % kv:
            raise ConfigMismatchError(f"{q} attention heads are not a multiple of {kv} kv heads: check config.json")
        if q % t:
            raise LayoutError(f"{q} q heads are not divisible by tp {t}: choose a tp that divides {q}")
        if (kv * m) % t:
            hint = f"use --kv-multiplier {_smallest_multiplier(kv, t)}" if t % kv == 0 or kv % t == 0 else ""
            raise LayoutError(
                f"{kv} kv heads x kv-multiplier {m} = {kv * m} is not a multiple of tp {t}"
                + (
                    f": {hint}"
                    if hint
                    else ": choose tp and kv-multiplier so that kv heads x multiplier is a multiple of tp"
                )
            )
        if q % (kv * m):
            raise LayoutError(
                f"kv-multiplier {m} is too large: {kv} kv heads x {m} replicas = {kv * m} do not divide "
                f"{q} q heads (each replica must serve a whole number of q heads)"
            )
        if dims.intermediate_size % t:
            raise LayoutError(f"intermediate size {dims.intermediate_size} is not divisible by tp {t}")
        if dims.num_layers < self.pp:
            raise LayoutError(
                f"{dims.num_layers} layers cannot fill {self.pp} pipeline stages: use pp <= {dims.num_layers}"
            )
        if dims.num_layers < self.chunks:
            raise LayoutError(
                f"{dims.num_layers} layers cannot fill pp {self.pp} x vpp {self.vpp} = {self.chunks} pipeline "
                f"chunks: use pp x vpp <= {dims.num_layers}"
            )
        if self.ep > 1 and (dims.num_experts == 0 or dims.num_experts % self.ep):
            raise LayoutError(
                f"ep {self.ep} needs a mixture-of-experts model whose expert count divides by it "
                f"(this model has {dims.num_experts or 'no'} experts)"
            )

    # ---- ranks and stages ----------------------------------------------------------------
    def ranks(self) -> Iterator[tuple[int, int, int]]:
        """Every (ep, tp, pp) rank, in file-name order."""
        for ep in range(self.ep):
            for tp in range(self.tp):
                for pp in range(self.pp):
                    yield ep, tp, pp

    @property
    def chunks(self) -> int:
        """Pipeline chunks of consecutive layers over the whole model: pp x vpp."""
        return self.pp * self.vpp

    def chunk_layers(self, num_layers: int) -> list[range]:
        """Decoder layers of each of the pp x vpp chunks in model order: an even split, the
        remainder to the LAST chunks (NxD's partition rule). With vpp 1 a chunk is a stage."""
        base, extra = divmod(num_layers, self.chunks)
        chunks, start = [], 0
        for chunk in range(self.chunks):
            count = base + (1 if chunk >= self.chunks - extra else 0)
            chunks.append(range(start, start + count))
            start += count
        return chunks

    def chunk_rank(self, chunk: int) -> int:
        """The pp rank that runs `chunk`: chunks go round-robin over the pp ranks (NxD's rule)."""
        return chunk % self.pp

    def rank_chunks(self, pp_rank: int) -> list[int]:
        """The chunks pp_rank runs, in model order: pp_rank, pp_rank + pp, ..."""
        return list(range(pp_rank, self.chunks, self.pp))

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """Decoder layers each pp rank holds (its rank file's layers), in model order: the layers
        of its chunks (one run of consecutive layers per chunk; a single run when vpp is 1)."""
        chunks = self.chunk_layers(num_layers)
        return [[i for c in self.rank_chunks(r) for i in chunks[c]] for r in range(self.pp)]

    # ---- attention heads under kv replication ----------------------------------------------
    def kv_entries(self, dims: ModelDims, tp_rank: int) -> list[tuple[int, int]]:
        """(kv head, replica) entries held by tp_rank, in the order they sit in its k/v pieces.

        K/V are replicated kv_multiplier times (interleaved = `repeat`: K0..Kn-1, K0..Kn-1, ...;
        blocked = `repeat_interleave`: K0 x m, K1 x m, ...) and the result is split contiguously.
        """
        kv, m = dims.num_kv_heads, self.kv_multiplier
        per_rank = kv * m // self.tp
        entries = []
        for i in range(tp_rank * per_rank, (tp_rank + 1) * per_rank):
            entries.append((i % kv, i // kv) if self.kv_replication == "interleaved" else (i // m, i % m))
        return entries

    def q_heads(self, dims: ModelDims, tp_rank: int) -> list[int]:
        """q heads held by tp_rank, in order: for each kv entry, the q heads its replica serves."""
        group = dims.num_heads // dims.num_kv_heads
        per_replica = group // self.kv_multiplier
        heads: list[int] = []
        for kv_head, replica in self.kv_entries(dims, tp_rank):
            first = kv_head * group + replica * per_replica
            heads.extend(range(first, first + per_replica))
        return heads


FULL = Layout()
"""The trivial layout: one rank, the whole model (a Hugging Face checkpoint)."""


def _smallest_multiplier(kv: int, tp: int) -> int:
    m = 1
    while (kv * m) % tp:
        m += 1
    return m


def make_layout(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    kv_multiplier: int = 1,
    kv_replication: str | None = None,
    hw: str | None = None,
    qkv: str | None = None,
    inherit: Layout | None = None,
    vpp: int = 1,
) -> Layout:
    """A Layout from CLI-style options (`hw` trn1/trn2 is an alias for the replication).

    `qkv` and `kv_replication` (or `hw`) left unset come from `inherit` when given (a source's
    layout: resharding keeps its qkv style and replica order unless asked otherwise), else the
    defaults: separate q/k/v, interleaved replicas."""
    if hw is not None:
        if hw not in HW_TO_REPLICATION:
            raise ShardkitError(f"hardware {hw!r} is unknown: use trn1 or trn2")
        if kv_replication and kv_replication != HW_TO_REPLICATION[hw]:
            raise ShardkitError(f"--hw {hw} means {HW_TO_REPLICATION[hw]} replication, not {kv_replication}")
        kv_replication = HW_TO_REPLICATION[hw]
    base = inherit if inherit is not None else FULL
    return Layout(
        tp=tp,
        pp=pp,
        ep=ep,
        kv_multiplier=kv_multiplier,
        kv_replication=kv_replication or base.kv_replication,
        qkv=qkv or base.qkv,
        vpp=vpp,
    )
