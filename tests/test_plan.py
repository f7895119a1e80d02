"""`shardkit plan`: per-rank training memory from config.json alone, checked against numbers
computed by hand from the Llama-2 7B/13B/70B dimensions; fit decisions; --suggest (smallest tp
first, every suggestion valid); impossible layouts say why (exit 2); --json parses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardkit.cli import cli
from shardkit.errors import LayoutError, ShardkitError
from shardkit.layout import Layout, ModelDims
from shardkit.memory import parse_reserve, plan_memory, suggest_layouts
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


@pytest.mark.parametrize("path, dims", [
    (L7B, (4096, 11008, 32, 32, 32)), (L13B, (5120, 13824, 40, 40, 40)), (L70B, (8192, 28672, 80, 64, 8)),
])
def test_fixture_configs(path, dims):
    c = json.loads(Path(path).read_text())
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"]) == dims
    assert c["vocab_size"] == 32000 and c["rms_norm_eps"] == 1e-5 and c["model_type"] == "llama"
    assert c["tie_word_embeddings"] is False


# ---- hand-computed parameter counts -------------------------------------------------------------

V = 32000


def test_7b_whole_model():
    H, I, L = 4096, 11008, 32
    layer = 4 * H * H + 3 * H * I + 2 * H          # q k v o (32 kv heads = MHA), gate up down, two norms
    total = V * H + L * layer + H + V * H          # embed, layers, final norm, lm_head
    assert total == 6_738_415_616
    r = plan_memory(L7B, Layout())
    assert r.parameters == r.held_parameters == total
    (s,) = r.stages
    assert s.params == total and s.layers == (0, 31)
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (2 * total, 2 * total, 12 * total)
    assert r.peak_bytes == 16 * total and r.fits is None


def test_7b_tp8():
    H, I, L, tp = 4096, 11008, 32, 8
    per_layer = 4 * H * H // tp + 3 * H * I // tp + 2 * H     # norms replicated on every tp rank
    per_rank = V * H // tp + L * per_layer + H + V * H // tp   # embed and lm_head vocab-parallel
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
    assert [s.layers for s in r.stages] == [(0, 9), (10, 20), (21, 31)]
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
        10 * per_layer + H + V * H // tp]
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


@pytest.mark.parametrize("config, layout", [
    (L7B, Layout(tp=4, pp=3)), (L7B, Layout(tp=1, pp=1)), (L13B, Layout(tp=2, pp=7)),
    (L70B, Layout(tp=16, pp=6, kv_multiplier=2)), (L70B, Layout(tp=64, pp=80, kv_multiplier=8)),
    (FIXTURES / "llama-kv8-tied.json", Layout(tp=2, pp=1)), (FIXTURES / "llama-kv8-tied.json", Layout(tp=4, pp=3)),
    (FIXTURES / "llama-bias.json", Layout(tp=4, pp=2, kv_multiplier=2)),
])
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


@pytest.mark.parametrize("text, nbytes", [
    ("16GiB", 16 * GiB), ("16GB", 16 * 10**9), ("32G", 32 * GiB), ("16 gib", 16 * GiB), ("1.5TiB", 3 * 2**39),
    ("512MiB", 2**29), ("96g", 96 * GiB), ("1024", 1024), (4096, 4096),
])
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
    return next(m for m in range(1, dims.num_heads // dims.num_kv_heads + 1)
                if (dims.num_kv_heads * m) % tp == 0 and dims.num_heads % (dims.num_kv_heads * m) == 0)


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
    result = run("plan", "--config", L70B, "--tp", "32", "--pp", "4", "--kv-multiplier", "4", "--device-memory", "16GiB")
    assert result.exit_code == 0, result.stderr
    out = result.output
    assert "tp 32, pp 4, kv-multiplier 4" in out and "574,758,912" in out
    assert "8.56 GiB per rank (9,196,142,592 B, stage 3)" in out
    assert "14.40 GiB usable: fits" in out and "activations are not estimated" in out


def test_cli_plan_does_not_fit_exits_1():
    result = run("plan", "--config", L70B, "--tp", "32", "--pp", "4", "--kv-multiplier", "4", "--device-memory", "8GiB")
    assert result.exit_code == 1 and "does NOT fit" in result.output
    result = run("plan", "--config", L70B, "--tp", "32", "--pp", "4", "--kv-multiplier", "4", "--device-memory", "8GiB",
                 "--zero1", "--dp", "4")
    assert result.exit_code == 0 and "fits" in result.output


def test_cli_plan_json_matches_library():
    result = run("plan", "--config", L13B, "--tp-size", "8", "--pp-size", "2", "--dtype", "fp32", "--world-size", "64",
                 "--zero1", "--device-memory", "32G", "--reserve", "2GiB", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.output)
    expected = plan_memory(L13B, Layout(tp=8, pp=2), dtype="fp32", zero1=True, dp=4, device_memory=32 * GiB,
                           reserve=2 * GiB).to_dict()
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


@pytest.mark.parametrize("config, flags, phrase", [
    (L70B, ["--tp", "32", "--pp", "4"], "8 kv heads x kv-multiplier 1 = 8 is not a multiple of tp 32: use --kv-multiplier 4"),
    (L70B, ["--tp", "48"], "64 q heads are not divisible by tp 48"),
    (L70B, ["--tp", "8", "--kv-multiplier", "16"], "kv-multiplier 16 is too large"),
    (L70B, ["--pp", "81"], "80 layers cannot fill 81 pipeline stages"),
    (L13B, ["--tp", "5"], "intermediate size 13824 is not divisible by tp 5"),
    (L13B, ["--tp", "5", "--suggest", "--device-memory", "16GiB"], "intermediate size 13824 is not divisible by tp 5"),
    (L70B, ["--suggest", "--pp", "81", "--device-memory", "16GiB"], "80 layers cannot fill 81"),
    (L7B, ["--device-memory", "lots"], "device memory 'lots' is not understood"),
    (L7B, ["--device-memory", "16GiB", "--reserve", "20GiB"], "give a smaller --reserve"),
    (L7B, ["--zero1"], "give --dp"),
    (L7B, ["--tp", "8", "--world-size", "12"], "cannot make --world-size 12"),
    (L7B, ["--max-pp", "4"], "--max-pp only applies with --suggest"),
    (L7B, ["--suggest"], "--suggest needs --device-memory"),
])
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
