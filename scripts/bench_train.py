#!/usr/bin/env python
"""Benchmark the trainer.

1. tokens/s of the trainer at tp1pp1 against a plain PyTorch loop (transformers' model +
   torch.optim.AdamW, the same clipping and learning rate) on the same model and data, side by side
   (target: the trainer at least 0.9x the plain loop). The plain loop reads the same batches in the
   same order, so its losses are printed beside the trainer's too (they agree to ~1e-6).
2. step time of tp2 and pp2 (2 local processes, gloo) against tp1 (1 process), with the share of
   the step that is not computation (collectives, pipeline waits and bubbles).
3. LoRA (`--lora-rank 8` on q,k,v,o,gate,up,down) against full fine-tuning at tp1pp1: tokens/s,
   trained parameters and the optimizer state (the bytes of the final checkpoint's optimizer
   file: Adam moments, plus fp32 masters in bf16 runs), the peak resident memory, and the CPU
   seconds of each whole run (wall-clock tokens/s swing when other jobs share the cores; CPU time
   does not).
4. interleaved virtual stages: pp2 vpp2 (ScheduleInterleaved1F1B) against pp2 (Schedule1F1B) at
   the same micro-batches (--vpp-micro-batch), step time and the pipeline's idle share measured
   the same way for both (1 - compute / step time, averaged over the ranks). A model whose layer
   count pp x vpp does not divide runs with its layers rounded down to a multiple of 4.
5. `--moe`: a small Mixtral (8 experts, top-2) at ep2 against ep1, both with dp2 (2 processes; ep1:
   every rank holds every expert; ep2: 4 each, tokens exchanged with all-to-all), and at 1 process,
   with the share of the step spent in the token dispatch collectives (the all-to-alls).
6. `--xla-only` (needs torch-xla): the trainer on torch-xla's CPU runtime (`--device xla`,
   PJRT_DEVICE=CPU, one device) next to gloo CPU on the same model, data and settings: graphs
   compiled by steps 1, 2 and 8, step 1 (tracing and compiling), the median of steps 5-8 (compiled
   graphs only), the slowest of them against step 1, the steady tokens/s, and how far apart the
   two runs' losses are.

    python scripts/bench_train.py                          # tiny fixture + tinyllama-mini, fp32
    python scripts/bench_train.py --models tinyllama-mini --steps 30 --seq-len 256
    python scripts/bench_train.py --vpp-only               # only 4.
    python scripts/bench_train.py --xla-only --models llama-trainer-tiny   # only 6. (torch-xla installed)

Each measurement is the median step time over the steps after the first `--skip`, best of
`--repeats` runs (trainer and plain loop alternate, so background load hits both alike). Every process
uses `--threads-per-process` intra-op threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ---- the plain loop (child process) ------------------------------------------------------------------


def plain_loop(args) -> None:
    """transformers' LlamaForCausalLM + torch.optim.AdamW: what a user writes without the trainer."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from trainer.data import Batches, TokenFile

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    batches = Batches(TokenFile(args.data), args.seq_len, args.global_batch, args.micro_batch, 1, 0, 1234)
    n_micro = args.global_batch // args.micro_batch
    vocab = model.config.vocab_size
    out = open(args.metrics, "w")
    for step in range(args.steps):
        t0 = time.perf_counter()
        inputs, targets = batches.step_batch()
        total = 0.0
        for x, y in zip(inputs.split(args.micro_batch), targets.split(args.micro_batch)):
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1)) / n_micro
            loss.backward()
            total += float(loss)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.write(
            json.dumps(
                {
                    "event": "step",
                    "step": step + 1,
                    "loss": total,
                    "grad_norm": float(norm),
                    "step_time": time.perf_counter() - t0,
                }
            )
            + "\n"
        )
        out.flush()


# ---- driving runs ---------------------------------------------------------------------------------------


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cpu_of_children() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str], env: dict) -> float:
    """Run `cmd`; returns the CPU seconds its processes used (unlike wall time, not inflated when
    other jobs share the cores)."""
    before = _cpu_of_children()
    done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"bench_train: a run failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return _cpu_of_children() - before


def _steps(metrics: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in metrics.read_text().splitlines()) if r.get("event") == "step"]


def optimizer_bytes(ckpt: Path) -> int:
    """The optimizer state of a run: the bytes of its last checkpoint's optimizer files."""
    tags = sorted((p for p in ckpt.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return sum(f.stat().st_size for f in (tags[-1] / "optim").iterdir())


def run_trainer(
    args, model: Path, data: Path, work: Path, name: str, nproc: int, extra: list[str], env: dict | None = None
) -> list[dict]:
    threads = args.threads_per_process
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    common = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--global-batch",
        str(args.global_batch),
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
        "--dtype",
        args.dtype,
        "--threads",
        str(threads),
        "--no-progress",
        "--metrics",
        str(metrics),
        "--decay",
        "constant",
        "--min-lr-ratio",
        "1.0",
        *extra,
    ]
    if nproc == 1:
        cmd = [sys.executable, "-m", "trainer", *common]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "trainer",
            *common,
        ]
    cpu = _run(cmd, {**_env(threads), **(env or {})})
    records = _steps(metrics)
    for r in records:
        r["run_cpu_s"] = cpu  # the whole run's CPU seconds (start-up and the final checkpoint included)
    return records


def run_plain(args, model: Path, data: Path, work: Path) -> list[dict]:
    metrics = work / "plain.jsonl"
    cmd = [
        sys.executable,
        __file__,
        "--child-plain",
        "--model",
        str(model),
        "--data",
        str(data),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--global-batch",
        str(args.global_batch),
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads_per_process),
        "--metrics",
        str(metrics),
    ]
    _run(cmd, _env(args.threads_per_process))
    return _steps(metrics)


def median_step(records: list[dict], skip: int) -> float:
    times = [r["step_time"] for r in records[skip:]] or [r["step_time"] for r in records]
    return statistics.median(times)


def comm_share(records: list[dict], skip: int) -> float:
    values = [r["comm_share"] for r in records[skip:] if "comm_share" in r]
    return statistics.median(values) if values else float("nan")


def build_model(config: str, out: Path, layers: int | None = None) -> Path:
    """A model with transformers' own initialisation (the trainer starts from it like any user);
    `layers` overrides the config's layer count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkit.testing import fixture_config

    cfg = fixture_config(config)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    # positions for any --seq-len benchmarked (the trainer refuses more than the config's; rotary
    # models compute the same values whatever this limit says)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), 4096)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).save_pretrained(out)
    return out


def build_data(out: Path, vocab: int) -> Path:
    import numpy as np

    from trainer.data import write_tokens

    text = (ROOT / "fixtures" / "tiny-corpus.txt").read_bytes()
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.int64) % vocab
    return write_tokens(out, np.tile(tokens, 4), vocab)


def bench_model(args, config: str, work: Path) -> dict:
    import json as _json

    from shardkit.testing import fixture_config

    vocab = fixture_config(config)["vocab_size"]
    model = build_model(config, work / f"{config}-hf")
    data = build_data(work / f"{config}-tokens.bin", vocab)
    tokens_per_step = args.global_batch * args.seq_len
    best: dict[str, tuple[float, list[dict]]] = {}

    def keep(name: str, records: list[dict]) -> None:
        t = median_step(records, args.skip)
        if name not in best or t < best[name][0]:
            best[name] = (t, records)

    for _ in range(args.repeats):
        keep("plain", run_plain(args, model, data, work))
        keep("trainer", run_trainer(args, model, data, work, "tp1", 1, ["--checkpoint-dir", str(work / "ckpt-full")]))
        if args.lora:
            keep(
                "lora",
                run_trainer(args, model, data, work, "lora", 1, [*LORA, "--checkpoint-dir", str(work / "ckpt-lora")]),
            )
    for _ in range(args.repeats if args.parallel else 0):
        keep("tp2", run_trainer(args, model, data, work, "tp2", 2, ["--tp", "2"]))
        keep("pp2", run_trainer(args, model, data, work, "pp2", 2, ["--pp", "2"]))
    result = {"config": config, "params": _count_params(model), "tokens_per_step": tokens_per_step, "runs": {}}
    for name, (t, records) in best.items():
        result["runs"][name] = {
            "step_time": t,
            "tokens_per_s": tokens_per_step / t,
            "comm_share": comm_share(records, args.skip),
            "losses": [r["loss"] for r in records],
            "memory_mb": max(r.get("memory_mb", 0.0) for r in records),
            "run_cpu_s": records[0].get("run_cpu_s"),
        }
    for name, ckpt in (("trainer", "ckpt-full"), ("lora", "ckpt-lora")):
        if name in result["runs"]:
            result["runs"][name]["optimizer_bytes"] = optimizer_bytes(work / ckpt)
    if "lora" in result["runs"]:
        result["lora_params"] = _lora_params(model)
    plain, ours = result["runs"]["plain"], result["runs"]["trainer"]
    result["ratio"] = ours["tokens_per_s"] / plain["tokens_per_s"]
    result["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], plain["losses"]))
    (work / f"{config}-result.json").write_text(_json.dumps(result, indent=2))
    return result


LORA_RANK, LORA_TARGETS = 8, "q,k,v,o,gate,up,down"
LORA = ["--lora-rank", str(LORA_RANK), "--lora-alpha", "16", "--lora-targets", LORA_TARGETS]


def _lora_params(model_dir: Path) -> int:
    """Parameters of the LORA adapters on this model (r x (in + out) per adapted weight)."""
    import math

    from shardkit.formats import load_config
    from shardkit.layout import make_layout
    from trainer.lora import LoraSettings, make_lora, parse_targets
    from trainer.model import ModelSpec

    spec = ModelSpec.from_config(load_config(model_dir), make_layout())
    lora = make_lora(LoraSettings(LORA_RANK, 16.0, parse_targets(LORA_TARGETS)), spec)
    assert lora is not None
    return sum(math.prod(s) for s in lora.spec.full_shapes.values())


VPP_RUNS = (("pp2", "pp2 (1F1B)", []), ("pp2-vpp2", "pp2 vpp2 (interleaved 1F1B)", ["--vpp", "2"]))


def bench_vpp(args, config: str, work: Path) -> dict:
    """pp2 against pp2 vpp2 on the same model, data and micro-batches (best of --repeats, alternating)."""
    from shardkit.testing import fixture_config

    cfg = fixture_config(config)
    layers = cfg["num_hidden_layers"] // 4 * 4
    model = build_model(config, work / f"{config}-vpp-hf", layers=layers)
    data = build_data(work / f"{config}-tokens.bin", cfg["vocab_size"])
    micro = args.vpp_micro_batch
    vpp_args = argparse.Namespace(**{**vars(args), "micro_batch": micro})
    best: dict[str, tuple[float, list[dict]]] = {}
    for _ in range(args.repeats):
        for name, _, extra in VPP_RUNS:
            records = run_trainer(vpp_args, model, data, work, name, 2, ["--pp", "2", *extra])
            t = median_step(records, args.skip)
            if name not in best or t < best[name][0]:
                best[name] = (t, records)
    runs = {
        name: {"step_time": t, "idle_share": comm_share(records, args.skip), "losses": [r["loss"] for r in records]}
        for name, (t, records) in best.items()
    }
    return {"config": config, "layers": layers, "micro_batches": args.global_batch // micro, "runs": runs}


def report_vpp(results: list[dict], args) -> str:
    lines = [
        f"interleaved stages: seq {args.seq_len}, micro-batch {args.vpp_micro_batch}, global batch "
        f"{args.global_batch}, 2 processes",
        "",
        "| model | layers | micro-batches | schedule | step time | vs pp2 | idle share (bubble + transfers) |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        base = r["runs"]["pp2"]["step_time"]
        for name, label, _ in VPP_RUNS:
            run = r["runs"][name]
            lines.append(
                f"| {r['config']} | {r['layers']} | {r['micro_batches']} | {label} | "
                f"{run['step_time'] * 1000:.1f} ms | {run['step_time'] / base:.2f}x | "
                f"{run['idle_share'] * 100:.0f}% |"
            )
    return "\n".join(lines)


MOE_CONFIG = {  # mixtral-tiny, wider: 8 experts of 512, hidden 256, 4 layers, byte vocabulary
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 512,
    "num_local_experts": 8,
    "num_hidden_layers": 4,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


def bench_moe(args, work: Path) -> dict:
    """ep2 vs ep1 (dp2 both) and one process: step time, non-compute and dispatch shares."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkit.testing import fixture_config

    cfg = fixture_config("mixtral-tiny") | MOE_CONFIG
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    torch.manual_seed(0)
    model = work / "moe-hf"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).save_pretrained(model)
    data = build_data(work / "moe-tokens.bin", 256)
    best: dict[str, tuple[float, list[dict]]] = {}
    for _ in range(args.repeats):
        for name, nproc, extra in (
            ("ep1-1proc", 1, []),
            ("ep1-dp2", 2, ["--dp", "2"]),
            ("ep2-dp2", 2, ["--dp", "2", "--ep", "2"]),
        ):
            records = run_trainer(args, model, data, work, f"moe-{name}", nproc, extra)
            t = median_step(records, args.skip)
            if name not in best or t < best[name][0]:
                best[name] = (t, records)
    runs = {}
    for name, (t, records) in best.items():
        timed = records[args.skip :] or records
        runs[name] = {
            "step_time": t,
            "tokens_per_s": args.global_batch * args.seq_len / t,
            "comm_share": comm_share(records, args.skip),
            "dispatch_share": statistics.median(r["dispatch_time"] / r["step_time"] for r in timed),
            "losses": [r["loss"] for r in records],
        }
    return {"config": "mixtral (8 experts, top-2)", "params": _count_params(model), "runs": runs}


def report_moe(result: dict) -> str:
    runs = result["runs"]
    base = runs["ep1-dp2"]["step_time"]
    lines = [
        f"MoE: {result['config']}, {result['params'] / 1e6:.2f}M parameters",
        "",
        "| layout | processes | step time | vs ep1 dp2 | non-compute share | all-to-all share |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, label, n in (("ep1-1proc", "ep1", 1), ("ep1-dp2", "ep1 dp2", 2), ("ep2-dp2", "ep2 dp2", 2)):
        run = runs[name]
        lines.append(
            f"| {label} | {n} | {run['step_time'] * 1000:.1f} ms | {run['step_time'] / base:.2f}x | "
            f"{run['comm_share'] * 100:.0f}% | {run['dispatch_share'] * 100:.1f}% |"
        )
    return "\n".join(lines)


XLA_STEPS = 8  # step 1 traces and compiles; steps 5-8 run compiled graphs only


def bench_xla(args, config: str, work: Path) -> dict:
    """The trainer on torch-xla's CPU runtime (one device) against gloo CPU, tp1pp1, same model,
    data and settings (alternating, best of --repeats by the steady median)."""
    from shardkit.testing import fixture_config

    model = build_model(config, work / f"{config}-xla-hf")
    data = build_data(work / f"{config}-tokens.bin", fixture_config(config)["vocab_size"])
    # one step more than timed: on XLA a step's result is read once the next step is queued, so the
    # last step of a run (read at once) times only what remained of it
    xla_args = argparse.Namespace(**{**vars(args), "steps": max(args.steps, XLA_STEPS + 1)})
    best: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for name, extra, env in (
            ("gloo", ["--device", "cpu"], None),
            ("xla", ["--device", "xla"], {"PJRT_DEVICE": "CPU"}),
        ):
            records = run_trainer(xla_args, model, data, work, f"xla-bench-{name}", 1, extra, env)
            if name not in best or _steady(records) < _steady(best[name]):
                best[name] = records
    runs = {}
    for name, records in best.items():
        compiles = [r.get("xla_compiles") for r in records]
        runs[name] = {
            "step1": records[0]["step_time"],
            "steady": _steady(records),
            "slowest_5_8": max(r["step_time"] for r in records[4:XLA_STEPS]),
            "tokens_per_s": args.global_batch * args.seq_len / _steady(records),
            "compiles": None if compiles[-1] is None else [compiles[0], compiles[1], compiles[XLA_STEPS - 1]],
            "losses": [r["loss"] for r in records],
        }
    gloo, xla = runs["gloo"]["losses"], runs["xla"]["losses"]
    return {
        "config": config,
        "params": _count_params(model),
        "runs": runs,
        "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(xla, gloo)),
    }


def _steady(records: list[dict]) -> float:
    """The median step time of steps 5-8."""
    return statistics.median(r["step_time"] for r in records[4:XLA_STEPS])


def report_xla(results: list[dict], args) -> str:
    lines = [
        f"XLA (torch-xla CPU runtime, one device) against gloo CPU: tp1pp1, {args.dtype}, seq {args.seq_len}, "
        f"micro-batch {args.micro_batch}, global batch {args.global_batch}, {max(args.steps, XLA_STEPS)} steps",
        "",
        "| model | backend | graphs compiled by step 1 / 2 / 8 | step 1 | steps 5-8 (median) | "
        "slowest of 5-8 vs step 1 | steady tok/s | max loss rel diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        for name in ("gloo", "xla"):
            run = r["runs"][name]
            compiles = "-" if run["compiles"] is None else " / ".join(map(str, run["compiles"]))
            xla = name == "xla"  # (gloo compiles nothing: its step 1 is an ordinary step)
            diff = f"{r['max_loss_rel_diff']:.1e}" if xla else "-"
            slowest = f"{run['slowest_5_8'] / run['step1'] * 100:.1f}%" if xla else "-"
            lines.append(
                f"| {r['config']} | {name} | {compiles} | {run['step1'] * 1000:.0f} ms | "
                f"{run['steady'] * 1000:.1f} ms | {slowest} | {run['tokens_per_s']:,.0f} | {diff} |"
            )
    return "\n".join(lines)


def _count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                n = 1
                for s in h.get_slice(k).get_shape():
                    n *= s
                total += n
    return total


def report(results: list[dict], args) -> str:
    lines = [
        f"trainer benchmark: fp32={args.dtype == 'fp32'}, seq {args.seq_len}, micro-batch {args.micro_batch}, "
        f"global batch {args.global_batch}, {args.steps} steps (median after {args.skip}), {args.threads_per_process} thread(s) per process, "
        f"{os.cpu_count()} cores",
        "",
    ]
    lines.append("| model | params | plain loop tok/s | trainer tp1pp1 tok/s | ratio | max loss rel diff |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        p, t = r["runs"]["plain"], r["runs"]["trainer"]
        lines.append(
            f"| {r['config']} | {r['params'] / 1e6:.2f}M | {p['tokens_per_s']:,.0f} | {t['tokens_per_s']:,.0f} | "
            f"{r['ratio']:.2f}x | {r['max_loss_rel_diff']:.1e} |"
        )
    lines += [
        "",
        "| model | layout | processes | step time | vs tp1 | non-compute share (comm, waits, bubbles) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        base = r["runs"]["trainer"]["step_time"]
        for name, label, n in (("trainer", "tp1pp1", 1), ("tp2", "tp2", 2), ("pp2", "pp2 (1F1B)", 2)):
            if name not in r["runs"]:
                continue
            run = r["runs"][name]
            lines.append(
                f"| {r['config']} | {label} | {n} | {run['step_time'] * 1000:.1f} ms | "
                f"{run['step_time'] / base:.2f}x | {run['comm_share'] * 100:.0f}% |"
            )
    if any("lora" in r["runs"] for r in results):
        lines += [
            "",
            "| model | tp1pp1 | trained params | tok/s | vs full | CPU s per run | vs full | "
            "optimizer state | peak RSS |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in results:
            if "lora" not in r["runs"]:
                continue
            full = r["runs"]["trainer"]
            for name, label, trained in (
                ("trainer", "full fine-tuning", r["params"]),
                ("lora", f"LoRA r{LORA_RANK} {LORA_TARGETS}", r["lora_params"]),
            ):
                run = r["runs"][name]
                lines.append(
                    f"| {r['config']} | {label} | {trained / 1e6:.3f}M | {run['tokens_per_s']:,.0f} | "
                    f"{run['tokens_per_s'] / full['tokens_per_s']:.2f}x | {run['run_cpu_s']:.1f} | "
                    f"{run['run_cpu_s'] / full['run_cpu_s']:.2f}x | "
                    f"{run['optimizer_bytes'] / 2**20:.2f} MiB | {run['memory_mb']:.0f} MB |"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child-plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--metrics", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--models", nargs="+", default=["llama-trainer-tiny", "tinyllama-mini"], help="fixture configs to benchmark"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="steps not timed (warm-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--threads-per-process",
        type=int,
        default=1,
        help="intra-op threads of each process (1 avoids oversubscription on a shared machine)",
    )
    parser.add_argument(
        "--no-parallel",
        dest="parallel",
        action="store_false",
        help="only the trainer-vs-plain-loop comparison (skip tp2 and pp2)",
    )
    parser.add_argument(
        "--vpp-micro-batch",
        type=int,
        default=2,
        help="micro-batch of the pp2 vs pp2 vpp2 comparison (more micro-batches: less bubble)",
    )
    parser.add_argument("--no-vpp", dest="vpp", action="store_false", help="skip the pp2 vs pp2 vpp2 comparison")
    parser.add_argument("--vpp-only", action="store_true", help="only the pp2 vs pp2 vpp2 comparison")
    parser.add_argument("--moe", action="store_true", help="also benchmark a Mixtral at ep2 vs ep1 (dp2)")
    parser.add_argument("--moe-only", action="store_true", help="only the MoE benchmark")
    parser.add_argument("--no-lora", dest="lora", action="store_false", help="skip the LoRA run")
    parser.add_argument(
        "--xla-only",
        action="store_true",
        help="only the XLA (torch-xla CPU runtime) against gloo comparison (needs torch-xla)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.child_plain:
        plain_loop(args)
        return 0
    if args.xla_only:
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            xla_results = [bench_xla(args, config, Path(tmp)) for config in args.models]
        print(report_xla(xla_results, args))
        if args.out:
            Path(args.out).write_text(json.dumps({"xla": xla_results}, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        only = args.vpp_only or args.moe_only
        results = [] if only else [bench_model(args, config, Path(tmp)) for config in args.models]
        run_vpp = args.vpp_only or (args.vpp and not args.moe_only)
        vpp_results = [bench_vpp(args, config, Path(tmp)) for config in args.models] if run_vpp else []
        moe = bench_moe(args, Path(tmp)) if args.moe_only or (args.moe and not args.vpp_only) else None
    texts = [report(results, args)] if results else []
    texts += [report_vpp(vpp_results, args)] if vpp_results else []
    texts += [report_moe(moe)] if moe is not None else []
    print("\n\n".join(texts))
    if args.out:
        Path(args.out).write_text(json.dumps({"layouts": results, "vpp": vpp_results, "moe": moe}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
