"""Shared parts of shardkit's benchmarks (bench_convert, and later reshard and checkpoint ones).

What is here:

* **Synthetic checkpoints.** `SHAPES` holds named Llama configs ("tinyllama" = TinyLlama-1.1B,
  "tiny" for smoke runs); `build_synthetic_checkpoint` writes a real Hugging Face directory
  (config.json + size-split safetensors + model.safetensors.index.json) tensor by tensor, with
  the exact HF names and shapes and seeded random values, without instantiating a model and
  without holding more than one chunk of one tensor. Results are cached under the work dir and
  reused when the marker file matches the requested spec.
* **Measured child processes.** Every measured operation runs in a fresh process so that its
  peak RSS is its own:
    - Python operations run through this file's child runner (`python bench_common.py --child
      SPEC.json`): it imports the target (and `preload` modules) first, tells the parent it is
      ready and waits while the parent settles the page cache (`settle`: right before the step,
      as for cp), then times only the call with `time.perf_counter`, and reports the process's
      own peak RSS from `VmHWM` in `/proc/self/status` (the high-water mark of the process's own address space; it includes
      the interpreter and the imported libraries, whose RSS is reported separately as `base`).
      A sampler thread also records the peak anonymous and file-backed (mmapped) RSS every 10 ms.
    - External commands (`cp -r`) run under GNU `/usr/bin/time -f %M`, which reports the
      command's own `ru_maxrss`.
  Why not `os.wait4`/`RUSAGE_CHILDREN` in the parent: on Linux a child's `ru_maxrss` starts from
  the forking parent's high-water mark (exec keeps it), so a parent that imported torch would
  inflate every child's number; and `RUSAGE_CHILDREN` is a maximum, not a sum, so differences do
  not isolate one child. Without `/usr/bin/time` we fall back to `wait4` and flag the value as an
  upper bound (the parent stays light: it never imports torch).
* **Baselines and output.** `cp_baseline` (`cp -r --reflink=never`), `dir_bytes`, page-cache
  handling (`settle` right before every timed step: sync, or with --drop-caches `sync; echo 3 >
  /proc/sys/vm/drop_caches`, which `require_drop_caches` checks up front and refuses with exit 2
  when it is not possible), statistics over repeats, table, load-average and JSON printing, and a
  torch-free comparison of two Hugging Face safetensors directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parent
GB = 10**9
MB = 10**6
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "shardkit-bench"
BUILDER_VERSION = 1
MARKER = ".bench_synthetic.json"

# ---- model shapes ------------------------------------------------------------------------------

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json (1.1B params, 2.2 GB in bf16).
    "tinyllama": {
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # Same head structure (32 q / 4 kv heads), ~60 MB: a quick smoke run.
    "tiny": {
        **_LLAMA_COMMON,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": 8192,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}

# Split size of the synthetic safetensors files per shape (transformers-style split by bytes).
SHARD_SIZES = {"tinyllama": "1GB", "tiny": "20MB"}
DEFAULT_SHARD_SIZE = "1GB"

DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def load_shape(shape: str | None, config_path: str | None = None) -> tuple[str, dict[str, Any]]:
    """(name, config dict) from a named shape or a config.json path (the path wins)."""
    if config_path:
        config = json.loads(Path(config_path).read_text())
        return Path(config_path).stem, config
    name = shape or "tinyllama"
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}: use one of {', '.join(SHAPES)} or --config path.json")
    return name, dict(SHAPES[name])


def llama_tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face tensor names and shapes of a Llama-style config, in transformers' state-dict order."""
    if config.get("num_local_experts"):
        raise SystemExit("the synthetic builder writes dense Llama-style models only (no experts)")
    H = int(config["hidden_size"])
    I = int(config["intermediate_size"])
    L = int(config["num_hidden_layers"])
    nq = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nq)
    D = int(config.get("head_dim") or H // nq)
    V = int(config["vocab_size"])
    attn_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (V, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", nq * D), ("k_proj", nkv * D), ("v_proj", nkv * D)):
            out.append((f"{p}self_attn.{proj}.weight", (rows, H)))
            if attn_bias:
                out.append((f"{p}self_attn.{proj}.bias", (rows,)))
        out.append((f"{p}self_attn.o_proj.weight", (H, nq * D)))
        if attn_bias:
            out.append((f"{p}self_attn.o_proj.bias", (H,)))
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            out.append((f"{p}mlp.{proj}.weight", shape))
            if mlp_bias:
                out.append((f"{p}mlp.{proj}.bias", (shape[0],)))
        out.append((f"{p}input_layernorm.weight", (H,)))
        out.append((f"{p}post_attention_layernorm.weight", (H,)))
    out.append(("model.norm.weight", (H,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, H)))
    return out


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def split_files(
    tensors: list[tuple[str, tuple[int, ...]]], itemsize: int, max_shard_size: int | str
) -> dict[str, list[str]]:
    """File name -> tensor names, the way transformers/huggingface_hub split a state dict
    (greedy in state-dict order; a tensor larger than the limit gets its own file)."""
    from shardkit.sizes import parse_size  # here, not at the top: the parent never imports shardkit (and torch)

    limit = parse_size(max_shard_size, what="max_shard_size")
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, shape in tensors:
        n = numel(shape) * itemsize
        if n > limit:
            shards.append([name])
            continue
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    total = len(shards)
    return {f"model-{i + 1:05d}-of-{total:05d}.safetensors": names for i, names in enumerate(shards)}


def synthetic_spec(
    name: str, config: dict[str, Any], dtype: str = "bfloat16", max_shard_size: int | str | None = None, seed: int = 0
) -> dict[str, Any]:
    return {
        "builder_version": BUILDER_VERSION,
        "shape": name,
        "config": config,
        "dtype": dtype,
        "max_shard_size": max_shard_size or SHARD_SIZES.get(name, DEFAULT_SHARD_SIZE),
        "seed": seed,
    }


def synthetic_dir(workdir: Path, spec: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return Path(workdir) / f"hf-{spec['shape']}-{spec['dtype']}-{digest}"


def cached_checkpoint(workdir: Path, spec: dict[str, Any]) -> Path | None:
    """The cached synthetic checkpoint for `spec`, or None when absent, incomplete or different."""
    path = synthetic_dir(workdir, spec)
    marker = path / MARKER
    if not marker.is_file():
        return None
    try:
        saved = json.loads(marker.read_text())
    except ValueError:
        return None
    if saved.get("spec") != json.loads(json.dumps(spec)):
        return None
    for fname, size in saved.get("files", {}).items():
        f = path / fname
        if not f.is_file() or f.stat().st_size != size:
            return None
    return path


def build_synthetic_checkpoint(workdir: str, spec: dict[str, Any], chunk_elems: int = 16 * 2**20) -> dict[str, Any]:
    """Write the synthetic HF checkpoint of `spec` under `workdir` (or reuse the cached one).

    Tensors are written one at a time, each in chunks of at most `chunk_elems` values drawn from a
    generator seeded by (seed, tensor index): weights ~ N(0, 0.02), norms ~ 1 + N(0, 0.02). The
    directory is built beside its final name and renamed into place, with a marker written last.
    Runs in a child process (it imports torch)."""
    import torch

    workdir = Path(workdir)
    existing = cached_checkpoint(workdir, spec)
    if existing is not None:
        return {"path": str(existing), "cached": True}
    final = synthetic_dir(workdir, spec)
    st_dtype, itemsize = DTYPES[spec["dtype"]]
    torch_dtype = getattr(torch, spec["dtype"])
    tensors = llama_tensors(spec["config"])
    shapes = dict(tensors)
    order = {name: i for i, (name, _) in enumerate(tensors)}
    files = split_files(tensors, itemsize, spec["max_shard_size"])

    stage = workdir / f".{final.name}.building-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    stage.mkdir(parents=True)
    sizes: dict[str, int] = {}
    for fname, names in files.items():
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            n = numel(shapes[name]) * itemsize
            header[name] = {"dtype": st_dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(stage / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for name in names:
                shape = shapes[name]
                gen = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + order[name])
                total = numel(shape)
                is_norm = len(shape) == 1 and name.endswith("norm.weight")
                done = 0
                while done < total:
                    n = min(chunk_elems, total - done)
                    chunk = torch.randn(n, generator=gen, dtype=torch.float32).mul_(0.02)
                    if is_norm:
                        chunk.add_(1.0)
                    fh.write(chunk.to(torch_dtype).view(torch.uint8).numpy())
                    done += n
        sizes[fname] = (stage / fname).stat().st_size
    if len(files) > 1:
        total_size = sum(numel(s) * itemsize for _, s in tensors)
        weight_map = {name: fname for fname, names in files.items() for name in names}
        (stage / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
        )
    config = dict(spec["config"])
    config["torch_dtype"] = spec["dtype"]
    (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (stage / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config.get("bos_token_id", 1), "eos_token_id": config.get("eos_token_id", 2)}, indent=2
        )
        + "\n"
    )
    (stage / MARKER).write_text(json.dumps({"spec": spec, "files": sizes}, indent=2) + "\n")
    os.rename(stage, final)
    return {"path": str(final), "cached": False}


def synthetic_source(
    workdir: Path, logdir: Path, name: str, config: dict[str, Any], dtype: str = "bfloat16", seed: int = 0
) -> tuple[Path, Measurement]:
    """Build (or reuse) the synthetic checkpoint in a child process, so that the parent never
    imports torch; returns its directory and the build's Measurement (`.result["cached"]`)."""
    spec = synthetic_spec(name, config, dtype, seed=seed)
    built = run_python(
        "build",
        "bench_common:build_synthetic_checkpoint",
        {"workdir": str(workdir), "spec": spec},
        logdir,
        preload=("torch",),
    )
    return Path(built.result["path"]), built


# ---- files, disks and the page cache -------------------------------------------------------------


def dir_bytes(path: str | Path) -> int:
    """Total size of the regular files under `path` (or of the file)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def remove(path: str | Path) -> None:
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def sync_disks() -> None:
    """Flush dirty pages so that one step's writeback does not slow the next (untimed)."""
    os.sync()


def drop_caches() -> tuple[bool, str]:
    """sync and drop the page cache (needs a writable /proc/sys/vm/drop_caches)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True, "dropped"
    except OSError as e:
        return False, f"cannot drop caches ({e.strerror or e})"


DROP_CACHES_EXIT = 2


def _refuse_drop_caches(why: str) -> None:
    print(
        f"--drop-caches: {why}; the page cache cannot be dropped here (needs root and a writable "
        "/proc/sys/vm/drop_caches). Run without --drop-caches for a warm-cache measurement.",
        file=sys.stderr,
    )
    raise SystemExit(DROP_CACHES_EXIT)


def require_drop_caches() -> None:
    """For --drop-caches: drop the page cache once now, or say why it is not possible and exit 2."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        _refuse_drop_caches(f"not running as root (uid {os.geteuid()})")
    ok, why = drop_caches()
    if not ok:
        _refuse_drop_caches(why)


SETTLE_WAIT = 0.0
"""Seconds to wait after settling, before a timed step starts (the scripts' --settle-wait)."""


def add_settle_wait(parser: Any) -> None:
    """The --settle-wait option of the benchmark scripts (see `settle`)."""
    parser.add_argument(
        "--settle-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long after settling, before every timed step, cp included (default 0: start "
        "right away). On a VM that hands free memory back to its host, 5 s measures every step "
        "in the state where fresh memory costs a host fault",
    )


def use_settle_wait(args: Any) -> None:
    """Apply --settle-wait (exit 2 when negative)."""
    global SETTLE_WAIT
    if args.settle_wait < 0:
        print("--settle-wait must be 0 or more seconds", file=sys.stderr)
        raise SystemExit(2)
    SETTLE_WAIT = args.settle_wait


def settle(drop: bool, *remove_first: str | Path) -> None:
    """Right before every timed step (cp baselines included), untimed: remove `remove_first` (the
    step's earlier output), sync, and with `drop` also drop the page cache (`sync; echo 3 >
    /proc/sys/vm/drop_caches`; exits 2 if that stops working); then wait SETTLE_WAIT seconds.

    Why right before, for cp and shardkit alike: on a VM whose balloon driver reports free memory
    to the host (virtio-balloon free page reporting), memory freed by the drop or the removal is
    handed back to the host within about two seconds, and the first touch of a page handed back
    costs a host fault (measured here: a cold `cp -r` of 2.2 GB took 1.1 s right after the drop
    and 3.5-3.8 s five seconds later). A step that starts right after settling writes into memory
    the host still backs; SETTLE_WAIT > 0 measures every step in the other state. With a warm
    cache the same holds for a step's earlier output: so every step, cp included, keeps its output
    until it runs again and removes it here (from the second repeat on, each starts with about
    what it will write freshly freed)."""
    for path in remove_first:
        remove(path)
    if not drop:
        sync_disks()
    else:
        ok, why = drop_caches()
        if not ok:
            _refuse_drop_caches(why)
    if SETTLE_WAIT > 0:
        time.sleep(SETTLE_WAIT)


# ---- which shardkit is measured ----------------------------------------------------------------

REPO_ROOT = SCRIPTS_DIR.parent


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """HEAD commit of the repository and whether shardkit/ has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "shardkit"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def shardkit_snapshot(ref: str, workdir: str | Path, repo: Path = REPO_ROOT) -> tuple[Path, str]:
    """Export shardkit/ at git `ref` to workdir/snapshots/<sha> (once); returns (dir for
    PYTHONPATH, commit sha). Lets a benchmark measure a fixed commit while the tree is edited."""
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest = Path(workdir) / "snapshots" / sha[:12]
    if not (dest / "shardkit" / "__init__.py").is_file():
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", sha, "shardkit"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    return dest, sha


def child_env(pythonpath: str | Path | None) -> dict[str, str] | None:
    """The environment for children that should import shardkit from `pythonpath` first."""
    if pythonpath is None:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def busy_note(load: tuple[float, float, float] | None) -> str:
    """A warning when other work competes for the CPUs (timings are then noisy)."""
    cpus = os.cpu_count() or 1
    if load is None:
        return ""
    return (
        f"WARNING: 1-min load average {load[0]:.1f} on {cpus} CPUs: other processes compete, timings are noisy"
        if load[0] > 0.5 * cpus
        else ""
    )


def load_lines(start: tuple[float, float, float] | None, end: tuple[float, float, float] | None) -> list[str]:
    """The report's "load:" line for the load averages at the start and the end of a run, with a
    warning under it when either shows a busy machine (none when the load average is unknown)."""
    if not (start and end):
        return []
    first = (
        f"load:   1/5/15-min load average {'/'.join(f'{x:.1f}' for x in start)} at start, "
        f"{'/'.join(f'{x:.1f}' for x in end)} at end"
    )
    lines = [first]
    lines += [f"        {note}" for note in {busy_note(start), busy_note(end)} - {""}]
    return lines


# ---- measured children ---------------------------------------------------------------------------


@dataclass
class Measurement:
    """One measured operation (one child process)."""

    op: str
    seconds: float  # the operation only (inside the child, after imports) for Python children
    process_seconds: float  # the whole child process, as seen by the parent
    peak_rss: int  # bytes; the child's own high-water mark
    base_rss: int | None = None  # bytes resident before the operation started (interpreter + imports)
    peak_anon: int | None = None  # sampled peak of anonymous RSS (bytes)
    peak_file: int | None = None  # sampled peak of file-backed RSS (bytes): mapped checkpoint pages
    cpu_seconds: float | None = None  # user + system CPU time of the operation
    cpu_by_thread: dict[str, list[float]] | None = None  # thread name -> [user, system] CPU seconds
    bytes_written: int = 0
    rss_method: str = ""
    result: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["throughput"] = self.throughput
        return d


class ChildError(RuntimeError):
    pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_python(
    op: str,
    target: str,
    kwargs: dict[str, Any],
    logdir: str | Path,
    *,
    preload: Iterable[str] = (),
    sys_path: Iterable[str | Path] = (),
    profile: str | Path | None = None,
    env: dict[str, str] | None = None,
    before: Callable[[], None] | None = None,
) -> Measurement:
    """Run `target` ("module:function") with JSON `kwargs` in a fresh Python process and measure it.

    The child imports `preload` and the target's module, says it is ready, and waits; the parent
    then calls `before` (e.g. `settle`) and lets the call start, so that the step begins right
    after its preparation, as a cp baseline does, and not a second or two of imports later. The
    function's return value (JSON-serialisable) comes back as `Measurement.result`. With
    `profile`, the call runs under cProfile and the stats are dumped to that path (timings are
    then inflated)."""
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    tag = f"{op.replace(' ', '_').replace('/', '_')}-{os.getpid()}-{time.time_ns()}"
    spec_path = logdir / f"{tag}.spec.json"
    result_path = logdir / f"{tag}.result.json"
    log_path = logdir / f"{tag}.log"
    spec = {
        "target": target,
        "kwargs": kwargs,
        "preload": list(preload),
        "sys_path": [str(p) for p in (SCRIPTS_DIR, *sys_path)],
        "result": str(result_path),
        "profile": str(profile) if profile else None,
    }
    ready_read, ready_write = os.pipe()
    spec["ready_fd"] = ready_write
    spec_path.write_text(json.dumps(spec))
    cmd = [
        sys.executable,
        "-B",
        str(Path(__file__).resolve()),
        "--child",
        str(spec_path),
    ]  # -B: no __pycache__ in scripts/
    t0 = time.perf_counter()
    with open(log_path, "wb") as log, os.fdopen(ready_read, "rb") as ready:
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(ready_write,)
            )
        finally:
            os.close(ready_write)  # the child's copy is its own: EOF here once it exits
        try:
            if ready.read(1) == b"r":  # else the child ended before it was ready: its exit code says why
                if before is not None:
                    before()
                assert proc.stdin is not None
                proc.stdin.write(b"g")
                proc.stdin.close()
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result_path.is_file():
        raise ChildError(f"{op} failed (exit {proc.returncode}); log {log_path}:\n{_tail(log_path)}")
    res = json.loads(result_path.read_text())
    for p in (spec_path, result_path):
        p.unlink(missing_ok=True)
    if log_path.stat().st_size == 0:
        log_path.unlink()
    return Measurement(
        op=op,
        seconds=res["seconds"],
        process_seconds=wall,
        peak_rss=res["peak_rss"],
        base_rss=res["base_rss"],
        peak_anon=res["peak_anon"],
        peak_file=res["peak_file"],
        cpu_seconds=res["cpu_seconds"],
        cpu_by_thread=res.get("cpu_by_thread"),
        rss_method="VmHWM of the child (/proc/self/status)",
        result=res["return"],
    )


def run_command(op: str, cmd: Sequence[str], logdir: str | Path) -> Measurement:
    """Run an external command in a child and measure wall time (parent perf_counter) and the
    command's own peak RSS (GNU time's %M; wait4's ru_maxrss, an upper bound, without it)."""
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    gnu_time = shutil.which("time", path="/usr/bin:/bin")  # the binary, not the shell keyword
    tag = f"{op.replace(' ', '_').replace('/', '_')}-{os.getpid()}-{time.time_ns()}"
    log_path = logdir / f"{tag}.log"
    if gnu_time:
        time_path = logdir / f"{tag}.time"
        full = [gnu_time, "-o", str(time_path), "-f", "%M %U %S", *cmd]
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise ChildError(f"{op} failed (exit {proc.returncode}):\n{_tail(log_path)}")
        # GNU time writes "Command exited..." lines first on failure; the last line holds the numbers.
        maxrss_kb, utime, stime = time_path.read_text().split("\n")[-2].split()
        time_path.unlink()
        peak, cpu, method = int(maxrss_kb) * 1024, float(utime) + float(stime), "ru_maxrss of the command (GNU time %M)"
    else:
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT)
            _, status, ru = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise ChildError(f"{op} failed (exit {proc.returncode}):\n{_tail(log_path)}")
        peak, cpu = ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime
        method = "wait4 ru_maxrss (upper bound: includes the parent's RSS at fork)"
    if log_path.stat().st_size == 0:
        log_path.unlink()
    return Measurement(op=op, seconds=wall, process_seconds=wall, peak_rss=peak, cpu_seconds=cpu, rss_method=method)


def cp_baseline(
    op: str, src: str | Path, dst: str | Path, logdir: str | Path, *, keep: bool = False, drop: bool = False
) -> Measurement:
    """`cp -r src dst` (no reflinks, so bytes are really copied), started right after `settle(drop,
    dst)` as every timed step is; bytes_written = size of the copy. The copy is removed afterwards
    unless `keep`."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    settle(drop, dst)
    m = run_command(op, ["cp", "-r", "--reflink=never", str(src), str(dst)], logdir)
    m.bytes_written = dir_bytes(dst)
    if not keep:
        remove(dst)
    return m


# ---- the child runner ----------------------------------------------------------------------------


def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0])
    return out


def _child_main(spec_path: str) -> None:
    import gc
    import importlib
    import resource
    import threading

    spec = json.loads(Path(spec_path).read_text())
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    for mod in spec["preload"]:
        importlib.import_module(mod)
    module, _, func_name = spec["target"].partition(":")
    func = getattr(importlib.import_module(module), func_name)
    gc.collect()
    if spec.get("ready_fd") is not None:  # ready: the parent settles the page cache, then says go
        os.write(spec["ready_fd"], b"r")
        os.close(spec["ready_fd"])
        if sys.stdin.buffer.read(1) != b"g":
            raise SystemExit("the benchmark parent went away before the step started")
    base = _status_kb()
    peaks = {"RssAnon": base.get("RssAnon", 0), "RssFile": base.get("RssFile", 0)}
    stop = threading.Event()
    threads = _ThreadCPU()

    def sample() -> None:
        ticks = 0
        while not stop.wait(0.01):
            s = _status_kb()
            for k in peaks:
                peaks[k] = max(peaks[k], s.get(k, 0))
            ticks += 1
            if ticks % 5 == 0:
                threads.sample()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    ret = func(**spec["kwargs"])
    seconds = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(spec["profile"])
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    threads.sample()
    stop.set()
    sampler.join()
    end = _status_kb()
    for k in peaks:
        peaks[k] = max(peaks[k], end.get(k, 0))
    result = {
        "seconds": seconds,
        "peak_rss": end["VmHWM"] * 1024,
        "base_rss": base["VmRSS"] * 1024,
        "peak_anon": peaks["RssAnon"] * 1024,
        "peak_file": peaks["RssFile"] * 1024,
        "cpu_seconds": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "cpu_by_thread": threads.by_name(),
        "return": ret,
    }
    Path(spec["result"]).write_text(json.dumps(result))


class _ThreadCPU:
    """CPU seconds (user, system) of each thread of this process since it was created, sampled from
    /proc/self/task/<id>/stat (a thread that ends between two samples loses at most one interval),
    grouped by thread name without its number: MainThread, shardkit-hash-writes, ThreadPoolExecutor."""

    def __init__(self) -> None:
        self.start = {tid: v for tid, (_, *v) in self._read().items()}
        self.seen: dict[int, tuple[str, float, float]] = {}

    @staticmethod
    def _read() -> dict[int, tuple[str, float, float]]:
        import re
        import threading

        tick = os.sysconf("SC_CLK_TCK")
        found = {}
        for t in threading.enumerate():
            if t.native_id is None:
                continue
            try:
                fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = re.sub(r"[-_]\d+(_\d+)?$", "", t.name)
            found[t.native_id] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
        return found

    def sample(self) -> None:
        self.seen.update(self._read())

    def by_name(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for tid, (name, user, system) in self.seen.items():
            u0, s0 = self.start.get(tid, (0.0, 0.0))
            acc = out.setdefault(name, [0.0, 0.0])
            acc[0] += user - u0
            acc[1] += system - s0
        return {k: [round(u, 2), round(v, 2)] for k, (u, v) in out.items() if u + v >= 0.01}


def thread_cpu_line(m: Measurement | dict[str, list[float]] | None) -> str:
    """ "MainThread 2.63 s (sys 1.26), shardkit-hash-writes 1.40 s (sys 0.00), ..." by CPU, or "" (of a
    Measurement, or of its cpu_by_thread)."""
    by_thread = m.cpu_by_thread if isinstance(m, Measurement) else m
    if not by_thread:
        return ""
    items = sorted(by_thread.items(), key=lambda kv: -sum(kv[1]))
    return ", ".join(f"{name} {u + s:.2f} s (sys {s:.2f})" for name, (u, s) in items)


# ---- statistics and output -----------------------------------------------------------------------


def combine(samples: Sequence[Measurement], stat: str = "median") -> Measurement:
    """One Measurement from repeats: seconds by `stat` (median or best = min), memory by max
    (the worst peak seen), bytes from the first sample (they are identical)."""
    if len(samples) == 1:
        return samples[0]
    pick = min if stat == "best" else statistics.median
    first = samples[0]

    def mx(attr):
        vals = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return max(vals) if vals else None

    middle = sorted(samples, key=lambda s: s.seconds)[len(samples) // 2]
    return Measurement(
        op=first.op,
        seconds=pick([s.seconds for s in samples]),
        cpu_by_thread=middle.cpu_by_thread,
        process_seconds=pick([s.process_seconds for s in samples]),
        peak_rss=max(s.peak_rss for s in samples),
        base_rss=mx("base_rss"),
        peak_anon=mx("peak_anon"),
        peak_file=mx("peak_file"),
        cpu_seconds=pick([s.cpu_seconds for s in samples if s.cpu_seconds is not None])
        if first.cpu_seconds is not None
        else None,
        bytes_written=first.bytes_written,
        rss_method=first.rss_method,
        result=first.result,
        extra={
            "repeats": len(samples),
            "seconds_all": [s.seconds for s in samples],
            "peak_rss_all": [s.peak_rss for s in samples],
        },
    )


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def is_num(s: str) -> bool:
        return s.replace(".", "", 1).replace("x", "", 1).replace("%", "", 1).replace("-", "", 1).isdigit()

    lines = []
    for j, row in enumerate(cells):
        parts = [c.rjust(w) if j and is_num(c) else c.ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(parts).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}{suffix}"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def progress(msg: str) -> None:
    """Progress goes to stderr so that stdout holds only the table or the JSON."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected a comma-separated list of whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"expected positive whole numbers, got {text!r}")
    return values


# ---- verification (torch-free: raw bytes from safetensors headers) ------------------------------


def safetensors_catalog(directory: str | Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, absolute start, nbytes) over every *.safetensors file in a directory."""
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            out[name] = (f, info["dtype"], tuple(info["shape"]), 8 + n + start, stop - start)
    return out


def read_range(path: Path, start: int, nbytes: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(nbytes)


def _digest(path: Path, start: int, nbytes: int, block: int = 64 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(start)
        left = nbytes
        while left:
            data = fh.read(min(block, left))
            if not data:
                break
            h.update(data)
            left -= len(data)
    return h.hexdigest()


def compare_hf_dirs(a: str | Path, b: str | Path, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Compare two HF safetensors directories: the same tensor names, dtypes and shapes, and
    byte-identical data for `names` (every tensor when None)."""
    ca, cb = safetensors_catalog(a), safetensors_catalog(b)
    problems: list[str] = []
    structure_ok = set(ca) == set(cb)
    if set(ca) != set(cb):
        only_a, only_b = sorted(set(ca) - set(cb)), sorted(set(cb) - set(ca))
        problems.append(f"names differ: only in {a}: {only_a[:3]}; only in {b}: {only_b[:3]}")
    for name in sorted(set(ca) & set(cb)):
        if ca[name][1:3] != cb[name][1:3]:
            structure_ok = False
            problems.append(f"{name}: {ca[name][1:3]} vs {cb[name][1:3]}")
    checked = 0
    checked_bytes = 0
    for name in names if names is not None else sorted(ca):
        if name not in ca or name not in cb:
            continue
        fa, _, _, sa, na = ca[name]
        fb, _, _, sb, nb = cb[name]
        same = (
            read_range(fa, sa, na) == read_range(fb, sb, nb)
            if na <= 256 * 2**20
            else _digest(fa, sa, na) == _digest(fb, sb, nb)
        )
        if not same:
            problems.append(f"{name}: data differ")
        checked += 1
        checked_bytes += na
    return {
        "ok": not problems,
        "structure_ok": structure_ok,
        "tensors": len(ca),
        "compared": checked,
        "compared_bytes": checked_bytes,
        "problems": problems[:10],
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2])
    else:
        raise SystemExit("bench_common is a library; its only command is `--child SPEC.json` (used by the benchmarks)")
