"""BERT, an encoder, built from ONE rank's pieces (NxD's `tp_dp_bert_hf_pretrain` layout, shardkit's
BERT family), with the head of its task (trainer/tasks.py).

The parameters of an `Encoder` are named exactly like the pieces `Family.rank_pieces` gives the
rank for the task's variant of the table (`bert.embeddings.word_embeddings.weight`,
`bert.encoder.layer.3.attention.self.query.weight`, `classifier.weight`, `cls.predictions...`),
so `state_dict()` is the rank file, as for the decoders' `StageModel`:

- the embeddings (word, position, token type, LayerNorm), the pooler and the heads are
  replicated: every tp rank computes them whole;
- per layer, `attention.self.query/key/value` are column-parallel (the rank's heads, with their
  bias slices), `attention.output.dense` row-parallel (partial outputs all-reduced, its bias added
  once), `intermediate.dense` column-parallel and `output.dense` row-parallel, then each
  LayerNorm on the whole hidden state; the tp collectives are the decoders' (trainer/layers.py).

transformers' numerics (BertModel with its eager/SDPA attention): embeddings summed, then
LayerNorm; each layer post-norm (attention, residual, LayerNorm; MLP, residual, LayerNorm); no
causal mask, the padding masked out of the keys; the pooler tanh(dense(h[:, 0])). No dropout:
a run is deterministic and the same in every layout (transformers in eval mode gives its logits).
Activations are batch-first `[batch, seq, hidden]` (no sequence parallelism; one pipeline stage).

A batch is packed as `[batch, 3, seq]` int64 (token ids, token types, attention mask), so the
decoders' micro-batch loop (`pipeline.run_micro_batches`) runs it unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.families.bert import MAX_LABELS
from shardkit.formats import Checkpoint, SourceReader
from shardkit.layout import Layout, ModelDims
from shardkit.placements import Replicated, Segment, build_piece

from . import rows, tasks
from .errors import DataError, TrainerError
from .layers import ColumnParallelLinear, LayerNorm, ParamHolder, RowParallelLinear, TPContext
from .model import ModelSpec, ModuleNames, _place
from .weights import InitialWeights

log = logging.getLogger("trainer")
CLASSIFICATION, PRETRAINING = "sequence-classification", "pretraining"
PREFIX = "bert."
WORDS = "bert.embeddings.word_embeddings.weight"


@dataclass(frozen=True)
class EncoderSpec(ModelSpec):
    """ModelSpec of a BERT model trained for `task` (its config's architecture is the task's head)."""

    task: str = CLASSIFICATION

    @classmethod
    def for_task(cls, config: Mapping[str, Any], layout: Layout, task: str) -> EncoderSpec:
        from shardkit.families import family_for

        family = family_for(config)
        dims = ModelDims.from_config(config)
        family.validate(layout, dims)
        return cls(dict(config), family, dims, layout, task)

    @property
    def names(self) -> ModuleNames:  # the decoders' module names do not apply
        raise TrainerError("an encoder has no decoder module names")

    @property
    def eps(self) -> float:
        return float(self.config.get("layer_norm_eps", 1e-12))

    @property
    def labels(self) -> int:
        return int(self.full_shapes["classifier.bias"][0]) if self.task == CLASSIFICATION else 0

    def replicated_names(self, pp_rank: int) -> set[str]:
        """Every Replicated piece, the MLM decoder tied to the word embeddings included (whose
        table rule has no source of its own when tied)."""
        names = super().replicated_names(pp_rank)
        for rule in self.family.final:
            if isinstance(rule, Replicated) and rule.tied_to and self.dims.tie_word_embeddings:
                names.add(rule.out or rule.name)
        return names

    def tied_alias(self, pp_rank: int) -> bool:
        return False  # no lm_head: the tied MLM decoder is handled by `Encoder.load_pieces`


# ---- reading the rank's pieces ------------------------------------------------------------------------


def read_pieces(
    source: Checkpoint | None, spec: EncoderSpec, tp_rank: int, seed: int
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """This rank's pieces, read from `source` (any layout; a bare BertModel folder's names have no
    `bert.` prefix), and the tensors it does not hold (a new task's head, or every tensor without a
    source) drawn as transformers initialises them (trainer/weights.py's seeded rule: matrices
    N(0, initializer_range), biases zero, LayerNorm scales one, the padding row zero); returns the
    pieces and the names of the tensors drawn."""
    init = InitialWeights(spec, seed)
    pad = spec.config.get("pad_token_id")
    reader = SourceReader(source) if source is not None else None
    held = set(source.family.full_shapes(source.dims)) if source is not None else set()
    drawn: set[str] = set()

    def fetch(seg: Segment) -> torch.Tensor:
        for name in (seg.source, seg.source.removeprefix(PREFIX)):
            if name in held:
                assert reader is not None  # `held` is empty without a source
                return reader.read_segment(replace(seg, source=name))
        drawn.add(seg.source)
        values = init.segment(seg)
        if seg.source == WORDS and isinstance(pad, int) and seg.dim == 0 and seg.start <= pad < seg.stop:
            values[pad - seg.start].zero_()
        return values

    try:
        pieces = {p.name: build_piece(p, fetch) for p in spec.rank_pieces(tp_rank, 0)}
    finally:
        if reader is not None:
            reader.close()
    return pieces, sorted(drawn)


# ---- the modules --------------------------------------------------------------------------------------


class Dense(nn.Module):
    """A replicated linear layer (every tp rank holds and computes it whole)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _activation(spec: EncoderSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    from .tokenizing import LOADING

    with LOADING:  # ranks that are threads of one process (XLA on CPU): transformers imports one at a time
        from transformers.activations import ACT2FN

    name = str(spec.config.get("hidden_act", "gelu"))
    if name not in ACT2FN:
        raise TrainerError(f"bert: hidden_act {name!r} is not an activation transformers knows")
    return ACT2FN[name]


class EncoderLayer(nn.Module):
    """One BERT layer of one tp rank: its heads of query/key/value, the row-parallel output dense,
    its share of the MLP; the LayerNorms whole."""

    def __init__(self, spec: EncoderSpec, ctx: TPContext, dtype: torch.dtype, device: torch.device | None):
        super().__init__()
        dims, tp = spec.dims, spec.layout.tp
        H, q, inter = dims.hidden_size, dims.q_size // tp, dims.intermediate_size // tp
        self.ctx, self.heads, self.head_dim = ctx, dims.num_heads // tp, dims.head_dim
        self.act = _activation(spec)
        for path, module in (
            ("attention.self.query", ColumnParallelLinear(H, q, True, ctx, dtype, device)),
            ("attention.self.key", ColumnParallelLinear(H, q, True, ctx, dtype, device)),
            ("attention.self.value", ColumnParallelLinear(H, q, True, ctx, dtype, device)),
            ("attention.output.dense", RowParallelLinear(q, H, True, ctx, dtype, device)),
            ("attention.output.LayerNorm", LayerNorm(H, spec.eps, True, dtype, device)),
            ("intermediate.dense", ColumnParallelLinear(H, inter, True, ctx, dtype, device)),
            ("output.dense", RowParallelLinear(inter, H, True, ctx, dtype, device)),
            ("output.LayerNorm", LayerNorm(H, spec.eps, True, dtype, device)),
        ):
            _place(self, path, module)

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """h [batch, seq, hidden]; keep [batch, 1, 1, seq] bool: the keys each query may attend."""
        part, param = self.get_submodule, self.get_parameter
        b, s, _ = h.shape
        qkv = [f"attention.self.{name}" for name in ("query", "key", "value")]
        q, k, v = self.ctx.column_linear(h, [param(n + ".weight") for n in qkv], [param(n + ".bias") for n in qkv])
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        h = part("attention.output.LayerNorm")(part("attention.output.dense")(context) + h)
        inner = self.act(part("intermediate.dense")(h))
        return part("output.LayerNorm")(part("output.dense")(inner) + h)


class Encoder(nn.Module):
    """One tp rank of a BERT model with its task's head (module doc). Input `[batch, 3, seq]`
    (ids, token types, attention mask); output the classifier's logits `[batch, labels]`, or
    pre-training's (MLM logits `[batch, seq, vocab]`, next-sentence logits `[batch, 2]`)."""

    def __init__(
        self,
        spec: EncoderSpec,
        ctx: TPContext,
        dtype: torch.dtype,
        activation_checkpointing: bool = False,
        checkpoint_fn: Callable[..., Any] | None = None,
    ):
        super().__init__()
        dims, meta = spec.dims, torch.device("meta")
        H, V = dims.hidden_size, dims.vocab_size
        self.spec, self.task = spec, spec.task
        self.activation_checkpointing = activation_checkpointing
        self.checkpoint_fn = checkpoint_fn or (lambda f, *a: checkpoint(f, *a, use_reentrant=False))
        shapes = spec.full_shapes
        for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
            shape = shapes[f"{PREFIX}embeddings.{name}.weight"]
            _place(self, f"{PREFIX}embeddings.{name}", ParamHolder({"weight": shape}, dtype, meta))
        _place(self, f"{PREFIX}embeddings.LayerNorm", LayerNorm(H, spec.eps, True, dtype, meta))
        layers = nn.ModuleDict({str(i): EncoderLayer(spec, ctx, dtype, meta) for i in range(dims.num_layers)})
        _place(self, f"{PREFIX}encoder.layer", layers)
        _place(self, f"{PREFIX}pooler.dense", Dense(H, H, dtype, meta))
        if self.task == CLASSIFICATION:
            _place(self, "classifier", Dense(H, spec.labels, dtype, meta))
        else:
            _place(self, "cls.predictions.transform.dense", Dense(H, H, dtype, meta))
            _place(self, "cls.predictions.transform.LayerNorm", LayerNorm(H, spec.eps, True, dtype, meta))
            _place(self, "cls.predictions.decoder", ParamHolder({"weight": (V, H)}, dtype, meta))
            self.get_submodule("cls.predictions").register_parameter(
                "bias", nn.Parameter(torch.empty(V, dtype=dtype, device=meta))
            )
            _place(self, "cls.seq_relationship", Dense(H, 2, dtype, meta))
        self.tied = self.task == PRETRAINING and dims.tie_word_embeddings
        self.act = _activation(spec)

    @property
    def layers(self) -> nn.ModuleDict:
        return self.get_submodule(f"{PREFIX}encoder.layer")  # type: ignore[return-value]

    def load_pieces(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the rank's pieces as parameters (names and shapes must match exactly); the MLM
        decoder is the word embeddings' Parameter when the config ties them."""
        expected = {k: tuple(v.shape) for k, v in self.state_dict(keep_vars=True).items()}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if expected != got:
            wrong = sorted(set(expected) ^ set(got)) or sorted(k for k in expected if expected[k] != got[k])
            raise TrainerError(f"the rank's pieces do not fit the encoder: {wrong[0]}")
        dtype = next(iter(self.state_dict(keep_vars=True).values())).dtype
        self.load_state_dict({k: v.to(dtype).contiguous() for k, v in tensors.items()}, assign=True)
        if self.tied:
            self.get_submodule("cls.predictions.decoder").weight = self.get_submodule(
                f"{PREFIX}embeddings.word_embeddings"
            ).weight
        for p in self.parameters():
            p.requires_grad_(True)

    def embed(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        table = self.get_parameter
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = (
            F.embedding(ids, table(f"{PREFIX}embeddings.word_embeddings.weight"))
            + F.embedding(types, table(f"{PREFIX}embeddings.token_type_embeddings.weight"))
            + F.embedding(positions, table(f"{PREFIX}embeddings.position_embeddings.weight"))[None]
        )
        return self.get_submodule(f"{PREFIX}embeddings.LayerNorm")(h)

    def encode(self, batch: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states [batch, seq, hidden] of a packed batch."""
        ids, types, mask = batch.unbind(1)
        keep = (mask != 0)[:, None, None, :]
        h = self.embed(ids, types)
        for layer in self.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = self.checkpoint_fn(layer, h, keep)
            else:
                h = layer(h, keep)
        return h

    def forward(self, batch: torch.Tensor) -> Any:
        part = self.get_submodule
        h = self.encode(batch)
        pooled = torch.tanh(part(f"{PREFIX}pooler.dense")(h[:, 0]))
        if self.task == CLASSIFICATION:
            return part("classifier")(pooled)
        t = part("cls.predictions.transform.LayerNorm")(self.act(part("cls.predictions.transform.dense")(h)))
        mlm = F.linear(
            t, self.get_parameter("cls.predictions.decoder.weight"), self.get_parameter("cls.predictions.bias")
        )
        return mlm, part("cls.seq_relationship")(pooled)


# ---- the task's plan, set-up, loss and evaluation ------------------------------------------------------


@dataclass
class TaskPlan:
    """An encoder run's task, checked before anything starts: its spec (the task's head), the rows."""

    spec: EncoderSpec
    train: tasks.RowData
    eval: tasks.RowData | None
    eval_steps: int
    nsp: bool  # pre-training with next-sentence prediction
    columns: tasks.Columns
    labels: tasks.Labels | None = None


REFUSED = (  # (option, its value when unused, why BERT's tasks do not take it)
    ("pp", 1, "--pp > 1 (the encoder runs as one pipeline stage: use --tp and data parallelism)"),
    ("vpp", 1, "--vpp (one pipeline stage)"),
    ("ep", 1, "--ep (BERT has no experts)"),
    ("kv_multiplier", 1, "--kv-multiplier (BERT's k/v heads are its q heads)"),
    ("sequence_parallel", False, "--sequence-parallel"),
    ("lora_rank", 0, "--lora-rank (LoRA trains the decoders)"),
)


def _check_options(cfg: Any, task: str) -> None:
    for name, unused, what in REFUSED:
        if getattr(cfg, name) != unused:
            raise TrainerError(f"--task {task} does not take {what}: leave it out")


def _task_config(model_config: Mapping[str, Any], task: str, labels: tasks.Labels | None) -> dict[str, Any]:
    """The model's config with the task's head: BertForSequenceClassification with its labels, or
    BertForPreTraining (what checkpoints, `shardkit ckpt export` and `--export-hf` write)."""
    config = {k: v for k, v in model_config.items() if k not in ("num_labels", "problem_type")}
    if task == PRETRAINING:
        return {**config, "architectures": ["BertForPreTraining"]}
    assert labels is not None  # a classification plan has labels
    return {
        **config,
        "architectures": ["BertForSequenceClassification"],
        "id2label": labels.id2label(),
        "label2id": labels.label2id(),
        "problem_type": "single_label_classification",
    }


def plan_task(
    cfg: Any, model_config: Mapping[str, Any], layout: Layout, folders: list[Any], resume: Any
) -> TaskPlan | None:
    """`--task` against the model (a BERT model takes an encoder task, the others causal-lm), its
    options, data, labels and tokenizer; None for a causal LM (checked by the decoders' plan)."""
    from shardkit.families.bert import CLASSIFICATION as CLS_ARCH
    from shardkit.families.bert import architecture

    from .tokenizing import DataOptions, find_tokenizer

    model_type = str(model_config.get("model_type", ""))
    _check_optimizer(cfg, model_config)
    if cfg.task == "causal-lm":
        if model_type == "bert":
            raise TrainerError(
                "bert is an encoder, not a causal LM: train it with --task sequence-classification (--label-column, "
                "--num-labels) or --task pretraining"
            )
        return None
    if model_type != "bert":
        raise TrainerError(f"--task {cfg.task} trains BERT (an encoder); {model_type} is a causal LM: leave --task out")
    _check_options(cfg, cfg.task)
    if str(model_config.get("position_embedding_type", "absolute")) != "absolute":
        raise TrainerError("bert: only absolute position embeddings train here (position_embedding_type 'absolute')")
    if cfg.task == CLASSIFICATION and cfg.num_labels == 1:
        raise TrainerError("--num-labels 1 is a regression, not a classification: give 2 or more labels")
    if cfg.num_labels < 0:
        raise TrainerError(f"--num-labels must not be negative, got {cfg.num_labels}")
    if cfg.num_labels > MAX_LABELS:
        raise TrainerError(
            f"--num-labels {cfg.num_labels} is more labels than any classification has (at most {MAX_LABELS})"
        )
    if cfg.task == PRETRAINING and cfg.num_labels:
        raise TrainerError("--num-labels is for --task sequence-classification: pre-training has no labels to count")
    tok = find_tokenizer(DataOptions(cfg.text_column, cfg.tokenizer, cfg.data_cache), folders, "--data", cfg.data).tok
    vocab = ModelDims.from_config(model_config).vocab_size  # checked: one line for a malformed config
    hints = {
        cfg.text_column: "pass --text-column NAME",
        cfg.label_column: "pass --label-column NAME",
        tasks.NSP_COLUMN: "the next-sentence labels of --data (0: the second text follows, 1: it does not)",
    }
    if cfg.text_pair_column:
        hints[cfg.text_pair_column] = "pass --text-pair-column NAME"
    nsp = False
    if cfg.task == PRETRAINING:
        if tok.mask_token_id is None:
            raise DataError(f"the tokenizer {tok.name_or_path} has no mask token: masked-LM pre-training needs [MASK]")
        nsp = bool(cfg.text_pair_column) and tasks.NSP_COLUMN in rows.open_table(cfg.data, "--data").columns
    label = cfg.label_column if cfg.task == CLASSIFICATION else tasks.NSP_COLUMN if nsp else None
    columns = tasks.Columns(cfg.text_column, cfg.text_pair_column, label, hints)
    train, raw = tasks.read_rows(cfg.data, "--data", columns, tok, cfg.seq_len, vocab)
    evaluated, eval_raw = (
        tasks.read_rows(cfg.eval_data, "--eval-data", columns, tok, cfg.seq_len, vocab) if cfg.eval_data else (None, [])
    )
    labels = None
    if cfg.task == CLASSIFICATION:
        model_labels = _model_labels(model_config) if architecture(model_config) == CLS_ARCH else None
        labels = tasks.choose_labels(train, raw, cfg.num_labels, model_labels)
        if len(labels.names) < 2:
            raise DataError(
                f"{cfg.data} holds one label ({labels.names[0]!r}): a classification needs 2 or more; pass "
                "--num-labels N for N labels of which the data holds some"
            )
        _check_labels(model_config, labels, cfg.num_labels, CLS_ARCH)
        tasks.assign_labels(train, raw, labels, "the model" if model_labels else "--data")
        if evaluated is not None:
            tasks.assign_labels(evaluated, eval_raw, labels, "the model" if model_labels else "--data")
    elif nsp:
        tasks.assign_next_sentence(train, raw)
        if evaluated is not None:
            tasks.assign_next_sentence(evaluated, eval_raw)
    spec = EncoderSpec.for_task(_task_config(model_config, cfg.task, labels), layout, cfg.task)
    if resume is not None:
        _check_resume(resume, spec)
    return TaskPlan(spec, train, evaluated, _eval_steps(cfg, evaluated), nsp, columns, labels)


def _model_labels(config: Mapping[str, Any]) -> dict[str, int] | None:
    """A classifier's labels by name, from its config's `id2label` (ids "0" .. "n-1", names text);
    None when it names none; one line when it is malformed."""
    from shardkit.families.bert import num_labels

    id2label = config.get("id2label")
    if id2label is None:
        return None
    count = num_labels(config)  # an object of the right size, or one line
    names = {str(k): v for k, v in id2label.items()}
    if sorted(names) != sorted(str(i) for i in range(count)) or not all(isinstance(v, str) for v in names.values()):
        raise TrainerError("the model's config.json id2label must map the ids 0 .. n-1 to label names: fix it")
    if len(set(names.values())) != count:
        raise TrainerError("the model's config.json id2label names a label twice: fix it")
    return {names[str(i)]: i for i in range(count)}


def _check_optimizer(cfg: Any, model_config: Mapping[str, Any]) -> None:
    """LAMB's trust ratios are whole tensors' (trainer/lamb.py): refused where a piece stacks experts
    or only adapters train, in one line, before anything starts."""
    if cfg.optimizer != "lamb":
        return
    if cfg.lora_rank:
        raise TrainerError("--optimizer lamb does not take --lora-rank: train LoRA adapters with adamw")
    if ModelDims.from_config(model_config).num_experts:
        raise TrainerError("--optimizer lamb does not train mixture-of-experts models here: use adamw")


def _check_labels(model_config: Mapping[str, Any], labels: tasks.Labels, given: int, arch: str) -> None:
    from shardkit.families.bert import architecture, num_labels

    count = given or len(labels.names)
    if architecture(model_config) == arch and num_labels(model_config) != count:
        raise TrainerError(
            f"the model classifies into {num_labels(model_config)} labels, the run into {count}"
            f"{f' (--num-labels {given})' if given else ''}: give --num-labels {num_labels(model_config)}, or start "
            "from a model without a classifier"
        )


def _check_resume(point: Any, spec: EncoderSpec) -> None:
    """A resumed checkpoint must be of the run's task and labels."""
    from shardkit.families.bert import architecture

    saved, ours = point.config, spec.config
    if architecture(saved) != architecture(ours) or saved.get("id2label") != ours.get("id2label"):
        what = architecture(saved) or "no architecture"
        if architecture(saved) == architecture(ours):
            what = f"labels {sorted(dict(saved.get('id2label') or {}).values())}"
        raise TrainerError(
            f"--resume {point.path} holds {what}, this run trains {architecture(ours)}"
            f"{' with labels ' + str(sorted(ours['id2label'].values())) if 'id2label' in ours else ''}: resume a "
            "checkpoint of this task and labels"
        )


def _eval_steps(cfg: Any, evaluated: tasks.RowData | None) -> int:
    if evaluated is None:
        if cfg.eval_every or cfg.eval_steps:
            raise TrainerError("--eval-every / --eval-steps need --eval-data (held-out rows)")
        return 0
    cover = -(-len(evaluated) // cfg.global_batch)
    return min(cfg.eval_steps or cover, cover)


def announce(plan: Any, drawn: list[str]) -> None:
    """Rank 0's log lines about the task: the rows, the head drawn, what is not applied."""
    task, cfg, spec = plan.task, plan.cfg, plan.spec
    log.info(
        "%s: %s (%s)%s",
        spec.task,
        tasks.row_stats(task.train),
        tasks.describe(task.columns, task.nsp, spec.task),
        f"; labels {', '.join(task.labels.names)}" if task.labels is not None else "",
    )
    if drawn:
        log.info(
            "%s not in %s: initialised as transformers does (normal(0, %g), zero bias, LayerNorm one) from --seed %d",
            ", ".join(drawn) if len(drawn) <= 6 else f"{len(drawn)} tensors",
            cfg.model or "--model-config (random weights)",
            float(spec.config.get("initializer_range") or 0.02),
            cfg.seed,
        )
    dropout = [k for k in ("hidden_dropout_prob", "attention_probs_dropout_prob") if spec.config.get(k)]
    if dropout:
        log.info("dropout (%s) is not applied: every layout trains the same deterministic model", ", ".join(dropout))


def loss_function(task: str, global_batch: int, nsp: bool) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A micro-batch's share of the step's loss: classification, the sum of its rows' cross
    entropies / the global batch; pre-training, the sum of its masked-LM token losses / the global
    batch's masked-LM targets, plus its next-sentence losses / the global batch. So a step's loss
    is transformers' mean over the whole global batch in every layout and micro-batching."""
    inv = 1.0 / global_batch

    def classification(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, ignore_index=tasks.IGNORE, reduction="sum") * inv

    def pretraining(out: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        mlm, sentence = out
        seq = mlm.shape[1]
        count = targets[0, seq + 1].clamp(min=1).to(torch.float32)
        loss = F.cross_entropy(
            mlm.float().reshape(-1, mlm.shape[-1]),
            targets[:, :seq].reshape(-1),
            ignore_index=tasks.IGNORE,
            reduction="sum",
        )
        loss = loss / count
        if nsp:
            loss = (
                loss
                + F.cross_entropy(sentence.float(), targets[:, seq], ignore_index=tasks.IGNORE, reduction="sum") * inv
            )
        return loss

    return classification if task == CLASSIFICATION else pretraining


def set_up(plan: Any, par: Any) -> tuple[Encoder, Any, Any, tasks.RowBatches, Callable, int]:
    """This rank's encoder with its pieces (read, drawn or resumed), optimizer, schedule, rows and
    loss: what trainer/loop.py's `Run` holds."""
    from . import checkpointing
    from .optim import Optimizer, run_settings
    from .preflight import RunSchedule

    cfg, spec, task = plan.cfg, plan.spec, plan.task
    restored, drawn = None, []
    if plan.resume is not None:
        restored = par.all_ok(lambda: checkpointing.load(plan.resume, spec, par))
        tensors = restored.tensors
        if plan.dtype == torch.float32:  # a bf16 run's fp32 masters are the exact weights
            tensors.update({n: e["master"] for n, e in restored.optimizer.items() if "master" in e and n in tensors})
    else:
        tensors, drawn = par.all_ok(lambda: read_pieces(plan.source, spec, par.tp_rank, cfg.seed))
    if par.leader:
        announce(plan, drawn)
    model = Encoder(spec, TPContext(par.tp_group), plan.dtype, cfg.activation_checkpointing, par.comm.checkpoint)
    model.load_pieces(dict(zip(tensors, par.comm.to_device([v.to(plan.dtype) for v in tensors.values()]))))
    model.train()
    optimizer = Optimizer(
        model,
        spec,
        par,
        sources=tensors,
        **run_settings(cfg, restored),
    )
    schedule = RunSchedule(cfg)
    batches = tasks.RowBatches(task.train, spec.task, cfg.global_batch, cfg.micro_batch, plan.dp, par.dp_rank, cfg.seed)
    start = 0
    if restored is not None:
        start = par.all_ok(lambda: checkpointing.apply(restored, optimizer, schedule, batches))
        log.info("resumed from %s at step %d (%s)", plan.resume.path, start, spec.layout.describe())
    par.comm.isolate()  # the set-up in a graph of its own
    return model, optimizer, schedule, batches, loss_function(spec.task, cfg.global_batch, task.nsp), start


def _micro_stats(task: str, out: Any, targets: torch.Tensor) -> torch.Tensor:
    """A held-out micro-batch's sums: classification (loss, correct, rows); pre-training (masked-LM
    loss, correct, targets, next-sentence loss, correct, rows)."""

    def counts(logits: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        logits = logits.float().reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        real = labels != tasks.IGNORE
        loss = F.cross_entropy(logits, labels, ignore_index=tasks.IGNORE, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & real).sum().to(torch.float32)
        return [loss, correct, real.sum().to(torch.float32)]

    if task == CLASSIFICATION:
        return torch.stack(counts(out, targets))
    seq = out[0].shape[1]
    return torch.stack(counts(out[0], targets[:, :seq]) + counts(out[1], targets[:, seq]))


def evaluate(plan: Any, par: Any, run: Any, step: int, summed: Callable, counted: Callable) -> dict[str, Any]:
    """Loss and accuracy over every held-out row (the last batch padded with rows that count for
    nothing), forward only, in file order: the same rows every time and in every layout."""
    import math
    import time

    cfg, spec, comm = plan.cfg, plan.spec, par.comm
    t0 = time.perf_counter()
    assert plan.task.eval is not None  # eval_steps > 0 only with --eval-data
    batches = tasks.RowBatches(
        plan.task.eval, spec.task, cfg.global_batch, cfg.micro_batch, plan.dp, par.dp_rank, cfg.seed, padded=True
    )
    total: Any = None
    run.model.eval()
    try:
        with torch.no_grad():
            for _ in range(plan.eval_steps):
                inputs, targets = batches.step_batch()
                for x, y in zip(inputs.split(cfg.micro_batch), targets.split(cfg.micro_batch)):
                    x, y = x.to(comm.device), y.to(comm.device)
                    stats = _micro_stats(spec.task, run.model(x), y)
                    total = stats if total is None else total + stats
                    comm.cut()
    finally:
        run.model.train()
    values = summed(par, [counted(par, v, par.tp_rank == 0) for v in total.unbind()])
    record: dict[str, Any] = {"event": "eval", "step": step}
    if spec.task == CLASSIFICATION:
        loss, correct, n = values
        record.update(eval_loss=loss / max(n, 1), eval_accuracy=correct / max(n, 1), eval_samples=int(n))
    else:
        mlm, mlm_correct, mlm_n, nsp, nsp_correct, nsp_n = values
        mlm_loss = mlm / max(mlm_n, 1)
        record.update(eval_loss=mlm_loss + (nsp / max(nsp_n, 1) if plan.task.nsp else 0.0), eval_mlm_loss=mlm_loss)
        record.update(eval_ppl=math.exp(min(mlm_loss, 700.0)), eval_mlm_accuracy=mlm_correct / max(mlm_n, 1))
        if plan.task.nsp:
            record["eval_nsp_accuracy"] = nsp_correct / max(nsp_n, 1)
        record["eval_samples"] = len(plan.task.eval)
    record["eval_time"] = time.perf_counter() - t0
    return record
