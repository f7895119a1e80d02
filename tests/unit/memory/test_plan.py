"""`shardkit plan`: per-rank training memory from config.json alone, checked against numbers
computed by hand from the Llama-2 7B/13B/70B dimensions; fit decisions; --suggest (smallest tp
first, every suggestion valid); impossible layouts say why (exit 2); --json parses. Pricing by
blocks gives the bytes pricing every piece gives, on every fixture; its work (pieces cut, memory
held) does not grow with the layer count, and a search too large is refused at once."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tracemalloc
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from shardkit import memory
from shardkit.cli import cli
from shardkit.errors import LayoutError, ShardkitError
from shardkit.families import family_for
from shardkit.layout import Layout, ModelDims
from shardkit.memory import (
    DEFAULT_RESERVE,
    PlanReport,
    StagePlan,
    optimizer_bytes_per_param,
    parse_reserve,
    plan_memory,
    rank_params,
    suggest_layouts,
    weight_bytes_per_param,
)
from shardkit.placements import Experts, FlatExperts, Fused, HeadGroups, Replicated, Segment, Split, make_piece
from shardkit.sizes import parse_size
from shardkit.testing import FIXTURES

L7B = FIXTURES / "llama-2-7b.json"
L13B = FIXTURES / "llama-2-13b.json"
L70B = FIXTURES / "llama-2-70b.json"
GiB = 2**30


def run(*args: str):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def assert_clean_failure(result, *phrases: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("shardkit: error: ") and "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


# ---- the fixtures are the real Llama-2 configs ------------------------------------------------


@pytest.mark.parametrize(
    "path, dims",
    [
        (L7B, (4096, 11008, 32, 32, 32)),
        (L13B, (5120, 13824, 40, 40, 40)),
        (L70B, (8192, 28672, 80, 64, 8)),
    ],
)
def test_fixture_configs(path, dims):
    c = json.loads(Path(path).read_text())
    assert (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
    ) == dims
    assert c["vocab_size"] == 32000 and c["rms_norm_eps"] == 1e-5 and c["model_type"] == "llama"
    assert c["tie_word_embeddings"] is False


# ---- hand-computed parameter counts -------------------------------------------------------------

V = 32000


def test_7b_whole_model():
    H, I, L = 4096, 11008, 32
    layer = 4 * H * H + 3 * H * I + 2 * H  # q k v o (32 kv heads = MHA), gate up down, two norms
    total = V * H + L * layer + H + V * H  # embed, layers, final norm, lm_head
    assert total == 6_738_415_616
    r = plan_memory(L7B, Layout())
    assert r.parameters == r.held_parameters == total
    (s,) = r.stages
    assert s.params == total and s.layers == (0, 31)
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (2 * total, 2 * total, 12 * total)
    assert r.peak_bytes == 16 * total and r.fits is None


def test_7b_tp8():
    H, I, L, tp = 4096, 11008, 32, 8
    per_layer = 4 * H * H // tp + 3 * H * I // tp + 2 * H  # norms replicated on every tp rank
    per_rank = V * H // tp + L * per_layer + H + V * H // tp  # embed and lm_head vocab-parallel
    assert per_rank == 842_534_912
    r = plan_memory(L7B, Layout(tp=8))
    assert [s.params for s in r.stages] == [per_rank]
    assert r.held_parameters == tp * per_rank == r.parameters + (tp - 1) * (2 * L + 1) * H
    assert r.peak_bytes == 16 * per_rank


def test_7b_tp4_pp3_uneven_stages():
    H, I, L, tp = 4096, 11008, 32, 4
    per_layer = 4 * H * H // tp + 3 * H * I // tp + 2 * H
    r = plan_memory(L7B, Layout(tp=4, pp=3))
    # 32 layers over 3 stages: 10, 11, 11 (the remainder goes to the LAST stages)
    assert [s.layers for s in r.stages] == [(0, 9), (10, 20), (21, L - 1)]
    assert [s.params for s in r.stages] == [
        V * H // tp + 10 * per_layer,
        11 * per_layer,
        11 * per_layer + H + V * H // tp,
    ]
    assert r.peak.stage == 2


def test_13b_tp8_pp2_fp32():
    H, I, L, tp = 5120, 13824, 40, 8
    layer = 4 * H * H + 3 * H * I + 2 * H
    assert V * H + L * layer + H + V * H == 13_015_864_320
    per_layer = 4 * H * H // tp + 3 * H * I // tp + 2 * H
    stage0 = V * H // tp + 20 * per_layer
    stage1 = 20 * per_layer + H + V * H // tp
    r = plan_memory(L13B, Layout(tp=8, pp=2), dtype="fp32")
    assert r.parameters == 13_015_864_320
    assert [s.params for s in r.stages] == [stage0, stage1]
    s = r.stages[1]
    # fp32 weights are Adam's master copy: weights 4 + grads 4 + exp_avg 4 + exp_avg_sq 4
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (4 * stage1, 4 * stage1, 8 * stage1)


def test_13b_bf16_and_fp16_cost_the_same():
    a = plan_memory(L13B, Layout(tp=4, pp=4), dtype="bf16").to_dict()
    b = plan_memory(L13B, Layout(tp=4, pp=4), dtype="fp16").to_dict()
    assert a["stages"] == b["stages"] and a["bytes_per_param"] == {"weights": 2, "grads": 2, "optimizer": 12}


def test_70b_tp32_pp4_kv_multiplier_4():
    H, I, L, tp, m = 8192, 28672, 80, 32, 4
    kv_rows, q_rows = 8 * 128, 64 * 128
    layer = 2 * q_rows * H + 2 * kv_rows * H + 3 * H * I + 2 * H
    assert V * H + L * layer + H + V * H == 68_976_648_192
    # per tp rank: 2 q heads; 8 kv heads x 4 replicas / 32 ranks = 1 k and 1 v head; o by the same 2 q heads
    per_layer = (2 * 128 * H) + (128 * H) + (128 * H) + (H * 2 * 128) + 3 * H * I // tp + 2 * H
    assert per_layer == 28_327_936
    stages = [V * H // tp + 20 * per_layer, 20 * per_layer, 20 * per_layer, 20 * per_layer + H + V * H // tp]
    assert stages == [574_750_720, 566_558_720, 566_558_720, 574_758_912]

    r = plan_memory(L70B, Layout(tp=32, pp=4, kv_multiplier=m), device_memory="16GiB")
    assert [s.params for s in r.stages] == stages
    assert [s.layers for s in r.stages] == [(0, 19), (20, 39), (40, 59), (60, 79)]
    assert r.parameters == 68_976_648_192
    # kv replicas and replicated norms are real memory
    replicated = L * (tp * 2 * 128 * H - 2 * kv_rows * H) + (tp - 1) * (2 * L + 1) * H
    assert r.held_parameters == r.parameters + replicated == 73_044_066_304
    peak = stages[3]
    assert r.peak.stage == 3 and r.peak_bytes == (2 + 2 + 12) * peak == 9_196_142_592
    assert r.reserve_bytes == int(0.1 * 16 * GiB) and r.usable_bytes == 16 * GiB - int(0.1 * 16 * GiB)
    assert r.fits is True and r.spare_bytes == r.usable_bytes - 9_196_142_592


def test_70b_zero1_dp4():
    peak = 574_758_912
    plain = plan_memory(L70B, Layout(tp=32, pp=4, kv_multiplier=4), device_memory="8GiB")
    assert plain.fits is False  # 16 B x 574.8M = 8.56 GiB > 7.2 GiB usable
    dp_only = plan_memory(L70B, Layout(tp=32, pp=4, kv_multiplier=4), dp=4, device_memory="8GiB")
    assert dp_only.peak_bytes == plain.peak_bytes  # dp alone replicates everything
    z = plan_memory(L70B, Layout(tp=32, pp=4, kv_multiplier=4), zero1=True, dp=4, device_memory="8GiB")
    s = z.peak
    assert (s.param_bytes, s.grad_bytes) == (2 * peak, 2 * peak)
    assert s.optimizer_bytes == 12 * peak // 4 == 1_724_276_736  # ZeRO-1 shards the optimizer state only
    assert z.peak_bytes == 7 * peak and z.fits is True and z.world_size == 512


def test_70b_tp8_no_replication():
    H, I, L, tp = 8192, 28672, 80, 8
    per_layer = (8 * 128 * H) + 2 * (128 * H) + (H * 8 * 128) + 3 * H * I // tp + 2 * H  # one kv head per rank
    r = plan_memory(L70B, Layout(tp=8, pp=8))
    assert [s.params for s in r.stages] == [V * H // tp + 10 * per_layer] + [10 * per_layer] * 6 + [
        10 * per_layer + H + V * H // tp
    ]
    assert r.held_parameters == r.parameters + (tp - 1) * (2 * L + 1) * H


def test_zero1_rounds_up():
    r = plan_memory(L7B, Layout(tp=8), zero1=True, dp=7)
    assert r.stages[0].optimizer_bytes == math.ceil(842_534_912 / 7) * 12


def test_tied_embedding_counts_once_on_one_stage():
    cfg = FIXTURES / "llama-kv8-tied.json"  # hidden 64, vocab 64, tied
    one = plan_memory(cfg, Layout(tp=2))
    assert one.held_parameters == one.parameters + (2 - 1) * (2 * 4 + 1) * 64  # only norms replicated
    two = plan_memory(cfg, Layout(tp=2, pp=2))
    assert two.held_parameters == one.held_parameters + 64 * 64  # lm_head is a copy on the last stage


# ---- the fast path used by --suggest is the same algebra ----------------------------------------


@pytest.mark.parametrize(
    "config, layout",
    [
        (L7B, Layout(tp=4, pp=3)),
        (L7B, Layout(tp=1, pp=1)),
        (L13B, Layout(tp=2, pp=7)),
        (L70B, Layout(tp=16, pp=6, kv_multiplier=2)),
        (L70B, Layout(tp=64, pp=80, kv_multiplier=8)),
        (FIXTURES / "llama-kv8-tied.json", Layout(tp=2, pp=1)),
        (FIXTURES / "llama-kv8-tied.json", Layout(tp=4, pp=3)),
        (FIXTURES / "llama-bias.json", Layout(tp=4, pp=2, kv_multiplier=2)),
    ],
)
def test_suggestions_match_direct_plans(config, layout):
    direct = plan_memory(config, layout, device_memory="1TiB")
    (found,) = suggest_layouts(config, "1TiB", tp=layout.tp, pp=layout.pp, kv_multiplier=layout.kv_multiplier).layouts
    assert found.to_dict() == direct.to_dict()


# ---- fitting -------------------------------------------------------------------------------------


def test_fit_boundary_is_exact():
    peak = plan_memory(L7B, Layout(tp=8)).peak_bytes
    assert plan_memory(L7B, Layout(tp=8), device_memory=peak + GiB, reserve="1GiB").fits is True
    assert plan_memory(L7B, Layout(tp=8), device_memory=peak + GiB - 1, reserve="1GiB").fits is False
    assert plan_memory(L7B, Layout(tp=8), device_memory=peak, reserve="0%").fits is True


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("16GiB", 16 * GiB),
        ("16GB", 16 * 10**9),
        ("32G", 32 * GiB),
        ("16 gib", 16 * GiB),
        ("1.5TiB", 3 * 2**39),
        ("512MiB", 2**29),
        ("96g", 96 * GiB),
        ("1024", 1024),
        (4096, 4096),
    ],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "16XB", "", "-1G", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(ShardkitError, match="not understood"):
        parse_size(text)


def test_parse_reserve():
    assert parse_reserve("10%", 1000) == parse_reserve(0.1, 1000) == parse_reserve("0.1", 1000) == 100
    assert parse_reserve("2GiB", 16 * GiB) == 2 * GiB and parse_reserve(0, 10) == 0
    for bad in ("100%", 1.5, "16GiB"):
        with pytest.raises(ShardkitError):
            parse_reserve(bad, 16 * GiB)


# ---- suggestions ---------------------------------------------------------------------------------


def _smallest_multiplier(dims: ModelDims, tp: int) -> int:
    return next(
        m
        for m in range(1, dims.num_heads // dims.num_kv_heads + 1)
        if (dims.num_kv_heads * m) % tp == 0 and dims.num_heads % (dims.num_kv_heads * m) == 0
    )


def test_suggest_70b_world_128_zero1():
    dims = ModelDims.from_config(json.loads(L70B.read_text()))
    found = suggest_layouts(L70B, "16GiB", world_size=128, zero1=True)
    keys = [(r.layout.tp, r.layout.pp) for r in found.layouts]
    assert keys == sorted(keys) and keys, keys
    for r in found.layouts:
        r.layout.validate(dims)
        assert r.fits and r.world_size == 128 and r.zero1
        assert r.layout.kv_multiplier == _smallest_multiplier(dims, r.layout.tp)
    assert (32, 4) in keys and next(r for r in found.layouts if r.layout.tp == 32).layout.kv_multiplier == 4
    # the smallest tp that fits: tp 1 cannot, with any pp that makes 128 devices
    assert found.layouts[0].layout.tp == 2
    for pp in (2, 4, 8, 16, 32, 64):
        assert not plan_memory(L70B, Layout(pp=pp), zero1=True, dp=128 // pp, device_memory="16GiB").fits


def test_suggest_7b_smallest_tp_first():
    dims = ModelDims.from_config(json.loads(L7B.read_text()))
    found = suggest_layouts(L7B, "16GiB")
    keys = [(r.layout.tp, r.layout.pp, r.layout.kv_multiplier) for r in found.layouts]
    assert keys == sorted(keys)
    assert keys[0] == (1, 8, 1)  # 4-5 layers x 202M parameters x 16 B per stage
    assert not plan_memory(L7B, Layout(pp=7), device_memory="16GiB").fits
    for r in found.layouts:
        r.layout.validate(dims)
        assert r.fits and r.peak_bytes <= 16 * GiB * 0.9
    assert {r.layout.tp for r in found.layouts} == {1, 2, 4, 8, 16, 32}
    assert found.considered == 6 * 32 and found.impossible == []


def test_suggest_all_kv_multipliers():
    found = suggest_layouts(L70B, "16GiB", tp=16, pp=8, all_kv_multipliers=True)
    assert [r.layout.kv_multiplier for r in found.layouts] == [2, 4, 8]  # 6 fails: 48 does not divide 64


def test_suggest_reports_impossible_tps():
    found = suggest_layouts(L13B, "80GiB", max_pp=2)
    assert [b["tp"] for b in found.impossible] == [5, 10, 20, 40]
    assert found.impossible[0]["reason"] == "intermediate size 13824 is not divisible by tp 5"
    assert {r.layout.tp for r in found.layouts} <= {1, 2, 4, 8}


def test_suggest_nothing_fits_names_the_closest():
    found = suggest_layouts(L70B, "100MiB", tp=64)
    assert found.layouts == [] and found.closest is not None
    assert found.closest.layout == Layout(tp=64, pp=80, kv_multiplier=8)


def test_impossible_layout_raises_with_reason():
    with pytest.raises(LayoutError, match="use --kv-multiplier 4"):
        plan_memory(L70B, Layout(tp=32, pp=4))
    with pytest.raises(LayoutError, match="not divisible by tp 48"):
        suggest_layouts(L70B, "16GiB", tp=48)


# ---- the command line ----------------------------------------------------------------------------


def test_cli_plan_70b_text():
    result = run(
        "plan", "--config", L70B, "--tp", "32", "--pp", "4", "--kv-multiplier", "4", "--device-memory", "16GiB"
    )
    assert result.exit_code == 0, result.stderr
    out = result.output
    assert "tp 32, pp 4, kv-multiplier 4" in out and "574,758,912" in out
    assert "8.56 GiB per rank (9,196,142,592 B, stage 3)" in out
    assert "14.40 GiB usable: fits" in out and "activations are not estimated" in out


def test_cli_plan_does_not_fit_exits_1():
    result = run("plan", "--config", L70B, "--tp", "32", "--pp", "4", "--kv-multiplier", "4", "--device-memory", "8GiB")
    assert result.exit_code == 1 and "does NOT fit" in result.output
    result = run(
        "plan",
        "--config",
        L70B,
        "--tp",
        "32",
        "--pp",
        "4",
        "--kv-multiplier",
        "4",
        "--device-memory",
        "8GiB",
        "--zero1",
        "--dp",
        "4",
    )
    assert result.exit_code == 0 and "fits" in result.output


def test_cli_plan_json_matches_library():
    result = run(
        "plan",
        "--config",
        L13B,
        "--tp-size",
        "8",
        "--pp-size",
        "2",
        "--dtype",
        "fp32",
        "--world-size",
        "64",
        "--zero1",
        "--device-memory",
        "32G",
        "--reserve",
        "2GiB",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.output)
    expected = plan_memory(
        L13B, Layout(tp=8, pp=2), dtype="fp32", zero1=True, dp=4, device_memory=32 * GiB, reserve=2 * GiB
    ).to_dict()
    assert data == expected
    assert data["dp"] == 4 and data["usable_bytes"] == 30 * GiB and data["activations_estimated"] is False


def test_cli_suggest_text_and_json():
    text = run("plan", "--config", L70B, "--suggest", "--device-memory", "16GiB", "--world-size", "128", "--zero1")
    assert text.exit_code == 0, text.stderr
    rows = [line.split() for line in text.output.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert rows[0][:3] == ["2", "32", "1"] and ["32", "4", "4", "1", "128"] == rows[-3][:5]
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows)

    limited = run("plan", "--config", L7B, "--suggest", "--device-memory", "16GiB", "--limit", "3", "--json")
    data = json.loads(limited.output)
    # pp 9, 10 hold as many layers per rank as pp 8 (32 layers): no saving, left out
    assert [(d["layout"]["tp"], d["layout"]["pp"]) for d in data["layouts"]] == [(1, 8), (1, 11), (1, 16)]
    found = suggest_layouts(L7B, "16GiB")
    assert data["more"] == len(found.distinct()) - 3
    assert data["redundant"] == len(found.layouts) - len(found.distinct())


def test_cli_suggest_nothing_fits_exits_1():
    result = run("plan", "--config", L70B, "--suggest", "--device-memory", "100MiB", "--tp", "64")
    assert result.exit_code == 1 and "no valid layout fits" in result.output and "tp 64, pp 80" in result.output


@pytest.mark.parametrize(
    "config, flags, phrase",
    [
        (
            L70B,
            ["--tp", "32", "--pp", "4"],
            "8 kv heads x kv-multiplier 1 = 8 is not a multiple of tp 32: use --kv-multiplier 4",
        ),
        (L70B, ["--tp", "48"], "64 q heads are not divisible by tp 48"),
        (L70B, ["--tp", "8", "--kv-multiplier", "16"], "kv-multiplier 16 is too large"),
        (L70B, ["--pp", "81"], "80 layers cannot fill 81 pipeline stages"),
        (L13B, ["--tp", "5"], "intermediate size 13824 is not divisible by tp 5"),
        (
            L13B,
            ["--tp", "5", "--suggest", "--device-memory", "16GiB"],
            "intermediate size 13824 is not divisible by tp 5",
        ),
        (L70B, ["--suggest", "--pp", "81", "--device-memory", "16GiB"], "80 layers cannot fill 81"),
        (L7B, ["--device-memory", "lots"], "device memory 'lots' is not understood"),
        (L7B, ["--device-memory", "16GiB", "--reserve", "20GiB"], "give a smaller --reserve"),
        (L7B, ["--zero1"], "give --dp"),
        (L7B, ["--tp", "8", "--world-size", "12"], "cannot make --world-size 12"),
        (L7B, ["--max-pp", "4"], "--max-pp only applies with --suggest"),
        (L7B, ["--suggest"], "--suggest needs --device-memory"),
    ],
)
def test_cli_impossible_says_why(config, flags, phrase):
    assert_clean_failure(run("plan", "--config", config, *flags), phrase)


def test_cli_unknown_model(tmp_path):
    cfg = json.loads(L7B.read_text())
    cfg["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(run("plan", "--config", tmp_path), "'mamba' is not supported")


def test_cli_help_says_activations_are_not_estimated():
    result = CliRunner().invoke(cli, ["plan", "--help"])
    assert result.exit_code == 0 and "NOT estimated" in result.output and "--suggest" in result.output


def test_layout_vpp_round_trips_and_plain_manifests_are_unchanged():
    """vpp 1 is left out of the manifest (plain layouts read and write as before, old manifests
    with "vpp": 1 still load); a layout with virtual stages keeps them; nonsense is refused."""
    assert "vpp" not in Layout().to_dict()
    assert Layout.from_dict({"tp": 2, "pp": 1, "vpp": 1}) == Layout(tp=2)
    assert Layout.from_dict(Layout(tp=2, pp=2, vpp=2).to_dict()) == Layout(tp=2, pp=2, vpp=2)
    with pytest.raises(LayoutError, match="vpp must be a positive whole number"):
        Layout.from_dict({"tp": 2, "pp": 2, "vpp": 0})


# ---- pricing by blocks: every piece's bytes, and work that does not grow with the layer count ----
#
# plan prices a stage as first block + layers x one layer + final block. The reference below is
# the pricing it replaced: rank_params of rank_pieces for every tp rank of every stage of the full
# model, every layer of it.

PLACEMENTS = (Replicated, Split, Fused, HeadGroups, Experts, FlatExperts)


def exact_report(
    config, layout: Layout, *, dtype="bf16", zero1=False, dp=1, device_memory=None, reserve=DEFAULT_RESERVE, family=None
) -> PlanReport:
    """The plan of `layout` priced piece by piece (every rank, every stage, every layer)."""
    data = config if isinstance(config, dict) else json.loads(Path(config).read_text())
    family, dims = family or family_for(data), ModelDims.from_config(data)
    shapes = family.full_shapes(dims)
    weight, optim = weight_bytes_per_param(dtype), optimizer_bytes_per_param(dtype)
    stages, held = [], 0
    for s, layers in enumerate(layout.stage_layers(dims.num_layers)):
        per_rank = [rank_params(family.rank_pieces(layout, dims, r, s, shapes)) for r in range(layout.tp)]
        held += sum(per_rank)
        n = max(per_rank)
        stages.append(
            StagePlan(
                s,
                (layers[0], layers[-1]),
                n,
                per_rank.index(n),
                n * weight,
                n * weight,
                (math.ceil(n / dp) if zero1 else n) * optim,
            )
        )
    memory = None if device_memory is None else parse_size(device_memory)
    return PlanReport(
        family.name,
        dims.model_type,
        sum(math.prod(v) for v in shapes.values()),
        held,
        layout,
        dtype,
        zero1,
        dp,
        tuple(stages),
        memory,
        None if memory is None else parse_reserve(reserve, memory),
    )


def assert_same_plan(report: PlanReport, exact: PlanReport) -> None:
    assert report.to_dict() == exact.to_dict()
    assert list(report.stages) == list(exact.stages) and report.peak == exact.peak


@pytest.fixture
def stage_layers_once(monkeypatch):
    """rank_pieces works out every stage's layers at every call: remember them, so that the
    reference can price a model of thousands of layers (rank_pieces only reads the lists)."""
    monkeypatch.setattr(Layout, "stage_layers", functools.lru_cache(maxsize=None)(Layout.stage_layers))


def fixture_layouts(path: Path) -> list[Layout]:
    """Layouts of a fixture, as many as its reference pricing affords: each valid tp (smallest and
    largest kv-multiplier), pp 1, 2, 3 and one stage per layer, every qkv style the family takes,
    blocked replicas and virtual stages."""
    data = json.loads(path.read_text())
    family, dims = family_for(data), ModelDims.from_config(data)
    out = []
    for tp in [t for t in range(1, dims.num_heads + 1) if dims.num_heads % t == 0]:
        valid = []
        for m in range(1, dims.num_heads // dims.num_kv_heads + 1):
            try:
                family.validate(Layout(tp=tp, kv_multiplier=m), dims)
                valid.append(m)
            except LayoutError:
                pass
        for m in sorted({valid[0], valid[-1]}) if valid else []:
            for pp in sorted({1, 2, 3, dims.num_layers} & set(range(1, dims.num_layers + 1))):
                # the reference prices tp x layers x pieces (and experts): as many as it affords
                if tp * dims.num_layers * (1 + dims.num_experts) <= 512 or (tp, m) == (1, valid[0]):
                    out.append(Layout(tp=tp, pp=pp, kv_multiplier=m))
    last = out[-1]  # the largest tp and kv-multiplier afforded
    out += [dataclasses.replace(last, qkv=q) for q in family.qkv_styles if q != last.qkv]
    out.append(dataclasses.replace(last, kv_replication="blocked"))
    if dims.num_layers >= 4:
        out.append(dataclasses.replace(last, pp=2, vpp=2))
    return out


LAYOUTS_OF_THE_TESTS = [  # the layouts tests/ price by hand (this file, test_families, test_inference)
    ("llama-2-7b", Layout()),
    ("llama-2-7b", Layout(tp=8)),
    ("llama-2-7b", Layout(tp=4, pp=3)),
    ("llama-2-13b", Layout(tp=8, pp=2)),
    ("llama-2-13b", Layout(tp=4, pp=4)),
    ("llama-2-13b", Layout(tp=2, pp=7)),
    ("llama-2-70b", Layout(tp=32, pp=4, kv_multiplier=4)),
    ("llama-2-70b", Layout(tp=8, pp=8)),
    ("llama-2-70b", Layout(tp=16, pp=6, kv_multiplier=2)),
    ("llama-2-70b", Layout(tp=64, pp=80, kv_multiplier=8)),
    ("llama-2-70b", Layout(pp=64)),
    ("llama-kv8-tied", Layout(tp=2)),
    ("llama-kv8-tied", Layout(tp=2, pp=2)),
    ("llama-kv8-tied", Layout(tp=4, pp=3)),
    ("llama-bias", Layout(tp=4, pp=2, kv_multiplier=2)),
    ("llama-3.1-8b", Layout(tp=8, pp=2)),
    ("llama-3.2-3b", Layout(tp=4)),
    ("qwen3-8b", Layout(tp=8, pp=2)),
    ("qwen3-8b", Layout(tp=16, kv_multiplier=2)),
    ("qwen3-30b-a3b", Layout(tp=4, pp=4)),
    ("phi-3-mini-4k", Layout(tp=4)),
    ("gemma-2-9b", Layout(tp=8, pp=2)),
    ("gemma-2-9b", Layout(tp=8)),
    ("gemma-3-1b", Layout(tp=4, kv_multiplier=4)),
    ("pythia-6.9b", Layout(tp=8, pp=2)),
    ("bert-large-uncased", Layout(tp=2)),
    ("bert-large-uncased", Layout(tp=2, pp=2)),
    ("bert-large-uncased", Layout(tp=8)),
    ("dbrx-base", Layout(tp=8, pp=4)),
]


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_block_pricing_equals_every_piece_on_every_fixture(path, stage_layers_once):
    for layout in fixture_layouts(path):
        assert_same_plan(plan_memory(path, layout), exact_report(path, layout))


@pytest.mark.parametrize("name, layout", LAYOUTS_OF_THE_TESTS, ids=lambda v: getattr(v, "describe", lambda: v)())
def test_block_pricing_equals_every_piece_on_the_tests_layouts(name, layout, stage_layers_once):
    path = FIXTURES / f"{name}.json"
    assert_same_plan(plan_memory(path, layout), exact_report(path, layout))
    fp32 = dict(dtype="fp32", zero1=True, dp=3, device_memory="40GiB", reserve="2GiB")
    assert_same_plan(plan_memory(path, layout, **fp32), exact_report(path, layout, **fp32))


@dataclasses.dataclass(frozen=True)
class Lopsided:
    """A made-up placement whose tp ranks differ: rank r holds r + 1 rows of the tensor (or
    tp - r with `reverse`), so that ranks must be priced one by one."""

    expert: ClassVar[bool] = False
    name: str = "lopsided.weight"
    reverse: bool = False

    def shapes(self, dims):
        return {self.name: (64, dims.hidden_size)}

    def sources(self, dims):
        return [self.name]

    def split_dims(self, dims):
        return {self.name: 0}

    def pieces(self, prefix, layout, dims, tp_rank, full_shapes, ep_rank=0):
        rows = layout.tp - tp_rank if self.reverse else tp_rank + 1
        return [make_piece(prefix + self.name, [Segment(prefix + self.name, 0, 0, rows)], full_shapes)]


@pytest.mark.parametrize(
    "layout", [Layout(tp=4), Layout(tp=4, pp=2), Layout(tp=8, pp=3), Layout(tp=2, pp=2, vpp=2)], ids=Layout.describe
)
def test_block_pricing_prices_every_rank_when_ranks_differ(monkeypatch, layout):
    """A family with a placement plan does not know to cut equal shares is priced rank by rank
    (the first block's largest rank is rank 0, a layer's the last one)."""
    llama = family_for({"model_type": "llama"})
    family = dataclasses.replace(
        llama, first=llama.first + (Lopsided("model.lopsided.weight", reverse=True),), layer=llama.layer + (Lopsided(),)
    )
    monkeypatch.setattr(memory, "family_for", lambda config: family)
    monkeypatch.setattr(memory, "_PRICINGS", {})
    path = FIXTURES / "llama-kv8-tied.json"  # 4 layers, lm_head tied to the embedding
    report = plan_memory(path, layout, device_memory="1GiB")
    assert_same_plan(report, exact_report(path, layout, device_memory="1GiB", family=family))
    assert report.stages[-1].tp_rank == layout.tp - 1


def with_layers(tmp_path: Path, layers: int, source: Path = L70B) -> Path:
    config = json.loads(source.read_text())
    config["num_hidden_layers"] = layers
    path = tmp_path / f"{source.stem}-{layers}-layers.json"
    path.write_text(json.dumps(config))
    return path


def valid(family, dims, layout: Layout) -> bool:
    try:
        family.validate(layout, dims)
        return True
    except LayoutError:
        return False


@pytest.mark.parametrize(
    "layers, device_memory, options",
    [
        (7, "16GiB", {}),
        (12, "30GiB", {"all_kv_multipliers": True}),
        (7, "16GiB", {"world_size": 56, "zero1": True}),
        (12, "100MiB", {"tp": 64}),
    ],
)
def test_suggestions_equal_pricing_every_piece_at_a_modest_layer_count(tmp_path, layers, device_memory, options):
    """Every valid layout is priced piece by piece: those that fit are exactly the suggestions,
    with the same bytes; when none fits, the closest is the same."""
    path = with_layers(tmp_path, layers)
    found = suggest_layouts(path, device_memory, **options)
    data = json.loads(path.read_text())
    family, dims = family_for(data), ModelDims.from_config(data)
    expected, considered, closest = [], 0, None
    for tp in [options["tp"]] if "tp" in options else [t for t in range(1, 65) if 64 % t == 0]:
        multipliers = [m for m in range(1, 9) if valid(family, dims, Layout(tp=tp, kv_multiplier=m))]
        for m in multipliers if options.get("all_kv_multipliers") else multipliers[:1]:
            for pp in range(1, layers + 1):
                if "world_size" in options and options["world_size"] % (tp * pp):
                    continue
                dp = options["world_size"] // (tp * pp) if "world_size" in options else 1
                exact = exact_report(
                    path,
                    Layout(tp=tp, pp=pp, kv_multiplier=m),
                    zero1=options.get("zero1", False),
                    dp=dp,
                    device_memory=device_memory,
                )
                considered += 1
                if exact.fits:
                    expected.append(exact)
                elif closest is None or exact.peak_bytes < closest.peak_bytes:
                    closest = exact
    assert found.considered == considered
    assert [r.to_dict() for r in found.layouts] == [
        r.to_dict() for r in sorted(expected, key=lambda r: (r.layout.tp, r.layout.pp, r.layout.kv_multiplier))
    ]
    assert (found.closest.to_dict() if found.closest else None) == (None if expected else closest.to_dict())


@pytest.fixture
def pieces_cut(monkeypatch):
    """Counts the pieces the placements cut, the work of pricing; a run that cuts more than
    `limit` fails at once (the pricing before blocks cut every layer's, for minutes)."""
    count = {"pieces": 0, "limit": 10**9}
    memory._PRICINGS.clear()  # each run prices afresh: what it costs without an earlier run's work
    memory._stand_in.cache_clear()
    for cls in PLACEMENTS:

        def counted(self, *args, _real=cls.pieces, **kwargs):
            out = _real(self, *args, **kwargs)
            count["pieces"] += len(out)
            assert count["pieces"] <= count["limit"], f"more than {count['limit']} pieces cut"
            return out

        monkeypatch.setattr(cls, "pieces", counted)
    return count


SEARCHES = [
    ["--suggest", "--device-memory", "16GiB"],
    ["--suggest", "--device-memory", "16GiB", "--all-kv-multipliers", "--json"],
    ["--suggest", "--device-memory", "80GiB", "--max-pp", "100", "--world-size", "4096", "--zero1"],
    ["--tp", "64", "--pp", "40", "--kv-multiplier", "8", "--device-memory", "16GiB", "--json"],
]


@pytest.mark.parametrize("flags", SEARCHES, ids=lambda f: " ".join(f))
def test_plan_work_does_not_grow_with_the_layer_count(tmp_path, pieces_cut, flags):
    cut = []
    for layers in (80, 4096):
        pieces_cut["pieces"], pieces_cut["limit"] = 0, 2000
        memory._PRICINGS.clear()
        memory._stand_in.cache_clear()
        result = run("plan", "--config", with_layers(tmp_path, layers), *flags)
        assert result.exit_code in (0, 1) and not result.stderr, result.stderr
        cut.append(pieces_cut["pieces"])
    assert cut[0] == cut[1] and 0 < cut[0] <= 2000, cut


@pytest.mark.slow  # the work at 4096 layers: test_plan_work_does_not_grow_with_the_layer_count
def test_suggest_at_4096_layers_answers_as_pricing_every_piece(tmp_path, pieces_cut, stage_layers_once):
    """`plan --suggest` on Llama-2-70B edited to 4096 layers: a few dozen pieces cut and a few
    MiB held (it was minutes and gigabytes), and the layouts it names are priced as piece by piece."""
    path = with_layers(tmp_path, 4096)
    pieces_cut["limit"] = 2000
    tracemalloc.start()
    try:
        text = run("plan", "--config", path, "--suggest", "--device-memory", "16GiB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert text.exit_code == 0, text.stderr
    assert peak < 64 * 2**20, peak  # 18,518 layouts fit, each held without its 4096 stages
    result = run("plan", "--config", path, "--suggest", "--device-memory", "16GiB", "--json")
    pieces_cut["limit"] = 10**9
    data = json.loads(result.output)
    assert data["considered"] == 7 * 4096 and data["redundant"] > 18000
    shown = {(d["layout"]["tp"], d["layout"]["pp"]): d for d in data["layouts"]}
    assert list(shown)[:3] == [(2, 4096), (4, 1024), (4, 1366)]  # tp 2 fits with one layer per stage only
    for tp, pp in [(2, 4096), (4, 1366)]:  # what the reference affords: tp x 4096 layers x pieces
        assert shown[tp, pp] == exact_report(path, Layout(tp=tp, pp=pp), device_memory="16GiB").to_dict()
    assert not exact_report(path, Layout(pp=4096), device_memory="16GiB").fits  # tp 1 cannot


def test_plan_4096_layers_prints_every_stage(tmp_path, pieces_cut):
    pieces_cut["limit"] = 2000
    result = run(
        "plan", "--config", with_layers(tmp_path, 4096), "--tp", "8", "--pp", "4096", "--device-memory", "16GiB"
    )
    assert result.exit_code == 0, result.stderr
    rows = [line.split() for line in result.output.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert len(rows) == 4096 and rows[-1][:2] == ["4095", "4095-4095"]


WIDE = {
    "num_attention_heads": 15120,
    "num_key_value_heads": 15120,
    "hidden_size": 15120 * 8,
    "intermediate_size": 15120 * 277,
    "vocab_size": 15120 * 1000,
    "num_hidden_layers": 4096,
}


@pytest.mark.parametrize(
    "changes, flags",
    [
        ({}, []),  # 80 tps x 4096 pp
        ({"num_key_value_heads": 1}, ["--all-kv-multipliers", "--max-pp", "30"]),  # 1350 (tp, kv-multiplier) pairs
        ({"num_hidden_layers": 63, "model_type": "mixtral", "num_local_experts": 4096}, []),  # 4096 experts, 80 tps
    ],
)
def test_plan_refuses_a_search_too_large_at_once(tmp_path, pieces_cut, changes, flags):
    """Configs at the limits ModelDims accepts: a search that would take minutes is one line and
    exit 2, before anything is priced; one tp of it answers."""
    config = {**json.loads(L70B.read_text()), **WIDE, **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    pieces_cut["limit"] = 0
    assert_clean_failure(
        run("plan", "--config", path, "--suggest", "--device-memory", "16GiB", *flags),
        "the work plan allows",
        "narrow the search with --tp",
    )
    pieces_cut["limit"] = 10**9
    result = run("plan", "--config", path, "--suggest", "--device-memory", "1TiB", "--tp", "840", "--max-pp", "8")
    assert result.exit_code in (0, 1) and "activations are not estimated" in result.output, result.stderr
