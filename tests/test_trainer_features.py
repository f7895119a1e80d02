"""The trainer's features for people coming from NxD (tests/test_trainer.py has the core):

1. evaluation on held-out tokens (--eval-data/--eval-every/--eval-steps): the same loss and
   perplexity at tp1pp1, tp2pp1 and tp1pp2, in the metrics;
2. TensorBoard scalars (--tensorboard), rank 0 only; a one-line refusal without tensorboard;
3. pre-training from a config (--model-config): the same initial full weights in every layout;
4. resume honesty: a resume with other --steps/--warmup/--lr/batch sizes is refused (exit 2)
   unless --override-schedule, which says what changed;
5. sequence parallelism keeps only the local chunk of each gathered input for backward.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from trainer_helpers import ROOT, check_ok, corpus_tokens, losses, rel_diff, run_inprocess, steps, torchrun

from shardkit.testing import fixture_config, make_tiny_model

CONFIG = "llama-trainer-tiny"  # 8 q heads, 2 kv heads, head_dim 4, hidden 32, 4 layers, vocab 256
REL = 1e-5
COMMON = ["--seq-len", "32", "--micro-batch", "1", "--global-batch", "4", "--steps", "5", "--lr", "1e-2",
          "--warmup", "2", "--dtype", "fp32", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def hf_model(work) -> Path:
    return make_tiny_model(CONFIG, work / "hf", seed=3)


@pytest.fixture(scope="module")
def tokens(work) -> Path:
    return corpus_tokens(work / "corpus.bin")


# ---- 5. sequence parallelism: only the local chunk is kept for backward ---------------------------------

SP_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from shardkit import open_checkpoint
    from shardkit.layout import make_layout
    from trainer.layers import TPContext, vocab_parallel_cross_entropy
    from trainer.model import ModelSpec, StageModel
    from trainer.parallel import init_parallel
    from trainer.weights import read_rank_pieces

    torch.set_num_threads(1)
    model_dir, seq, batch, hidden = sys.argv[1], 64, 2, None
    par = init_parallel(2, 1, 1, torch.device("cpu"), 120.0)
    ckpt = open_checkpoint(model_dir)
    spec = ModelSpec.from_config(ckpt.config, make_layout(tp=2))
    hidden = spec.dims.hidden_size
    pieces = read_rank_pieces(ckpt, spec, par.tp_rank, 0)
    ids = torch.randint(0, spec.dims.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(7))
    result = {}
    for sp in (False, True):
        model = StageModel(spec, TPContext(par.tp_group, sp), 0, torch.float32, torch.device("cpu"))
        model.load_pieces({k: v.clone() for k, v in pieces.items()})
        saved = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = (t.shape[-1] if t.dim() else 0, t.numel(), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = model.model.embed_tokens(ids[:, :-1].t())
            cos, sin = model.rotary(seq, h.dtype)
            layers_in = h
            for layer in model.model.layers.values():
                h = layer(h, cos, sin)
            layer_saved = dict(saved)
            logits = model.lm_head(model.model.norm(h))
        loss = vocab_parallel_cross_entropy(logits, ids[:, 1:].t(), par.tp_group).mean()
        loss.backward()
        grads = {}
        replicated = spec.replicated_names(0)
        for name, p in model.named_parameters():
            g = p.grad.clone()
            if sp and name in replicated:  # partial over the sequence chunks: the optimizer sums them
                par.tp_group.all_reduce(g)
            grads[name] = g
        # activations of the hidden size (whole or 1/tp of the sequence): inputs of attention and MLP
        hidden_sized = sum(n for last, numel, n in layer_saved.values()
                           if last == hidden and numel in (seq * batch * hidden, seq * batch * hidden // 2))
        result[sp] = {"loss": float(loss), "grads": grads, "layers": sum(n for *_, n in layer_saved.values()),
                      "hidden": hidden_sized}
    off, on = result[False], result[True]
    grad_rel = max(float((on["grads"][k] - off["grads"][k]).abs().max() / off["grads"][k].abs().max().clamp_min(1e-12))
                   for k in off["grads"])
    if par.tp_rank == 0:
        print("RESULT " + json.dumps({"loss": [off["loss"], on["loss"]], "grad_rel": grad_rel,
                                      "layers": [off["layers"], on["layers"]], "hidden": [off["hidden"], on["hidden"]]}))
    torch.distributed.destroy_process_group()
""")


def test_sequence_parallel_keeps_only_the_local_chunk(tmp_path):
    """tp2, 4 decoder layers, seq 64: the bytes autograd saves for backward of hidden-sized
    activations (the attention/MLP inputs, norms, residuals) with sequence parallelism are half of
    those without (the gathered inputs are not kept); loss and gradients are the same to 1e-5."""
    cfg = fixture_config(CONFIG) | {"hidden_size": 48, "head_dim": 6, "intermediate_size": 128}
    model = make_tiny_model(cfg, tmp_path / "hf", seed=1)
    script = tmp_path / "sp_child.py"
    script.write_text(SP_CHILD)
    done = torchrun_script(2, script, [str(model)])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    (loss_off, loss_on), (hidden_off, hidden_on) = result["loss"], result["hidden"]
    assert abs(loss_on - loss_off) / loss_off < REL and result["grad_rel"] < REL, result
    assert hidden_on / hidden_off == pytest.approx(0.5, abs=0.02), result  # 1/tp
    layers_off, layers_on = result["layers"]
    assert layers_on < layers_off - 0.9 * (hidden_off - hidden_on), result


def torchrun_script(nproc: int, script: Path, args: list[str], timeout: float = 180):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
