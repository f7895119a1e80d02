"""The Hugging Face Hub: repo ids as sources, and pushing models (merging shards first).

`resolve_source` turns a Hub repo id into a local snapshot (huggingface_hub's cache), fetching
only what shardkit reads: the weights (safetensors preferred over .bin; with an index, only the
files it names), config and tokenizer files. A local path is returned unchanged.

`push` uploads a Hugging Face model directory to a Hub repo. A sharded source (shardkit or NxD
shards, a training checkpoint tag) is first merged, streaming, into a temporary staging
directory. A model card (README.md) is written when the directory has none. The upload is
huggingface_hub's `upload_folder` (large files through Xet or LFS, already-uploaded content is
skipped), retried a few times on network failures; when it still fails, the error says how to
resume.

Everything huggingface_hub honours applies: the cache (`HF_HOME`, `HF_HUB_CACHE`), the token
(`HF_TOKEN`, `hf auth login`), the endpoint (`HF_ENDPOINT`) and offline mode (`HF_HUB_OFFLINE`).
Hub failures become `HubError`s whose one-line messages say what to do. The token is never
logged, printed or put in a message.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from . import __version__
from .errors import FormatError, ShardkitError
from .formats import MANIFEST
from .formats import hf, nxd

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]

CONFIG_FILES = ("config.json", "generation_config.json")
"""Files every download takes besides the weights (tokenizer and chat files: hf.SIDE_FILES)."""

DEFAULT_RETRIES = 3
"""Upload attempts before `push` gives up (each attempt skips what the previous ones uploaded)."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")
_CACHE_REPO = re.compile(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]")


# ---- errors ------------------------------------------------------------------------------------


class HubError(ShardkitError):
    """A Hub operation failed; the message says what to do next."""


class HubAuthError(HubError):
    """No token, a rejected token, or a token without the needed (write) access."""


class HubRepoNotFoundError(HubError):
    """The repo does not exist, or the token cannot see it."""


class HubRevisionNotFoundError(HubError):
    """The repo has no such branch, tag or commit."""


class GatedRepoAccessError(HubError):
    """The repo is gated and this account has not been granted access."""


class HubOfflineError(HubError):
    """Offline mode (HF_HUB_OFFLINE) or no network, and the files are not in the cache."""


class HubUploadError(HubError):
    """The upload failed after its retries; the message says how to resume."""


# ---- small helpers -----------------------------------------------------------------------------


def looks_like_repo_id(text: str) -> bool:
    """`namespace/name` or a bare `name` as the Hub spells them (not a path: no ./, no backslash)."""
    return bool(_REPO_ID.match(text)) and ".." not in text and "--" not in text and not text.endswith(".")


def _endpoint(endpoint: str | None) -> str:
    from huggingface_hub import constants

    return (endpoint or constants.ENDPOINT).rstrip("/")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _one_line(message: str, token: str | None = None) -> str:
    """Messages are one line and never carry the token."""
    message = " ".join(str(message).split())
    if token:
        message = message.replace(token, "***")
    return message


def _chain(exc: BaseException | None) -> Iterable[BaseException]:
    """The exception, then its causes and contexts (huggingface_hub wraps upload errors)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _server_message(exc: BaseException) -> str:
    message = getattr(exc, "server_message", None) or ""
    return _one_line(message)[:200]


def _hub_cause(exc: BaseException) -> BaseException | None:
    """The first huggingface_hub / network error in the chain, or None."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    for e in _chain(exc):
        if isinstance(e, (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.TransportError)):
            return e
    return None


def _is_transient(exc: BaseException) -> bool:
    """Network failures and server-side (5xx, 408, 429) errors: worth another attempt."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return False
        if isinstance(e, HfHubHTTPError):
            status = _status(e)
            return status is None or status >= 500 or status in (408, 429)
        if isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)):
            return True
    return False


def _translate(exc: BaseException, *, repo_id: str, action: str, endpoint: str | None, revision: str | None = None,
               token: str | None = None, src: str | None = None) -> HubError | None:
    """A HubError for a huggingface_hub / network failure (None when it is something else)."""
    import httpx2
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cause = _hub_cause(exc)
    if cause is None:
        return None
    url = f"{_endpoint(endpoint)}/{repo_id}"
    has_token = bool(token) or _has_token()
    login = "set HF_TOKEN or run `hf auth login`"
    if isinstance(cause, GatedRepoError):
        who = "your account has not been granted access" if has_token else "you are not logged in"
        return GatedRepoAccessError(_one_line(
            f"{repo_id} is a gated repo and {who}: request access at {url}, then use a token of an account "
            f"that has it ({login})", token))
    if isinstance(cause, RevisionNotFoundError):
        return HubRevisionNotFoundError(_one_line(
            f"{repo_id} has no revision {revision or 'main'!r}: give an existing branch, tag or commit with --revision",
            token))
    if isinstance(cause, DisabledRepoError):
        return HubError(_one_line(f"{repo_id} has been disabled on the Hub ({url}): use another repo", token))
    if isinstance(cause, RepositoryNotFoundError):
        if action == "download":
            what = f"{src} is neither a local path nor a Hub repo" if src else f"the Hub has no repo {repo_id}"
            hint = "check the spelling" + ("" if has_token else f"; for a private repo, {login}")
            return HubRepoNotFoundError(_one_line(f"{what} you can access at {_endpoint(endpoint)}: {hint}", token))
        hint = "pass --create to create it" if action == "check" else "check the repo id"
        return HubRepoNotFoundError(_one_line(
            f"the Hub has no model repo {repo_id} (or your token cannot see it): {hint}", token))
    if isinstance(cause, (OfflineModeIsEnabled, LocalEntryNotFoundError)) and (
        _offline() or any(isinstance(e, OfflineModeIsEnabled) for e in _chain(exc))
    ):
        if action == "download":
            return HubOfflineError(_one_line(_offline_message(repo_id), token))
        return HubOfflineError("pushing needs the network but offline mode is on (HF_HUB_OFFLINE=1): unset it")
    if isinstance(cause, (LocalEntryNotFoundError, httpx2.TransportError)):
        where = f" and {repo_id} is not in the local cache" if action == "download" else ""
        return HubError(_one_line(
            f"cannot reach the Hub at {_endpoint(endpoint)}{where} ({type(cause).__name__}): check the network, "
            "proxy settings or HF_ENDPOINT, then retry", token))
    if isinstance(cause, HfHubHTTPError):
        status = _status(cause)
        detail = _server_message(cause)
        detail = f": {detail}" if detail else ""
        if status == 401:
            if has_token:
                return HubAuthError(_one_line(
                    f"the Hub rejected your token (401 Unauthorized{detail}): {login} with a valid token", token))
            return HubAuthError(_one_line(f"the Hub wants a token for {repo_id} (401 Unauthorized): {login}", token))
        if status == 403:
            if action in ("push", "check"):
                return HubAuthError(_one_line(
                    f"your token cannot write to {repo_id} (403 Forbidden{detail}): use a token with write access "
                    f"to it ({login})", token))
            return HubAuthError(_one_line(
                f"access to {repo_id} is denied (403 Forbidden{detail}): use a token that can read it ({login})",
                token))
        if status is not None and status >= 500:
            return HubError(_one_line(f"the Hub failed ({status}{detail}): try again later", token))
        return HubError(_one_line(f"the Hub refused the request ({status}{detail})", token))
    return None


def _offline_message(repo_id: str) -> str:
    return (f"{repo_id} is not a local path and not in the local Hugging Face cache, and offline mode is on "
            "(HF_HUB_OFFLINE=1): download the repo once online, or unset HF_HUB_OFFLINE")


def _has_token() -> bool:
    from huggingface_hub import get_token

    try:
        return bool(get_token())
    except Exception:  # an OIDC misconfiguration must not hide the real error
        return False


def _api(endpoint: str | None, token: str | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token, library_name="shardkit", library_version=__version__)


# ---- download ----------------------------------------------------------------------------------


def choose_files(files: Iterable[str], index: Mapping[str, Any] | None = None) -> list[str]:
    """The files of a repo listing that shardkit needs: weights, config, tokenizer.

    Safetensors are preferred over .bin. With an index (`model.safetensors.index.json`, passed
    as `index` once downloaded), only the files its weight_map names. A repo of shardkit shards
    (shardkit.json) gives its manifest and rank files. Raises FormatError when there are no
    weights."""
    files = list(files)
    top = {f for f in files if "/" not in f}
    extras = [f for f in (*CONFIG_FILES, *hf.SIDE_FILES) if f in top]
    if MANIFEST in top:
        shards = [f for f in files if f.startswith("model/")]
        return sorted({MANIFEST, *extras, *shards})
    weights: list[str] = []
    for index_name, single, suffix in (
        ("model.safetensors.index.json", "model.safetensors", ".safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", ".bin"),
    ):
        if index_name in top:
            if index is None:
                weights = [index_name]  # the caller downloads it and asks again with its content
            else:
                weights = [index_name, *sorted(set(index.get("weight_map", {}).values()))]
            break
        if single in top:
            weights = [single]
            break
        candidates = sorted(f for f in top if f.endswith(suffix))
        if candidates:
            preferred = [f for f in candidates if not f.startswith("consolidated")]
            weights = preferred or candidates
            break
    if not weights:
        raise FormatError("it holds no model weights (model*.safetensors or pytorch_model*.bin)")
    return sorted({*weights, *extras})


def resolve_source(src: str | Path, revision: str | None = None, token: str | None = None, *,
                   endpoint: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """A local checkpoint path for `src`: the path itself when it exists, else the Hub repo `src`
    downloaded into huggingface_hub's cache (weights, config and tokenizer files only).

    `revision` is a branch, tag or commit of the repo; `token`, `endpoint` and `cache_dir`
    default to huggingface_hub's settings (HF_TOKEN, HF_ENDPOINT, HF_HUB_CACHE). Offline
    (HF_HUB_OFFLINE=1) only the cache is used."""
    text = str(src)
    path = Path(text)
    if path.exists():
        if revision is not None:
            raise ShardkitError(f"--revision applies to Hub repo ids, but {text} is a local path: drop --revision")
        return path
    if not looks_like_repo_id(text):
        raise FormatError(f"{text} does not exist")
    repo_id = text
    try:
        return _download(repo_id, revision, token, endpoint, cache_dir)
    except HubError:
        raise
    except FormatError as e:
        raise FormatError(f"Hub repo {repo_id}: {e}") from None
    except Exception as e:
        error = _translate(e, repo_id=repo_id, action="download", endpoint=endpoint, revision=revision, token=token,
                           src=text)
        if error is None:
            raise
        raise error from None


def _download(repo_id: str, revision: str | None, token: str | None, endpoint: str | None,
              cache_dir: str | Path | None) -> Path:
    from huggingface_hub import get_cached_repo_tree, hf_hub_download, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    if _offline():
        try:
            listing = [f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)]
        except CachedRepoTreeNotFoundError:
            raise HubOfflineError(_offline_message(repo_id)) from None
    else:
        api = _api(endpoint, token)
        info = api.model_info(repo_id, revision=revision)
        siblings = getattr(info, "siblings", None)
        listing = ([s.rfilename for s in siblings] if siblings is not None
                   else api.list_repo_files(repo_id, revision=revision))
    wanted = choose_files(listing)
    index_names = [f for f in wanted if f.endswith(".index.json")]
    if index_names:
        index_path = hf_hub_download(repo_id, index_names[0], revision=revision, cache_dir=cache_dir, token=token,
                                     endpoint=endpoint)
        try:
            index = json.loads(Path(index_path).read_text())
        except ValueError:
            raise FormatError(f"{index_names[0]} is not valid JSON") from None
        wanted = choose_files(listing, index)
    log.info("fetching %d files of %s: %s", len(wanted), repo_id, ", ".join(wanted))
    folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token, endpoint=endpoint,
                               allow_patterns=[glob.escape(f) for f in wanted])
    return Path(folder)


# ---- push --------------------------------------------------------------------------------------


def check_repo(repo_id: str, *, private: bool = False, create: bool = False, token: str | None = None,
               endpoint: str | None = None, dry_run: bool = False) -> bool:
    """Make sure `repo_id` can be pushed to: a token exists, the repo exists or `create` is given
    (then it is created, with `private` visibility, unless `dry_run`). Returns True when the repo
    is missing (and was created, without `dry_run`)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except Exception:
        raise HubError(f"{repo_id!r} is not a valid Hub repo id: use namespace/name (letters, digits, - _ .)") from None
    if _offline():
        raise HubOfflineError("pushing needs the network but offline mode is on (HF_HUB_OFFLINE=1): unset it")
    token = token or _get_token()
    if not token:
        raise HubAuthError("pushing needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`")
    api = _api(endpoint, token)
    try:
        try:
            info = api.model_info(repo_id)
            if private and not getattr(info, "private", False):
                log.warning("%s exists and is public: --private only applies when the repo is created", repo_id)
            return False
        except GatedRepoError:
            return False  # it exists; write access shows at upload time
        except RepositoryNotFoundError:
            if not create:
                raise
        if dry_run:
            return True
        api.create_repo(repo_id, private=private, exist_ok=True)
        log.info("created %s repo %s", "private" if private else "public", repo_id)
        return True
    except HubError:
        raise
    except Exception as e:
        error = _translate(e, repo_id=repo_id, action="check", endpoint=endpoint, token=token)
        if error is None:
            raise
        raise error from None


def _get_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _is_hf_dir(path: Path) -> bool:
    return (path.is_dir() and hf.is_hf_dir(path) and not (path / MANIFEST).is_file()
            and nxd.find_rank_files(path) is None)


def _link_tree(src: Path, dst: Path) -> None:
    """`dst` mirrors the files of `src` as symlinks (copies where links are impossible)."""
    dst.mkdir(parents=True)
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = Path(root).relative_to(src)
        for name in files:
            if name.startswith("."):
                continue
            target = dst / rel / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.symlink(Path(root, name).absolute(), target)
            except OSError:
                shutil.copy2(Path(root, name), target)


def weight_stats(folder: Path) -> dict[str, Any]:
    """Tensor count, parameters, bytes and dtypes of an HF directory's weights (headers only)."""
    from .formats.safetensors_io import read_header

    tensors = params = nbytes = 0
    dtypes: set[str] = set()
    for file in hf.weight_files(Path(folder)):
        if file.suffix == ".safetensors":
            for name, entry in read_header(file).items():
                if name == "__metadata__":
                    continue
                tensors += 1
                params += math.prod(entry["shape"])
                nbytes += entry["data_offsets"][1] - entry["data_offsets"][0]
                dtypes.add(entry["dtype"])
        else:
            from .formats.torch_io import TorchFile

            reader = TorchFile(file)
            try:
                for name in reader.keys():
                    shape, dtype = reader.shape(name), reader.dtype(name)
                    tensors += 1
                    params += math.prod(shape)
                    nbytes += math.prod(shape) * dtype.itemsize
                    dtypes.add(str(dtype).replace("torch.", ""))
            finally:
                reader.close()
    return {"tensors": tensors, "parameters": params, "bytes": nbytes, "dtypes": sorted(dtypes)}


def _base_model(origin: Path | None, manifest: Mapping | None, config: Mapping | None) -> str | None:
    candidates = []
    if manifest and manifest.get("source"):
        candidates.append(str(manifest["source"]))
    if origin is not None:
        candidates.append(str(Path(origin).absolute()))
    for text in candidates:
        if m := _CACHE_REPO.search(text + "/"):
            return f"{m.group(1)}/{m.group(2)}"
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and "/" in name and not Path(name).exists() and looks_like_repo_id(name):
        return name
    return None


def _describe_origin(origin, config=None, hints=None) -> tuple[str, Mapping | None]:
    """How the weights were laid out before the merge (a path or an opened Checkpoint), and the
    shards' manifest if any."""
    from .formats import Checkpoint, open_checkpoint

    if origin is None:
        return "not known (pushed from a Hugging Face directory)", None
    ckpt = origin if isinstance(origin, Checkpoint) else None
    if ckpt is None:
        origin = Path(origin)
        if _is_hf_dir(origin) or origin.is_file():
            return "not sharded (a Hugging Face checkpoint)", None
        try:
            ckpt = open_checkpoint(origin, config, hints)
        except ShardkitError:
            return "sharded (layout not recorded)", None
    if ckpt.kind == "hf":
        return "not sharded (a Hugging Face checkpoint)", None
    fmt = {"torch": "NxD torch", "xser": "NxD xser", "safetensors": "safetensors"}.get(ckpt.format, ckpt.format)
    return f"{ckpt.layout.describe()} ({fmt} shards, {ckpt.family.name} family)", ckpt.manifest


def model_card(folder: Path, repo_id: str, *, origin=None, command: str | None = None,
               base_model: str | None = None, config: str | Path | Mapping | None = None,
               hints: Mapping | None = None) -> str:
    """README.md for a pushed model: base model, the layout it was trained in, the shardkit
    command that produced it, tensor count and size. `origin`: the checkpoint (path or opened
    Checkpoint) the directory was merged from."""
    from .formats import Checkpoint

    folder = Path(folder)
    stats = weight_stats(folder)
    layout, manifest = _describe_origin(origin, config, hints)
    origin_path = origin.root if isinstance(origin, Checkpoint) else (Path(origin) if origin is not None else None)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    base = base_model or _base_model(origin_path, manifest, cfg)
    architecture = ", ".join(cfg.get("architectures") or []) or cfg.get("model_type", "unknown")
    size = stats["bytes"]
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.2f} MiB"
    meta = ["---", "library_name: transformers"]
    if base:
        meta.append(f"base_model: {base}")
    meta += ["tags:", "- shardkit", "---", ""]
    rows = [
        ("Base model", f"[{base}](https://huggingface.co/{base})" if base else "not recorded"),
        ("Architecture", architecture),
        ("Trained in (layout)", layout),
        ("Tensors", f"{stats['tensors']:,}"),
        ("Parameters", f"{stats['parameters']:,}"),
        ("Size", f"{size_text} ({size:,} bytes), {', '.join(stats['dtypes']) or 'n/a'}"),
        ("Produced by", f"`{command}`" if command else f"shardkit {__version__}"),
    ]
    if manifest and manifest.get("command"):
        rows.append(("Shards written by", f"`{manifest['command']}`"))
    lines = meta + [f"# {repo_id.split('/')[-1]}", "",
                    f"Weights in Hugging Face format (safetensors), uploaded with shardkit {__version__}.", "",
                    "| | |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in rows]
    lines += ["", "```python", "from transformers import AutoModelForCausalLM", "",
              f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")', "```", ""]
    return "\n".join(lines)


def push(
    src: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    create: bool = False,
    token: str | None = None,
    progress: ProgressCallback | None = None,
    endpoint: str | None = None,
    config: str | Path | Mapping | None = None,
    hints: Mapping | None = None,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    workers: int = 1,
    origin: Any = None,
    command: str | None = None,
    base_model: str | None = None,
    tmp_dir: str | Path | None = None,
    retries: int = DEFAULT_RETRIES,
    retry_wait: float = 2.0,
) -> dict[str, Any]:
    """Upload `src` to the Hub model repo `repo_id` and return what was pushed.

    `src` is a Hugging Face directory (uploaded as it is) or anything `merge` reads (shards,
    NxD checkpoints, a training checkpoint tag, a state-dict file), merged first into a
    temporary directory (under `tmp_dir`) with `max_shard_size`/`dtype`/`workers`; `progress`
    follows the merge. A README.md model card is added when missing (`origin`: the checkpoint
    the directory was merged from, for the card; `command`: the command line to record).

    `revision` is the branch to commit to (created when missing); `create_pr` opens a pull
    request instead; `create` creates a missing repo (`private` decides its visibility).
    Network failures are retried `retries` times, each attempt skipping what earlier ones
    uploaded; then HubUploadError says how to resume."""
    from huggingface_hub import constants

    src = Path(src)
    if not src.exists():
        raise FormatError(f"{src} does not exist (push uploads a local directory)")
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise HubError("--create-pr opens a pull request against the default branch: drop --revision")
    merged = not _is_hf_dir(src)
    if merged and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ShardkitError("push merges in one process: run `shardkit merge` under torchrun, then push the merged "
                            "directory (or use `shardkit merge --push-to` there)")
    token = token or _get_token()
    check = dict(private=private, create=create, token=token, endpoint=endpoint)
    missing = check_repo(repo_id, dry_run=True, **check)  # fail fast, before any merging
    api = _api(endpoint, token)

    work = Path(tempfile.mkdtemp(prefix="shardkit-push-", dir=tmp_dir))
    keep = False
    try:
        folder = work / "model"
        if merged:
            from .convert import merge

            from .formats import open_checkpoint

            ckpt = open_checkpoint(src, config, hints)
            log.info("merging %s (%s) before the upload", src, ckpt.describe())
            merge(ckpt, folder, max_shard_size=max_shard_size, dtype=dtype, workers=workers, progress=progress)
            origin = origin or ckpt
        else:
            _link_tree(src, folder)
        card = not (folder / "README.md").exists()
        if card:
            command = command or f"shardkit.push({str(src)!r}, {repo_id!r})"
            (folder / "README.md").write_text(model_card(folder, repo_id, origin=origin, command=command,
                                                         base_model=base_model, config=config, hints=hints))
        if missing:
            check_repo(repo_id, **check)  # created only now that there is something to upload
        if revision and revision != constants.DEFAULT_REVISION and not create_pr:
            _call(lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), repo_id, endpoint, revision,
                  token)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        total = sum(p.stat().st_size for p in files)
        message = commit_message or (f"Upload {src.name} with shardkit" + (" (merged from shards)" if merged else ""))
        try:
            info = _upload(api, folder, repo_id, revision=revision, message=message, create_pr=create_pr,
                           retries=retries, retry_wait=retry_wait, endpoint=endpoint, token=token)
        except HubUploadError as e:
            if merged:
                keep = True
                resume = (f"the merged model is kept in {folder}; resume with: shardkit push {folder} {repo_id}"
                          + (f" --revision {revision}" if revision else "") + (" --create-pr" if create_pr else ""))
            else:
                resume = "re-run the same command to resume"
            raise HubUploadError(_one_line(f"{e} -- {resume} (files already uploaded are skipped)", token)) from None
        stats = weight_stats(folder)
        result = {
            "repo_id": repo_id,
            "url": f"{_endpoint(endpoint)}/{repo_id}",
            "revision": revision or constants.DEFAULT_REVISION,
            "commit": getattr(info, "oid", None),
            "commit_url": getattr(info, "commit_url", None),
            "pr_url": getattr(info, "pr_url", None),
            "merged": merged,
            "model_card": card,
            "files": len(files),
            "bytes": total,
            "tensors": stats["tensors"],
        }
        log.info("pushed %s to %s (%d files, %d bytes)", src, repo_id, len(files), total)
        return result
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _call(fn, repo_id, endpoint, revision, token):
    try:
        return fn()
    except Exception as e:
        error = _translate(e, repo_id=repo_id, action="push", endpoint=endpoint, revision=revision, token=token)
        if error is None:
            raise
        raise error from None


def _upload(api, folder: Path, repo_id: str, *, revision, message, create_pr, retries, retry_wait, endpoint, token):
    """upload_folder with bounded retries on network and server failures."""
    attempts = max(1, int(retries))
    for attempt in range(1, attempts + 1):
        try:
            return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, commit_message=message,
                                     create_pr=create_pr or None)
        except Exception as e:
            if not _is_transient(e):
                error = _translate(e, repo_id=repo_id, action="push", endpoint=endpoint, revision=revision,
                                   token=token)
                if error is None:
                    raise
                raise error from None
            reason = _one_line(f"{type(_hub_cause(e) or e).__name__}: {_hub_cause(e) or e}", token)[:300]
            if attempt == attempts:
                raise HubUploadError(f"upload to {repo_id} failed after {attempts} attempts ({reason})") from None
            wait = retry_wait * 2 ** (attempt - 1)
            log.warning("upload attempt %d of %d failed (%s); retrying in %.0f s", attempt, attempts, reason, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")
