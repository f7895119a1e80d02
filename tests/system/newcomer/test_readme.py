"""Every command in README.md runs, as written, against tiny models.

The commands are read from the README's code blocks (`shardkit ...`, `torchrun ...`, `python -m
trainer ...`, `python scripts/...`; continuation lines joined, `&&` chains split, comments
dropped). Each must be listed in COMMANDS below, which says how it runs; a README command missing
from the table, or a table entry the README no longer has, fails `test_every_readme_command_is_in_the_table`.

The commands run in a fresh folder, as a user would from a checkout: `scripts/` and `fixtures/`
are linked into it, and the models the README names but nobody can download here are built at
their paths with `shardkit.testing.make_tiny_model` (MODELS), or served by the loopback Hub stand-in
(HUB_REPOS, tests/support/hub_server.py, as in tests/unit/hub/test_hub.py). The only other changes are in SHORTER:
the training runs take a few steps instead of hundreds. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hub_server import HubStandIn, Token
from trainer_helpers import check_ok, corpus_tokens, run_ranks

from shardkit.testing import fixture_config, make_tiny_model

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
TOKEN = "hf_shardkitReadmeWRITE0123456789abcdefXYZ"

# ---- the substitution table ------------------------------------------------------------------------

MODELS = {
    # README path -> the fixture config built there. llama-gqa64 has 64 q heads, 8 kv heads, 5 layers,
    # so the README's tp 32 pp 4 kv-multiplier 4 (and tp 8 / tp 16 reshards) fit it as they fit 70B.
    "Llama-2-70b-hf": "llama-gqa64",
    "bert-base-uncased": "bert-tiny",  # with a WordPiece tokenizer of the tweets' words (TOKENIZED)
}
TOKENIZED = ("bert-base-uncased",)
HUB_REPOS = {"meta-llama/Llama-2-7b-hf": "llama-gqa64"}  # served by the stand-in Hub
MIXTRAL_CHECKPOINT = "mixtral-ckpt"  # a tiny Mixtral's checkpoint, trained 2 steps at ep 2 on 2 processes
SHORTER = {  # the README's training runs, shortened (whole words only)
    "--steps 300": "--steps 4",
    "--checkpoint-every 100": "--checkpoint-every 2",
    "--steps 100": "--steps 2",
    "step_200": "step_2",
}

# ---- the README's commands, in the order they run, by group ---------------------------------------
# models: in-process (click's runner) in a folder holding ./Llama-2-70b-hf; hub: `python -m shardkit`
# with the stand-in Hub in its environment; training: the demo, the trainer and the checkpoint
# commands, in one folder; torchrun: `torchrun` itself (--standalone, for a free port).

MODELS_GROUP = [
    "shardkit convert ./Llama-2-70b-hf ./runs/llama70b-tp32pp4 --tp 32 --pp 4 --kv-multiplier 4 --qkv gqa",
    "shardkit merge ./runs/llama70b-tp32pp4 ./runs/llama70b-merged",
    "shardkit reshard ./runs/llama70b-tp32pp4 ./runs/llama70b-tp8pp4 --tp 8 --pp 4 --kv-multiplier 1",
    "shardkit inspect ./runs/llama70b-tp32pp4 --check-data",
    "shardkit verify ./Llama-2-70b-hf ./runs/llama70b-tp32pp4",
    "shardkit plan --config ./Llama-2-70b-hf/config.json --tp 32 --pp 4 --kv-multiplier 4 --device-memory 16GiB",
    "shardkit plan --config ./Llama-2-70b-hf/config.json --suggest --device-memory 16GiB --zero1 --dp 4",
    "shardkit convert ./Llama-2-70b-hf ./runs/llama70b-dcp --format dcp --convention torchtitan",
    "shardkit convert ./Llama-2-70b-hf ./runs/llama70b-optimum --format optimum-neuron --tp 16 --kv-multiplier 2 "
    "--qkv gqa",
]
TORCHRUN_GROUP = [
    "torchrun --nproc-per-node 2 -m shardkit reshard ./runs/llama70b-tp32pp4 ./runs/llama70b-tp16pp2 --tp 16 --pp 2 "
    "--kv-multiplier 2",
]
HUB_GROUP = [
    "shardkit convert meta-llama/Llama-2-7b-hf ./runs/llama7b-tp8 --tp 8",
    "shardkit verify meta-llama/Llama-2-7b-hf ./runs/llama7b-tp8",
    "shardkit push ./runs/llama7b-tp8 my-org/llama-7b-tp8 --create --private",
    "shardkit merge ./runs/llama7b-tp8 ./runs/llama7b-merged --push-to my-org/llama-7b-merged --create",
]
TRAINING_GROUP = [
    "python scripts/demo.py --out runs/demo",
    "python scripts/prepare_data.py fixtures/tiny-corpus.txt --out runs/tokens.bin",
    "torchrun --nproc-per-node 4 -m trainer --model runs/demo/tinyllama-mini-tp8pp2 --data runs/tokens.bin "
    "--tp 2 --pp 2 --global-batch 8 --seq-len 64 --steps 300 --checkpoint-dir ./runs/ckpt --checkpoint-every 100 "
    "--num-kept 3 --async-save --resume latest_if_exists --export-hf ./runs/llama-trained",
    "python -m trainer --model runs/demo/tinyllama-mini --data runs/tokens.bin --seq-len 64 --steps 100 "
    "--lora-rank 8 --lora-targets q,k,v,o --checkpoint-dir ./runs/ckpt-lora",
    "python -m trainer --model ./bert-base-uncased --task sequence-classification --data fixtures/tweets-tiny.csv "
    "--label-column sentiment --seq-len 32 --global-batch 12 --steps 30 --lr 5e-5 --export-hf ./runs/bert-tweets",
    "shardkit ckpt list ./runs/ckpt",
    "shardkit ckpt inspect ./runs/ckpt",
    "shardkit ckpt export ./runs/ckpt ./runs/step200-hf --tag step_200",
    "shardkit ckpt export ./runs/ckpt ./runs/trained-fp32 --dtype fp32",
    "shardkit ckpt reshard ./runs/ckpt ./runs/ckpt-tp4 --tp 4 --dp 2 --zero1",
    "shardkit ckpt prune ./runs/ckpt --keep 1 --dry-run",
    "shardkit ckpt export ./runs/ckpt-lora ./runs/lora-adapter",
    "shardkit ckpt export ./runs/ckpt-lora ./runs/lora-merged --merged",
    "shardkit ckpt export ./runs/ckpt-lora ./runs/lora-merged-from-shards --merged --base runs/demo/tinyllama-mini-tp8pp2",
    "shardkit ckpt reshard ./mixtral-ckpt ./runs/mixtral-ckpt-ep4 --tp 2 --ep 4",
]
COMMANDS = MODELS_GROUP + TORCHRUN_GROUP + HUB_GROUP + TRAINING_GROUP

# Shell lines that set up the machine (not shardkit's commands): not run here (CI runs the last two).
SETUP = {
    "python -m venv .venv",
    ". .venv/bin/activate",
    "python -m pip install torch --index-url https://download.pytorch.org/whl/cpu",
    "python -m pip install -e .",
    'python -m pip install -e ".[test]"',
    "python -m pytest",
}
RUN_PREFIXES = ("shardkit ", "torchrun ", "python -m trainer ", "python scripts/")


# ---- reading the README ------------------------------------------------------------------------------


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def shell_lines(text: str) -> list[str]:
    """Every command of the README's non-Python code blocks: continuations joined, comments
    dropped, `&&` chains split, whitespace normalised."""
    lines = []
    for lang, body in code_blocks(text):
        if lang == "python":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s", " " + line, maxsplit=1)[0]
            lines += [" ".join(part.split()) for part in line.split("&&") if part.strip()]
    return lines


def readme_commands() -> list[str]:
    return [line for line in shell_lines(README.read_text()) if line.startswith(RUN_PREFIXES)]


def shorter(command: str) -> str:
    for long, short in SHORTER.items():
        command = re.sub(rf"(?<!\S){re.escape(long)}(?!\S)", short, command)
    return command


def test_every_readme_command_is_in_the_table():
    lines = shell_lines(README.read_text())
    unknown = [line for line in lines if not line.startswith(RUN_PREFIXES) and line not in SETUP]
    assert not unknown, f"README shell lines that are neither a command this test runs nor setup: {unknown}"
    commands = readme_commands()
    assert len(commands) == len(set(commands)), "a README command appears twice"
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, f"README commands not in tests/system/newcomer/test_readme.py's table (add them): {missing}"
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, f"commands in tests/system/newcomer/test_readme.py's table that the README no longer has: {stale}"
    assert len(COMMANDS) == len(set(COMMANDS))


def test_readme_is_for_users():
    """At most 250 lines; no issue numbers, round names or commit ids (their history is in docs/history/)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for path in (README, ROOT / "docs" / "ARCHITECTURE.md"):
        body = path.read_text()
        assert not re.findall(r"(?<![\w&])#\d+", body), f"{path.name}: issue references"
        rounds = re.findall(r"\brounds?\b(?![ -]trips?\b|-robin)", body, flags=re.I)  # round trips are fine
        assert not rounds, f"{path.name}: round names"
        assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", body), (
            f"{path.name}: commit ids"
        )
        assert "tried and dropped" not in body.lower(), path.name
    assert ".ci/run" not in text and "shared/golden" not in text
    # CI runs the README's test command (.ci/run says so): it stays as CI has it
    assert 'python -m pip install -e ".[test]" && python -m pytest' in text


# ---- running them ------------------------------------------------------------------------------------


def python_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def workspace(tmp_path: Path) -> Path:
    """A folder like a checkout: scripts/ and fixtures/ linked in, the README's big models built small."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("scripts", "fixtures"):
        (work / name).symlink_to(ROOT / name, target_is_directory=True)
    for path, config in MODELS.items():
        make_tiny_model(config, work / path)
    for path in TOKENIZED:
        from bert_helpers import write_vocab

        write_vocab(work / path)
    return work


def run_shardkit(command: str) -> None:
    from shardkit.cli import cli

    result = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert result.exit_code == 0, (command, result.output, result.stderr, result.exception)


def run_process(command: list[str], work: Path, env: dict[str, str] | None = None, timeout: float = 900) -> None:
    done = subprocess.run(command, cwd=work, env=env or python_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-5000:])


def run_command(command: str, work: Path) -> None:
    """One README command (after SHORTER) in `work`, the current folder."""
    args = shlex.split(shorter(command))
    if args[0] == "shardkit":
        run_shardkit(shlex.join(args))
    elif args[0] == "torchrun":
        run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", *args[1:]], work)
    elif args[:3] == ["python", "-m", "trainer"]:
        from trainer.__main__ import main

        assert main(args[3:]) == 0, command
    elif args[0] == "python" and args[1].startswith("scripts/"):
        run_process([sys.executable, *args[1:]], work)
    else:
        raise AssertionError(f"no way to run {command!r}")


def only_runs_written(work: Path, before: set[str]) -> None:
    """The README's commands write under runs/ only."""
    assert {p.name for p in work.iterdir()} - before <= {"runs"}


def test_readme_model_commands_run(tmp_path, monkeypatch):
    work = workspace(tmp_path)
    before = {p.name for p in work.iterdir()}
    monkeypatch.chdir(work)
    for command in MODELS_GROUP:
        run_command(command, work)
    only_runs_written(work, before)
    assert (work / "runs/llama70b-merged/model.safetensors").is_file()
    assert (work / "runs/llama70b-dcp/.metadata").is_file()
    assert (work / "runs/llama70b-optimum/shards/mp_metadata_pp_rank_0.json").is_file()


def test_readme_python_api_runs(tmp_path, monkeypatch):
    work = workspace(tmp_path)
    monkeypatch.chdir(work)
    blocks = [body for lang, body in code_blocks(README.read_text()) if lang == "python"]
    assert blocks, "the README's Python example is gone"
    for body in blocks:
        exec(compile(body, str(README), "exec"), {"__name__": "readme"})
    assert (work / "runs/api-merged/config.json").is_file()


@pytest.mark.slow
def test_readme_torchrun_reshard_runs(tmp_path, monkeypatch):
    work = workspace(tmp_path)
    monkeypatch.chdir(work)
    run_command(MODELS_GROUP[0], work)  # its source
    for command in TORCHRUN_GROUP:
        run_command(command, work)
    assert (work / "runs/llama70b-tp16pp2/shardkit.json").is_file()


@pytest.mark.slow
def test_readme_hub_commands_run(tmp_path, monkeypatch):
    work = workspace(tmp_path)
    hub = HubStandIn({TOKEN: Token("alice", orgs=("my-org",))})
    for repo, config in HUB_REPOS.items():
        hub.add_repo(repo, make_tiny_model(config, tmp_path / "served" / repo))
    hub.start()
    try:
        env = {k: v for k, v in python_env().items() if not k.startswith(("HF_", "HUGGING_FACE"))}
        env.update(
            HF_ENDPOINT=hub.url,
            HF_HOME=str(tmp_path / "hf-home"),
            HF_TOKEN=TOKEN,
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            NO_PROXY="127.0.0.1",
            no_proxy="127.0.0.1",
        )
        for command in HUB_GROUP:
            args = shlex.split(command)
            run_process([sys.executable, "-m", "shardkit", *args[1:]], work, env=env, timeout=300)
        assert "model.safetensors" in hub.files("my-org/llama-7b-tp8")  # pushed merged, with a model card
        assert "README.md" in hub.files("my-org/llama-7b-merged")
    finally:
        hub.stop()
    assert not hub.errors, hub.errors


@pytest.mark.slow
def test_readme_training_and_checkpoint_commands_run(tmp_path, monkeypatch):
    work = workspace(tmp_path)
    # a user's Mixtral training checkpoint at ep 2 (built with absolute paths: the ranks are forked
    # from a server whose working folder is not this one)
    model = make_tiny_model(fixture_config("mixtral-tiny"), tmp_path / "mixtral-hf", seed=3)
    tokens = corpus_tokens(tmp_path / "mixtral-tokens.bin", vocab=64)
    check_ok(
        run_ranks(
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
                "--steps",
                "2",
                "--dtype",
                "fp32",
                "--no-progress",
                "--threads",
                "1",
                "--ep",
                "2",
                "--checkpoint-dir",
                str(work / MIXTRAL_CHECKPOINT),
            ],
        )
    )
    before = {p.name for p in work.iterdir()}
    monkeypatch.chdir(work)
    for command in TRAINING_GROUP:
        run_command(command, work)
    only_runs_written(work, before)
    runs = work / "runs"
    assert (runs / "llama-trained/model.safetensors").is_file()
    assert (runs / "lora-adapter/adapter_config.json").is_file()
    assert (runs / "lora-merged-from-shards/model.safetensors").is_file()
    assert json.loads((runs / "bert-tweets/config.json").read_text())["id2label"] == {
        "0": "negative",
        "1": "neutral",
        "2": "positive",
    }
    assert (runs / "mixtral-ckpt-ep4").is_dir()
