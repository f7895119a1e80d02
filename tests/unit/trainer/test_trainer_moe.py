"""Mixture-of-experts training (trainer/moe.py): a tiny Mixtral (4 experts, top-2, 3 layers) with
a load-balancing coefficient large enough that its gradient visibly moves the weights.

1. ep1 (one process) is transformers' MixtralForCausalLM (output_router_logits=True, loss = LM +
   router_aux_loss_coef x aux) trained by torch AdamW, step for step: the LM loss and the aux loss;
2. parallel equals serial (real gloo jobs, fp32, 1e-5): ep2, ep2 x edp2 (dp4), ep2 with tp2 (and
   its --export-hf equals the serial export), ep2 with tp2 and sequence parallelism, ep2 with pp2
   from shards converted at tp2 ep4 (with evaluation), and ZeRO-1 at ep1 dp2;
3. a checkpoint saved at ep2 tp1 resumes at ep1 tp2 (sequence parallel, activation checkpointing) and reproduces
   the uninterrupted run;
4. capacity factor: which assignments are kept (unit), drops counted in the metrics and the same
   at ep1 and ep2; a capacity that cannot overflow equals the no-drop run;
5. Qwen3-MoE: ep1 is transformers' Qwen3MoeForCausalLM + AdamW, ep2 tp2 equals it;
   bad input (--ep on a dense model, ep not dividing the experts or dp): one line, exit 2;
6. (slow) a tiny Mixtral learns the bundled text; its export loads and generates with transformers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import CORPUS, check_ok, corpus_tokens, rel_diff, run_inprocess, run_ranks, steps, torchrun

from shardkit import Layout, convert
from shardkit.testing import fixture_config, make_tiny_model

CONFIG = "mixtral-tiny"  # hidden 64, 16 q / 4 kv heads, 4 experts (intermediate 32), top-2, 3 layers, vocab 64
AUX_COEF = 0.5
VOCAB = 64
REL = 1e-5
EVAL = ["--eval-every", "2"]  # --eval-data: the training tokens' first batch (held-out data in real runs)
COMMON = [
    "--seq-len",
    "32",
    "--micro-batch",
    "1",
    "--global-batch",
    "4",
    "--steps",
    "5",
    "--lr",
    "1e-2",
    "--warmup",
    "2",
    "--dtype",
    "fp32",
    "--no-progress",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer-moe")


@pytest.fixture(scope="module")
def hf_model(work) -> Path:
    return make_tiny_model(fixture_config(CONFIG) | {"router_aux_loss_coef": AUX_COEF}, work / "hf", seed=3)


@pytest.fixture(scope="module")
def tokens(work) -> Path:
    return corpus_tokens(work / "corpus.bin", vocab=VOCAB)


def run_args(model: Path, data: Path, metrics: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--data", str(data), "--metrics", str(metrics), *COMMON, *extra]


def curves(metrics: Path) -> tuple[list[float], list[float]]:
    records = steps(metrics)
    return [r["loss"] for r in records], [r["aux_loss"] for r in records]


@pytest.fixture(scope="module")
def serial(work, hf_model, tokens):
    """ep1 tp1 pp1 in this process: its (LM losses, aux losses) and its export."""
    metrics = work / "ep1.jsonl"
    summary = run_inprocess(
        run_args(
            hf_model,
            tokens,
            metrics,
            *EVAL,
            "--eval-data",
            str(tokens),
            "--eval-steps",
            "1",
            "--export-hf",
            str(work / "ep1-export"),
        )
    )
    assert summary.eval_loss is not None
    return curves(metrics), work / "ep1-export"


def eval_losses(metrics: Path) -> list[float]:
    import json

    records = (json.loads(line) for line in metrics.read_text().splitlines())
    return [r["eval_loss"] for r in records if r.get("event") == "eval"]


# ---- 1. the serial run is transformers + AdamW ----------------------------------------------------------


def reference_curves(hf_model: Path, tokens: Path) -> tuple[list[float], list[float]]:
    """transformers' model (output_router_logits=True; loss = LM + router_aux_loss_coef x aux) +
    torch AdamW on COMMON's batches: the (LM losses, aux losses) per step."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from trainer.data import Batches, TokenFile
    from trainer.optim import LRSchedule

    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    assert model.config.router_aux_loss_coef == AUX_COEF
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    schedule = LRSchedule(1e-2, 2, 5, "cosine", 0.1)
    batches = Batches(TokenFile(tokens), 32, 4, 1, 1, 0, 1234)
    lm_losses, aux_losses = [], []
    for step in range(5):
        inputs, targets = batches.step_batch()
        lm_total = aux_total = 0.0
        for x, y in zip(inputs.split(1), targets.split(1)):
            out = model(input_ids=x, output_router_logits=True)
            lm = F.cross_entropy(out.logits.float().view(-1, VOCAB), y.reshape(-1))
            ((lm + model.config.router_aux_loss_coef * out.aux_loss) / 4).backward()
            lm_total += float(lm.detach()) / 4
            aux_total += float(out.aux_loss.detach()) / 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = schedule.at(step)
        opt.step()
        opt.zero_grad()
        lm_losses.append(lm_total)
        aux_losses.append(aux_total)
    assert abs(lm_losses[-1] - lm_losses[0]) > 0.1, "the weights barely moved: the comparison would be weak"
    return lm_losses, aux_losses


def test_ep1_equals_transformers_mixtral_and_adamw(hf_model, tokens, serial):
    lm_losses, aux_losses = reference_curves(hf_model, tokens)
    (ours_lm, ours_aux), _ = serial
    assert rel_diff(ours_lm, lm_losses) < REL, (ours_lm, lm_losses)
    assert rel_diff(ours_aux, aux_losses) < REL, (ours_aux, aux_losses)


def test_the_aux_loss_gradient_matters(work, hf_model, tokens, serial):
    """Without the load-balancing term the run differs: the comparisons above do test its gradient."""
    cfg = fixture_config(CONFIG) | {"router_aux_loss_coef": 0.0}
    plain = make_tiny_model(cfg, work / "hf-no-aux", seed=3)
    metrics = work / "ep1-no-aux.jsonl"
    run_inprocess(run_args(plain, tokens, metrics))
    (with_aux, _), _ = serial
    assert rel_diff(curves(metrics)[0], with_aux) > 1e-4


# ---- 2. parallel equals serial ----------------------------------------------------------------------------

PARALLEL_CASES = {
    "ep2": (2, ["--ep", "2"]),
    "ep2-dp4": (4, ["--ep", "2", "--dp", "4"]),  # two expert-data-parallel replicas of each expert
    "ep2-dp4-zero1": (4, ["--ep", "2", "--dp", "4", "--zero1"]),  # state cut over them; resumed at ep1 below
    "ep2-tp2": (4, ["--ep", "2", "--tp", "2", "--qkv", "fused"]),
    "ep2-pp2": (4, ["--ep", "2", "--pp", "2"]),
    "ep2-tp2-sp": (4, ["--ep", "2", "--tp", "2", "--sequence-parallel", "--qkv", "gqa"]),
    "ep1-dp2-zero1": (2, ["--dp", "2", "--zero1"]),  # experts' optimizer state sharded over dp like the rest
}


@pytest.mark.parametrize("name", list(PARALLEL_CASES))
def test_parallel_equals_serial(name, work, hf_model, tokens, serial):
    nproc, extra = PARALLEL_CASES[name]
    model = hf_model
    if name == "ep2-pp2":  # start from shards of another layout: resharded on load
        model = work / "sharded-tp2-ep4"
        if not model.exists():
            convert(hf_model, model, Layout(tp=2, ep=4))
    if name == "ep2-tp2":
        extra = [*extra, "--export-hf", str(work / "ep2-tp2-export")]
    if name == "ep2-dp4-zero1":
        extra = [*extra, "--checkpoint-dir", str(work / "ckpt-zero1"), "--checkpoint-every", "3"]
    if name == "ep2-pp2":  # evaluation through the pipeline's forward-only schedule
        extra = [*extra, *EVAL, "--eval-data", str(tokens), "--eval-steps", "1"]
    metrics = work / f"{name}.jsonl"
    check_ok(run_ranks(nproc, run_args(model, tokens, metrics, *extra)))
    (lm, aux), ((ref_lm, ref_aux), ref_export) = curves(metrics), serial
    assert len(lm) == 5
    assert rel_diff(lm, ref_lm) < REL, f"{name}: {lm} vs ep1 {ref_lm}"
    assert rel_diff(aux, ref_aux) < REL, f"{name}: aux {aux} vs ep1 {ref_aux}"
    records = steps(metrics)
    assert all(r["moe_dropped"] == 0.0 for r in records)
    if "--ep" in extra:  # tokens really went through the all-to-all
        assert all(r["dispatch_time"] > 0.0 for r in records)
    if name == "ep2-dp4-zero1":  # each (edp, ep) rank wrote its own ZeRO-1 shards; resumed at ep1 in one process
        optim = sorted(p.name for p in (work / "ckpt-zero1" / "step_3" / "optim").iterdir())
        assert optim == [f"dp_rank_{d:02d}_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for d in (0, 1) for e in (0, 1)]
        resumed = work / "ep2-dp4-zero1-resumed.jsonl"
        run_inprocess(run_args(model, tokens, resumed, "--resume", str(work / "ckpt-zero1" / "step_3")))
        assert [r["step"] for r in steps(resumed)] == [4, 5]
        assert rel_diff(curves(resumed)[0], ref_lm[3:]) < REL, (curves(resumed)[0], ref_lm)
        assert rel_diff(curves(resumed)[1], ref_aux[3:]) < REL
    if name == "ep2-pp2":
        evaluated, ref_eval = eval_losses(metrics), eval_losses(work / "ep1.jsonl")
        assert len(evaluated) == 3 and rel_diff(evaluated, ref_eval) < REL, (evaluated, ref_eval)
    if name == "ep2-tp2":
        from safetensors.torch import load_file

        ours = load_file(str(work / "ep2-tp2-export" / "model.safetensors"))
        ref = load_file(str(ref_export / "model.safetensors"))
        assert set(ours) == set(ref)
        for k in ref:
            assert torch.allclose(ours[k], ref[k], rtol=1e-4, atol=1e-5), k


def test_interleaved_chunks_carry_the_moe_statistics(work, tokens):
    """pp2 vpp2 (4 chunks of one layer, ScheduleInterleaved1F1B) with ep2: the load-balancing
    statistics travel through every chunk boundary beside the hidden states; equals one process."""
    model = make_tiny_model(
        fixture_config(CONFIG) | {"router_aux_loss_coef": AUX_COEF, "num_hidden_layers": 4},
        work / "hf-4-layers",
        seed=3,
    )
    one, chunked = work / "4-layers-ep1.jsonl", work / "4-layers-pp2-vpp2-ep2.jsonl"
    run_inprocess(run_args(model, tokens, one))
    check_ok(run_ranks(4, run_args(model, tokens, chunked, "--pp", "2", "--vpp", "2", "--ep", "2")))
    (lm, aux), (ref_lm, ref_aux) = curves(chunked), curves(one)
    assert len(lm) == 5 and rel_diff(lm, ref_lm) < REL, (lm, ref_lm)
    assert rel_diff(aux, ref_aux) < REL, (aux, ref_aux)


# ---- 3. resume on another layout --------------------------------------------------------------------------

SIX = ["--steps", "6"]


def test_resume_ep2_checkpoint_at_ep1_tp2(work, hf_model, tokens):
    """6 steps at ep2 tp1 checkpointing at step 3; step 3 resumed at ep1 tp2 (sequence parallel,
    activation checkpointing) gives steps 4-6 of the uninterrupted run: weights, experts, Adam moments of
    both, schedule and data position."""
    from shardkit.checkpoint import load_checkpoint

    ckpt, metrics = work / "ckpt-ep2", work / "six-ep2.jsonl"
    check_ok(
        run_ranks(
            2,
            run_args(
                hf_model, tokens, metrics, *SIX, "--ep", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"
            ),
        )
    )
    expected = curves(metrics)
    saved = load_checkpoint(ckpt, "step_3", rank=(1, 0, 0))  # ep rank 1's file: its two experts only
    assert saved is not None and saved.layout.ep == 2
    assert {n.split(".mlp.")[-1] for n in saved.model} == {
        "expert_mlps.mlp_op.gate_up_proj.weight",
        "expert_mlps.mlp_op.down_proj.weight",
    }
    assert saved.model["model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"].shape == (2, 64, 64)
    resumed = work / "resume-ep1tp2.jsonl"
    check_ok(
        run_ranks(
            2,
            run_args(
                hf_model,
                tokens,
                resumed,
                *SIX,
                "--tp",
                "2",
                "--sequence-parallel",
                "--activation-checkpointing",
                "--resume",
                str(ckpt / "step_3"),
            ),
        )
    )
    records = steps(resumed)
    assert [r["step"] for r in records] == [4, 5, 6]
    lm, aux = curves(resumed)
    assert rel_diff(lm, expected[0][3:]) < REL, (lm, expected)
    assert rel_diff(aux, expected[1][3:]) < REL, (aux, expected)


# ---- 4. capacity factor -------------------------------------------------------------------------------------


def test_capacity_keeps_first_choices_first_then_token_order():
    from trainer.moe import MoEBlock

    block = MoEBlock.__new__(MoEBlock)
    block.top_k, block.experts, block.capacity_factor = 2, 4, 0.5  # capacity ceil(0.5 * 4 * 2 / 4) = 1
    # 4 tokens x 2 choices (token-major): first choices 0, 0, 1, 2; second choices 1, 2, 3, 3
    expert = torch.tensor([0, 1, 0, 2, 1, 3, 2, 3])
    kept = block._kept(expert, tokens=4)
    # first choices in token order take expert 0 (token 0), 1 (token 2), 2 (token 3); token 1's first
    # choice (expert 0) is full; second choices: only expert 3 (token 2) has room left
    assert kept.tolist() == [True, False, False, False, True, True, True, False]
    block.capacity_factor = 0.0
    assert block._kept(expert, tokens=4) is None


def test_capacity_factor_drops_count_and_agree_across_layouts(work, hf_model, tokens, serial):
    ample = work / "cf-ample.jsonl"  # capacity = all of a micro-batch's tokens: nothing can drop
    run_inprocess(run_args(hf_model, tokens, ample, "--capacity-factor", "2"))
    (ref_lm, ref_aux), _ = serial
    assert curves(ample) == (ref_lm, ref_aux)
    assert all(r["moe_dropped"] == 0.0 for r in steps(ample))
    tight = [work / "cf-tight-ep1.jsonl", work / "cf-tight-ep2.jsonl"]
    run_inprocess(run_args(hf_model, tokens, tight[0], "--capacity-factor", "0.5"))
    check_ok(run_ranks(2, run_args(hf_model, tokens, tight[1], "--capacity-factor", "0.5", "--ep", "2")))
    one, two = steps(tight[0]), steps(tight[1])
    # capacity 8 of each expert's 64 assignments per micro-batch: at least half of them drop
    assert all(0.5 <= r["moe_dropped"] < 1.0 for r in one)
    assert [r["moe_dropped"] for r in one] == [r["moe_dropped"] for r in two]
    assert rel_diff(curves(tight[1])[0], curves(tight[0])[0]) < REL
    assert rel_diff(curves(tight[0])[0], ref_lm) > 1e-4  # the drops changed the computation


def test_qwen3_moe_equals_transformers_and_ep2_tp2(work, tokens):
    """Qwen3-MoE (q/k norms per head, norm_topk_prob, moe_intermediate_size): ep1 is transformers'
    Qwen3MoeForCausalLM + AdamW; ep2 tp2 equals ep1."""
    cfg = fixture_config("qwen3-moe-tiny") | {"router_aux_loss_coef": AUX_COEF}
    model = make_tiny_model(cfg, work / "qwen3-moe-hf", seed=3)
    serial_metrics, parallel_metrics = work / "qwen3-moe-ep1.jsonl", work / "qwen3-moe-ep2tp2.jsonl"
    run_inprocess(run_args(model, tokens, serial_metrics))
    lm, aux = curves(serial_metrics)
    ref_lm, ref_aux = reference_curves(model, tokens)
    assert rel_diff(lm, ref_lm) < REL, (lm, ref_lm)
    assert rel_diff(aux, ref_aux) < REL, (aux, ref_aux)
    check_ok(run_ranks(4, run_args(model, tokens, parallel_metrics, "--ep", "2", "--tp", "2")))
    par_lm, par_aux = curves(parallel_metrics)
    assert rel_diff(par_lm, lm) < REL, (par_lm, lm)
    assert rel_diff(par_aux, aux) < REL, (par_aux, aux)


# ---- 5. bad input ---------------------------------------------------------------------------------------------


def test_bad_input(tmp_path, work, hf_model, tokens, capsys):
    from trainer.__main__ import main

    dense = make_tiny_model("llama-trainer-tiny", work / "dense", seed=3)
    capsys.readouterr()  # the models' progress bars
    cases = [
        (dense, ["--ep", "2"], "dense model"),
        (hf_model, ["--ep", "3"], "does not divide the model's 4 experts"),
        (hf_model, ["--ep", "2"], "does not divide the data-parallel degree 1"),
        (hf_model, ["--capacity-factor", "-1"], "--capacity-factor must be"),
    ]
    for model, extra, fragment in cases:
        code = main(
            [
                "--model",
                str(model),
                "--data",
                str(tokens),
                "--checkpoint-dir",
                str(tmp_path / "c"),
                "--seq-len",
                "32",
                *extra,
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("trainer: error:"), (extra, err)
        assert fragment in err[0], err[0]
    assert not (tmp_path / "c").exists()
    from trainer.config import parse_args
    from trainer.errors import TrainerError
    from trainer.loop import plan_run

    with pytest.raises(TrainerError, match="--ep 2 does not divide the data-parallel degree 1"):
        plan_run(
            parse_args(
                [
                    "--model",
                    str(hf_model),
                    "--data",
                    str(tokens),
                    "--seq-len",
                    "32",
                    "--ep",
                    "2",
                    "--tp",
                    "2",
                    "--pp",
                    "2",
                ]
            ),
            world=4,
        )


@pytest.mark.slow  # in process: the --ep checks above; every rank exits 2: test_trainer's bad input
def test_bad_ep_every_rank_exits_2(work, hf_model, tokens):
    """ep 4 over dp 2: one line on rank 0, both ranks exit 2."""
    from trainer_helpers import worker_exit_codes

    done = torchrun(2, run_args(hf_model, tokens, work / "bad" / "m.jsonl", "--ep", "4"), timeout=120)
    assert done.returncode == 1
    assert worker_exit_codes(done.stderr) == {0: 2, 1: 2}, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(lines) == 1 and "--ep 4 does not divide the data-parallel degree 2" in lines[0], lines
    assert not (work / "bad").exists()


# ---- 6. a tiny Mixtral learns ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_mixtral_learns_and_exports(work):
    """A transformers-initialised tiny Mixtral (bytes, vocab 256) trained at ep2 on the bundled text:
    the loss falls well below the unigram entropy; the export loads with transformers, has the
    trained model's loss and generates mostly printable text."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.data import unigram_entropy

    cfg = fixture_config(CONFIG) | {"vocab_size": 256, "num_hidden_layers": 2, "max_position_embeddings": 128}
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    torch.manual_seed(0)
    start = work / "learn-hf"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).save_pretrained(start)
    data = corpus_tokens(work / "corpus256.bin")
    metrics, export = work / "learn.jsonl", work / "learn-export"
    check_ok(
        run_ranks(
            2,
            [
                "--model",
                str(start),
                "--data",
                str(data),
                "--metrics",
                str(metrics),
                "--ep",
                "2",
                "--seq-len",
                "128",
                "--micro-batch",
                "8",
                "--global-batch",
                "16",
                "--steps",
                "200",
                "--lr",
                "1e-2",
                "--warmup",
                "20",
                "--dtype",
                "fp32",
                "--no-progress",
                "--threads",
                "1",
                "--export-hf",
                str(export),
            ],
            timeout=900,
        )
    )
    text = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8)
    entropy = unigram_entropy(text)
    trained = [r["loss"] for r in steps(metrics)]
    final = float(np.mean(trained[-10:]))
    assert trained[0] > entropy + 1.0  # starts near log(256)
    assert final < 0.75 * entropy, f"final loss {final:.3f} is not well below the unigram entropy {entropy:.3f}"
    assert all(math.isfinite(r["aux_loss"]) for r in steps(metrics))

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    windows = torch.from_numpy(text[: 16 * 128].astype(np.int64)).view(16, 128)
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.item()
    assert loss < 0.8 * entropy, f"exported model's loss {loss:.3f} (trainer's {final:.3f})"
    prompt = torch.tensor([list(b"The river ")])
    out = model.generate(prompt, max_new_tokens=40, do_sample=False)
    generated = bytes(out[0, prompt.shape[1] :].tolist())
    assert sum(32 <= b < 127 for b in generated) >= 30, generated
