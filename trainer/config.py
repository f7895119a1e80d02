"""The run's configuration: one dataclass whose every field has a default and a one-line doc.

The command line (`python -m trainer` / torchrun) is generated from it, so a field added here is
an option there; library users build a TrainConfig directly and call `trainer.train(config)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from shardkit.formats import format_names

from .errors import TrainerError


def _opt(default: Any, doc: str, *aliases: str, choices: Sequence[str] | None = None, metavar: str | None = None):
    return field(default=default, metadata={"doc": doc, "aliases": aliases, "choices": choices, "metavar": metavar})


VPP_DOC = (
    "Virtual pipeline stages per pp rank (NxD's virtual_pipeline_size): layers cut into pp x vpp chunks, "
    "chunk c on pp rank (c mod pp), run by the interleaved 1F1B schedule."
)


@dataclass
class TrainConfig:
    # ---- what to train on ----------------------------------------------------------------------
    model: str = _opt(
        None,
        "Model to start from: a Hugging Face directory or sharded directory of any layout "
        "(resharded on load to this run's layout).",
        metavar="DIR",
    )
    model_config: str = _opt(
        None,
        "Pre-train from random weights instead of --model: a Hugging Face config.json "
        "(or a directory holding one); the same full weights in every layout for a "
        "--seed (trainer/README.md gives the rule).",
        metavar="FILE",
    )
    data: str = _opt(
        None,
        "Training data, local or s3://: a token file (scripts/prepare_data.py writes one; .npy too), or text "
        "tokenized with the model's tokenizer and cached: .txt, .jsonl, .csv, .parquet or a datasets "
        "save_to_disk folder (prompt/completion or messages columns: loss on the completions only).",
        metavar="PATH",
    )
    eval_data: str = _opt(
        None, "Held-out data: evaluate loss and perplexity on it (the same kinds as --data).", metavar="PATH"
    )
    text_column: str = _opt("text", "The column of --data / --eval-data rows that holds the text.", metavar="NAME")
    tokenizer: str = _opt(
        None, "Tokenize text data with this local tokenizer folder (default: the model folder's).", metavar="DIR"
    )
    data_cache: str = _opt(
        None,
        "Where tokenized text data is cached (default: $SHARDKIT_CACHE/tokens, else ~/.cache/shardkit/tokens).",
        metavar="DIR",
    )
    task: str = _opt(
        "causal-lm",
        "What to train: causal-lm (the decoders), or for BERT sequence-classification (labelled rows) or "
        "pretraining (masked LM, and next-sentence prediction on sentence pairs).",
        choices=("causal-lm", "sequence-classification", "pretraining"),
    )
    text_pair_column: str = _opt(
        None, "BERT tasks: the column holding each row's second text (a sentence pair).", metavar="NAME"
    )
    label_column: str = _opt("label", "sequence-classification: the column holding each row's label.", metavar="NAME")
    num_labels: int = _opt(
        0, "sequence-classification: the number of labels (0: the model's, else as many as --data has)."
    )
    eval_every: int = _opt(0, "Evaluate every N steps, and after the last (0: only after the last).")
    eval_steps: int = _opt(
        0,
        "Batches of --global-batch sequences per evaluation, from the start of --eval-data "
        "(0: every whole batch it holds).",
    )
    # ---- parallel layout -----------------------------------------------------------------------
    tp: int = _opt(1, "Tensor-parallel degree.", "--tp-size")
    pp: int = _opt(1, "Pipeline-parallel stages (1F1B schedule over micro-batches).", "--pp-size")
    vpp: int = _opt(1, VPP_DOC, "--virtual-pipeline-size")
    pp_schedule: str = _opt(
        "auto",
        "Pipeline schedule (torch.distributed.pipelining): auto = 1f1b (gpipe with fewer "
        "micro-batches than stages), interleaved with --vpp > 1; interleaved-zb = interleaved "
        "zero bubble; zbv is refused (it needs a V-shaped stage placement).",
        choices=("auto", "1f1b", "gpipe", "interleaved", "interleaved-zb", "looped-bfs", "zbv"),
    )
    dp: int = _opt(0, "Data-parallel degree (default: world size / (tp x pp)).", "--dp-size")
    ep: int = _opt(
        1,
        "Expert-parallel degree (mixture-of-experts models): experts split over ep ranks carved out of the "
        "data-parallel ranks (ep divides dp and the expert count).",
        "--ep-size",
    )
    capacity_factor: float = _opt(
        0.0,
        "MoE expert capacity: per micro-batch each expert takes at most ceil(F x tokens x top-k / experts) "
        "of a rank's assignments, first choices first, the rest dropped (0: no drop).",
    )
    kv_multiplier: int = _opt(
        1, "Replicate K/V heads this many times (NxD's kv_size_multiplier).", "--kv-size-multiplier"
    )
    kv_replication: str | None = _opt(
        None,
        "Order of K/V replicas (interleaved = Trn1, blocked = Trn2); default: "
        "--model's when it is sharded, else interleaved.",
        choices=("interleaved", "blocked"),
    )
    qkv: str | None = _opt(
        None,
        "How q/k/v are held: separate, gqa (NxD qkv_proj.weight_q/_k/_v), fused, coalesced; "
        "default: --model's when it is sharded, else separate.",
        choices=("separate", "gqa", "fused", "coalesced"),
    )
    zero1: bool = _opt(False, "Shard optimizer state (and fp32 master weights) over data-parallel ranks (ZeRO-1).")
    sequence_parallel: bool = _opt(False, "Sequence parallelism: norms and residuals on 1/tp of the sequence.")
    activation_checkpointing: bool = _opt(False, "Recompute each decoder layer in backward (saves activation memory).")
    # ---- LoRA (trainer/lora.py) ----------------------------------------------------------------
    lora_rank: int = _opt(
        0, "LoRA: train rank-r adapters on the --lora-targets, the model frozen (0: train every weight)."
    )
    lora_alpha: float = _opt(8.0, "LoRA scaling numerator: adapters add (alpha / rank) * B A, as peft.")
    lora_targets: str = _opt("q,v", "LoRA: the adapted linear layers, some of q,k,v,o,gate,up,down.", metavar="LIST")
    # ---- batch and schedule --------------------------------------------------------------------
    micro_batch: int = _opt(1, "Sequences per micro-batch per data-parallel rank.")
    global_batch: int = _opt(8, "Sequences per optimizer step over all data-parallel ranks.")
    seq_len: int = _opt(512, "Tokens per sequence.")
    steps: int = _opt(100, "Optimizer steps to train (total, counting steps before a resume).")
    lr: float = _opt(3e-4, "Peak learning rate.")
    min_lr_ratio: float = _opt(0.1, "Learning rate at the end of the decay, as a fraction of --lr.")
    warmup: int = _opt(0, "Linear warm-up steps.")
    decay: str = _opt("cosine", "Learning-rate decay after warm-up.", choices=("cosine", "linear", "constant"))
    optimizer: str = _opt(
        "adamw",
        "AdamW, or LAMB (trainer/lamb.py: NxD's BERT example's, with its trust ratio).",
        choices=("adamw", "lamb"),
    )
    weight_decay: float = _opt(0.0, "AdamW weight decay (not applied to norms and biases).")
    beta1: float = _opt(0.9, "AdamW beta1.")
    beta2: float = _opt(0.95, "AdamW beta2.")
    eps: float = _opt(1e-8, "AdamW epsilon.")
    clip_grad: float = _opt(
        1.0, "Clip the global gradient norm (over all ranks) to this; 0 disables.", "--max-grad-norm"
    )
    grad_bucket_mb: float = _opt(
        512.0,
        "Data-parallel gradients are all-reduced in buckets of at most this many MiB, the last layers' first "
        "(NxD's default bucket; a larger gradient goes alone): bounded extra memory, collectives that can overlap.",
    )
    seed: int = _opt(1234, "Seed of the data order and of --model-config's random weights.")
    dtype: str = _opt(
        "bf16",
        "Weights and activations dtype (bf16 keeps fp32 master weights in the optimizer).",
        choices=("bf16", "fp32"),
    )
    # ---- checkpoints ---------------------------------------------------------------------------
    checkpoint_dir: str = _opt(
        None,
        "Where training checkpoints go (NxD tree: <dir>/<tag>/...): one run's, recorded in <dir>/run.json; a run "
        "without --resume into another run's folder is refused.",
        metavar="DIR",
    )
    checkpoint_every: int = _opt(0, "Save a checkpoint every N steps (0: only at the end when --checkpoint-dir).")
    num_kept: int = _opt(0, "Keep the newest N checkpoints (0: keep all).")
    keep_every: int = _opt(0, "Also keep every checkpoint whose step is a multiple of N (0: none).")
    async_save: bool = _opt(False, "Write checkpoints in the background while training continues.")
    checkpoint_format: str = _opt("torch", "Format of checkpoint shards.", choices=tuple(format_names()))
    resume: str = _opt(
        None,
        "Resume from a training checkpoint of ANY layout: a tag directory, a checkpoint "
        "directory (newest tag), or latest_if_exists (newest tag of --checkpoint-dir, if any); the run goes on as "
        "that checkpoint's run.",
        metavar="CKPT",
    )
    override_schedule: bool = _opt(
        False,
        "Resume even though --steps, --warmup, --lr, --decay, --min-lr-ratio, "
        "--global-batch or --seq-len differ from the checkpoint's run (refused "
        "otherwise): continue with this run's values.",
    )
    # ---- output --------------------------------------------------------------------------------
    export_hf: str = _opt(
        None,
        "At the end, write the merged Hugging Face model here (a folder, or s3://bucket/prefix: "
        "uploaded and committed like shardkit's outputs). DIR must be new, empty, or "
        "this run's own earlier export (same --model, --data and --checkpoint-dir), which is "
        "replaced, or kept when it already holds the final step.",
        metavar="DIR",
    )
    export_lora: bool = _opt(
        False, "With --lora-rank: --export-hf writes the PEFT adapter directory, not the merged model."
    )
    overwrite_export: bool = _opt(False, "Let --export-hf replace a non-empty DIR that is not this run's export.")
    metrics: str = _opt(
        None, "JSONL metrics file (default: <checkpoint-dir>/metrics.jsonl when --checkpoint-dir).", metavar="FILE"
    )
    tensorboard: str = _opt(
        None,
        "Also write TensorBoard scalars (loss, lr, grad norm, tokens/s, eval loss, memory) "
        "here, from rank 0 (needs the tensorboard package).",
        metavar="DIR",
    )
    log_every: int = _opt(1, "Update the progress bar every N steps (metrics are written every step).")
    progress: bool = _opt(True, "Show a progress bar on rank 0 (--no-progress to hide).")
    # ---- runtime -------------------------------------------------------------------------------
    device: str = _opt(
        None,
        "Force the device: cpu (gloo), cuda (nccl) or xla (Trainium, or CPU_NUM_DEVICES devices on CPU; "
        "needs torch-xla). Default: xla when torch-xla is installed and no CUDA device is, else cuda, else cpu.",
        choices=("cpu", "cuda", "xla"),
    )
    timeout: float = _opt(600.0, "Seconds before a collective gives up (no rank hangs forever).")
    threads: int = _opt(
        0,
        "CPU threads per process (0: OMP_NUM_THREADS when set, else one per physical core of the process's "
        "CPU affinity, divided among the job's processes on the host). Threads wait passively when other work keeps half "
        "its CPUs busy at start, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT says how.",
    )
    debug: bool = _opt(False, "On an error, also print the traceback of each rank that failed (or TRAINER_DEBUG=1).")

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def check_positions(seq_len: int, model_config: Mapping[str, Any]) -> None:
    """Refuse a --seq-len longer than the model's positions (`max_position_embeddings`), before
    anything starts: the model has none past them (it never saw them; a learned table ends there),
    and a run that trains on them anyway would only show it in its losses."""
    limit = model_config.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seq_len:
        raise TrainerError(
            f"--seq-len {seq_len} is longer than the model's {limit} positions (max_position_embeddings in its "
            f"config.json): use --seq-len {limit} or less"
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class UsageError(TrainerError):
    """A command line argparse cannot parse: an unknown (misspelt) option, a bad value, a missing one."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (UsageError, exit 2), not its usage, wrapped
    over dozens of lines, and then the message: argparse's message, a did-you-mean for a misspelt
    option, and where the help is."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}{self._did_you_mean(message)}. Try '{self.prog} --help' for help.")

    def _did_you_mean(self, message: str) -> str:
        """` (Did you mean --seq-len?)` for the unrecognised options of `message` that are near known ones."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        near = []
        for word in message[len(prefix) :].split():
            if word.startswith("--"):
                near += [m for m in difflib.get_close_matches(word.split("=")[0], known, n=3) if m not in near]
        if len(near) > 1:
            return f" (Did you mean one of: {', '.join(near)}?)"
        return f" (Did you mean {near[0]}?)" if near else ""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m trainer",
        description="shardkit's slim trainer: tensor, pipeline, data and expert parallel training of decoder "
        "LLMs (Llama, Mistral, Qwen, Gemma, Phi-3, GPT-NeoX, Mixtral, DBRX) "
        "from Hugging Face or sharded (NxD) checkpoints of any layout. Run it with torchrun, e.g. "
        "torchrun --nproc-per-node 8 -m trainer --model ./llama-tp2pp2 --data ./tokens.bin "
        "--tp 2 --pp 2 --dp 2 --zero1 --global-batch 16 --seq-len 2048 --steps 1000",
    )
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        flags = [_flag(f.name), *meta.get("aliases", ())]
        if isinstance(f.default, bool):
            parser.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=meta["doc"]
            )
            continue
        kind = type(f.default) if f.default is not None else str
        parser.add_argument(
            *flags,
            dest=f.name,
            type=kind,
            default=f.default,
            help=meta["doc"],
            choices=meta.get("choices"),
            metavar=meta.get("metavar"),
        )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns))
