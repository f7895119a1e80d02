"""A newcomer's day with the command line: what a new user met, each now answered in one line
that names the next step, or printed as people write it.

1. the wrong kind of folder: a checkpoint root given to `merge` (or `reshard`, `inspect`) names
   `ckpt export` and a tag folder; weights without config.json name `--config`; a model folder
   given to `ckpt export` / `ckpt reshard` / `ckpt inspect` names `merge` / `reshard` / `inspect`;
   no message speaks Python (`tag='latest_if_exists'`);
2. Ctrl-C in the first second (while click or torch are being imported) is one line and exit 130,
   never a traceback: the package faces import nothing heavy, the console script's `main` catches it;
3. the trainer refuses a --seq-len longer than the model's positions, in one line, before anything starts;
4. a trainer failure under torchrun ends with its one line: every failed rank writes it into
   torch.distributed.elastic's error file, which torchrun's report (printed last) shows;
5. numbers as people write them (`step 3`, `lr=3e-05`), `ckpt list` shows the whole layout (vpp,
   dp and ZeRO-1), and a convert to xser counts its files as `inspect` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from click.testing import CliRunner
from safety_helpers import ckpt_of_two

from shardkit.cli import cli


def run(*args: object):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    """A checkpoint directory with tags step_1 and step_2."""
    return ckpt_of_two(tmp_path_factory.mktemp("newcomer"))


@pytest.fixture(scope="module")
def shards(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("newcomer-shards") / "tp2"
    assert run("convert", tiny_model("llama-gqa64"), out, "--tp", "2").exit_code == 0
    return out


# ---- 1. the wrong kind of folder -------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["merge", "{src}", "{out}"],
        ["reshard", "{src}", "{out}", "--tp", "1"],
        ["inspect", "{src}"],
        ["verify", "{src}", "{src}"],
    ],
)
def test_a_checkpoint_root_names_ckpt_export_and_a_tag(command, ckpt_root, tmp_path):
    args = [a.format(src=ckpt_root, out=tmp_path / "out") for a in command]
    line = one_line_error(
        run(*args),
        "training checkpoint directory",
        f"shardkit ckpt export {ckpt_root} OUT",
        "--tag",
        str(ckpt_root / "step_2"),
    )
    assert "not a model directory" not in line
    assert not (tmp_path / "out").exists()


def test_weights_without_config_name_config(tiny_model, tmp_path):
    src = tmp_path / "weights-only"
    src.mkdir()
    shutil.copy(tiny_model("llama-gqa64") / "model.safetensors", src)
    one_line_error(run("merge", src, tmp_path / "out"), "model.safetensors", "no config.json", "--config")
    one_line_error(run("convert", src, tmp_path / "out", "--tp", "2"), "--config")
    assert run("merge", src, tmp_path / "out", "--config", tiny_model("llama-gqa64")).exit_code == 0


@pytest.mark.parametrize(
    "command,names",
    [
        (["ckpt", "export", "{src}", "{out}"], "shardkit merge {src} OUT"),
        (["ckpt", "reshard", "{src}", "{out}", "--tp", "1"], "shardkit reshard {src} DST"),
        (["ckpt", "inspect", "{src}"], "shardkit inspect {src}"),
    ],
)
def test_a_model_folder_given_to_ckpt_names_the_model_command(command, names, shards, tiny_model, tmp_path):
    for src, kind in ((shards, "shardkit shards"), (tiny_model("llama-gqa64"), "a Hugging Face model")):
        args = [a.format(src=src, out=tmp_path / "out") for a in command]
        line = one_line_error(run(*args), "is a model folder", kind, names.format(src=src))
        assert "latest_if_exists" not in line and "tag=" not in line
    assert not (tmp_path / "out").exists()
    assert "it is a model folder" in run("ckpt", "list", shards).output


def test_an_empty_checkpoint_directory_speaks_no_python(tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line_error(
        run("ckpt", "export", tmp_path / "empty", tmp_path / "out"), "no checkpoint tags", "--checkpoint-dir"
    )
    assert "tag=" not in line


def test_a_tag_folder_is_read_as_that_tag(ckpt_root, tmp_path):
    assert run("ckpt", "export", ckpt_root / "step_1", tmp_path / "out").exit_code == 0
    assert run("ckpt", "reshard", ckpt_root / "step_1", tmp_path / "re", "--tp", "1").exit_code == 0
    assert (tmp_path / "re" / "step_1" / "done").is_file()


# ---- 2. Ctrl-C while the command starts ----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
# A child that presses Ctrl-C (SIGINT to itself) at the moment module TARGET starts being imported,
# then runs the command as the console script does (or as `python -m shardkit`).
EARLY_INTERRUPT = r"""
import os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a test run may start with SIGINT ignored
how, target = sys.argv.pop(1), sys.argv.pop(1)


class PressCtrlC:
    def find_spec(self, name, path=None, target_module=None):
        if name == target:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, PressCtrlC())
sys.argv[0] = "shardkit"
if how == "script":
    from shardkit.cli import main  # the console script's two lines
    sys.exit(main())
runpy.run_module("shardkit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("how", ["script", "module"])
@pytest.mark.parametrize("target", ["click", "torch"])
def test_ctrl_c_while_the_command_starts_is_one_line(how, target, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", EARLY_INTERRUPT, how, target, "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130 and len(lines) == 1 and lines[0].startswith("shardkit: interrupted"), (
        done.returncode,
        done.stderr,
    )


def test_importing_the_command_line_imports_no_torch():
    code = "import sys, shardkit, shardkit.cli; print(sorted(m for m in ('torch', 'click') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


# ---- 3. the trainer and the model's positions ------------------------------------------------------------


def test_trainer_refuses_a_seq_len_beyond_the_models_positions(tiny_model, tmp_path, capsys):
    from shardkit.testing import fixture_config, make_tiny_model
    from trainer.__main__ import main

    model = make_tiny_model(fixture_config("mixtral-tiny"), tmp_path / "mixtral")  # 64 positions
    capsys.readouterr()
    base = [
        "--model",
        str(model),
        "--data",
        str(tmp_path / "tokens.bin"),
        "--global-batch",
        "4",
        "--no-progress",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    assert main([*base, "--seq-len", "512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: error: --seq-len 512"), err
    assert "64 positions" in err[0] and "--seq-len 64 or less" in err[0]
    assert not (tmp_path / "ckpt").exists()
    assert main([*base, "--seq-len", "64"]) == 2  # within the positions: the next problem is the missing data
    assert "tokens.bin" in capsys.readouterr().err


# ---- 4. a failure under torchrun ends with the trainer's line ----------------------------------------------


def test_a_failure_under_torchrun_ends_with_the_trainers_line(tiny_model, tmp_path):
    from trainer_helpers import corpus_tokens, torchrun, worker_exit_codes

    tokens = corpus_tokens(tmp_path / "tokens.bin")
    model = tiny_model("llama-gqa64")
    done = torchrun(
        2,
        [
            "--model",
            str(model),
            "--data",
            str(tokens),
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--tp",
            "2",
            "--lora-rank",
            "4",
            "--lora-targets",
            "q,qkv",
            "--checkpoint-dir",
            str(tmp_path / "c"),
        ],
        timeout=120,
    )
    assert done.returncode == 1 and worker_exit_codes(done.stderr) == {0: 2, 1: 2}, done.stderr
    line = "trainer: error: --lora-targets: unknown target 'qkv'; known: q,k,v,o,gate,up,down"
    text = [t.strip() for t in done.stderr.splitlines() if t.strip() and set(t.strip()) != {"="}]
    assert text[-1] == f"traceback : {line}", done.stderr[-2000:]
    assert "To enable traceback" not in done.stderr
    assert [t for t in done.stderr.splitlines() if t.startswith("trainer: error:")] == [line]


# ---- 5. numbers, the whole layout, file counts -------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint directory of 3 steps of the trainer's tiny Llama, lr 3e-4 decayed to 3e-4 x 0.1."""
    from trainer_helpers import COMMON, corpus_tokens, run_inprocess

    from shardkit.testing import make_tiny_model

    work = tmp_path_factory.mktemp("newcomer-trained")
    model = make_tiny_model("llama-trainer-tiny", work / "hf", seed=3)
    run_inprocess(
        [
            "--model",
            str(model),
            "--data",
            str(corpus_tokens(work / "tokens.bin")),
            *COMMON,
            "--steps",
            "3",
            "--lr",
            "3e-4",
            "--min-lr-ratio",
            "0.1",
            "--checkpoint-dir",
            str(work / "ckpt"),
        ]
    )
    return work / "ckpt"


def test_ckpt_inspect_prints_numbers_as_people_write_them(trained):
    import json

    info = json.loads(run("ckpt", "inspect", trained, "--json").output)
    assert info["step"] == 3 and isinstance(info["step"], int)
    assert info["param_groups"][0]["hyper"]["lr"] == 3e-4 * 0.1 != 3e-5  # the float the optimizer holds
    text = run("ckpt", "inspect", trained).output
    assert "step 3," in text and "lr=3e-05," in text and "initial_lr=0.0003," in text and "betas=[0.9, 0.95]" in text
    assert "2.9999999999999997e-05" not in text and "step 3.0" not in text


def test_ckpt_list_shows_the_whole_layout(trained, tmp_path):
    out = tmp_path / "vpp"
    assert run("ckpt", "reshard", trained, out, "--pp", "2", "--vpp", "2", "--dp", "2", "--zero1").exit_code == 0
    row = next(line for line in run("ckpt", "list", out).output.splitlines() if line.startswith("step_3"))
    assert "tp1 pp2 vpp2 dp2 ZeRO-1" in row, row
    row = next(line for line in run("ckpt", "list", trained).output.splitlines() if line.startswith("step_3"))
    assert "tp1 pp1 dp1" in row and "ZeRO-1" not in row, row
    (out / "step_3" / "shardkit.json").unlink()  # an NxD tag: the layout from its file names
    row = next(line for line in run("ckpt", "list", out).output.splitlines() if line.startswith("step_3"))
    assert "tp1 pp2 dp2 ZeRO-1" in row, row


def test_a_convert_to_xser_counts_files_as_inspect_does(tiny_model, tmp_path):
    import json

    out = tmp_path / "xser"
    wrote = CliRunner().invoke(
        cli,
        ["convert", str(tiny_model("llama-gqa64")), str(out), "--tp", "2", "--pp", "2", "--format", "xser"],
        catch_exceptions=False,
    )
    assert wrote.exit_code == 0, wrote.stderr
    shown = run("inspect", out).output
    said = wrote.output.split(": ", 1)[1].split(", ")[0]  # "4 rank files (+N tensor and info files beside them)"
    assert said.startswith("4 rank files (+") and f"files:   {said}," in shown, (wrote.output, shown)
    beside = sum(1 for p in (out / "model").rglob("*") if p.is_file()) - 4
    assert f"(+{beside} tensor and info files beside them)" in said
    report = json.loads(
        run(
            "convert",
            tiny_model("llama-gqa64"),
            tmp_path / "x2",
            "--tp",
            "2",
            "--pp",
            "2",
            "--format",
            "xser",
            "--json",
        ).output
    )
    inspected = json.loads(run("inspect", tmp_path / "x2", "--json").output)
    assert (report["files"], report["files_beside"]) == (inspected["files"], inspected["files_beside"]) == (4, beside)
