"""Pushing to the Hub: a Hugging Face directory as it is, anything else merged first.

A sharded source (shardkit or NxD shards, a training checkpoint tag) is merged, streaming, into
a temporary staging directory; a model card is written when the directory has none; the upload
is huggingface_hub's `upload_folder` (large files through Xet or LFS, already-uploaded content
skipped), retried a few times on network failures; when it still fails, the error says how to
resume.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.tree import CHECKPOINT_MARKER
from ..engine import merge_checkpoint
from ..errors import FormatError, ShardkitError
from ..formats import Checkpoint, is_plain_hf_dir, open_checkpoint
from ..formats.hf import SIDE_FILES
from ..io.safety.durable import write_text
from ..io.safety.transaction import temporary_folder
from .card import model_card, weight_stats
from .errors import (
    HubAuthError,
    HubError,
    HubOfflineError,
    HubUploadError,
    _api,
    _endpoint,
    _hub_cause,
    _is_transient,
    _offline,
    _one_line,
    _translate,
)

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]

DEFAULT_RETRIES = 3
"""Upload attempts before `push` gives up (each attempt skips what the previous ones uploaded)."""


def check_repo(
    repo_id: str,
    *,
    private: bool = False,
    create: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    dry_run: bool = False,
) -> bool:
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


def _outside_links(src: Path) -> list[tuple[Path, str]]:
    """The symlinks under `src` (files the upload would publish, and folders) that lead outside it.

    A Hugging Face cache snapshot's links into its own repo's `blobs` folder are allowed."""
    real_src = os.path.realpath(src)
    allowed = [real_src]
    if Path(real_src).parent.name == "snapshots":
        allowed.append(str(Path(real_src).parent.parent / "blobs"))
    bad = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in [n for n in files if not n.startswith(".")] + dirs:
            path = Path(root, name)
            if not os.path.islink(path):
                continue
            real = os.path.realpath(path)
            if not any(real == a or real.startswith(a.rstrip(os.sep) + os.sep) for a in allowed):
                bad.append((path, real))
    return bad


def _check_links(src: Path) -> None:
    """Refuse to publish a folder with symlinks leading outside it (e.g. to ~/.ssh/id_rsa)."""
    bad = _outside_links(Path(src))
    if bad:
        path, real = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ShardkitError(
            f"{path} is a symlink to {real}, outside {src}{more}: refusing to publish it; "
            "replace the link with a copy of the file or remove it"
        )


def _link_tree(src: Path, dst: Path) -> None:
    """`dst` mirrors the files of `src` as symlinks (copies where links are impossible); symlinks
    in `src` that lead outside it are refused (ShardkitError), never followed."""
    _check_links(src)
    dst.mkdir(parents=True)
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = Path(root).relative_to(src)
        for name in files:
            if name.startswith("."):
                continue
            target = dst / rel / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(Path(root, name).absolute(), target)


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
    workers: int | str = "auto",
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
    src = Path(src)
    merged = _check_source(src, revision, create_pr)
    token = token or _get_token()
    check = functools.partial(check_repo, repo_id, private=private, create=create, token=token, endpoint=endpoint)
    missing = check(dry_run=True)  # fail fast, before any merging
    api = _api(endpoint, token)
    with temporary_folder(tmp_dir, "shardkit-push-") as work:
        folder = work.path / "model"
        merge_options = dict(max_shard_size=max_shard_size, dtype=dtype, workers=workers, progress=progress)
        if merged:
            origin = origin or _merge_into(src, folder, config, hints, **merge_options)
        else:
            _link_tree(src, folder)
        described = folder if merged else src  # not the links to src's files: read within the folder they are in
        card = not (folder / "README.md").exists()
        if card:
            command = command or f"shardkit.push({str(src)!r}, {repo_id!r})"
            card_text = model_card(
                described, repo_id, origin=origin, command=command, base_model=base_model, config=config, hints=hints
            )
            write_text(folder / "README.md", card_text, fsync=False)
        if missing:
            check()  # created only now that there is something to upload
        _ensure_branch(api, repo_id, revision, create_pr, endpoint, token)
        message = commit_message or (f"Upload {src.name} with shardkit" + (" (merged from shards)" if merged else ""))
        upload = functools.partial(
            _upload, api, folder, repo_id, revision=revision, message=message, create_pr=create_pr
        )
        try:
            info = upload(retries=retries, retry_wait=retry_wait, endpoint=endpoint, token=token)
        except HubUploadError as e:
            work.keep = merged  # a merged copy is worth keeping: the next push resumes from it
            hint = _resume_hint(folder, repo_id, merged, revision, create_pr)
            raise HubUploadError(_one_line(f"{e} -- {hint} (files already uploaded are skipped)", token)) from None
        return _pushed(folder, described, src, repo_id, info, endpoint, revision, merged, card)


def _ensure_branch(api: Any, repo_id: str, revision: str | None, create_pr: bool, endpoint, token) -> None:
    """The branch a push commits to exists (created when missing; not for pull requests)."""
    from huggingface_hub import constants

    if revision and revision != constants.DEFAULT_REVISION and not create_pr:
        _call(lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), repo_id, endpoint, revision, token)


def _check_source(src: Path, revision: str | None, create_pr: bool) -> bool:
    """Whether `src` must be merged first; refuses what cannot be pushed, before any Hub call."""
    from huggingface_hub import constants

    if not src.exists():
        raise FormatError(f"{src} does not exist (push uploads a local directory)")
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise HubError("--create-pr opens a pull request against the default branch: drop --revision")
    merged = not is_plain_hf_dir(src)
    if merged and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ShardkitError(
            "push merges in one process: run `shardkit merge` under torchrun, then push the merged "
            "directory (or use `shardkit merge --push-to` there)"
        )
    # shards carry side files (tokenizer, generation config) into the merged folder: a link of
    # theirs leading outside would publish what it points at, as a plain folder's would
    _check_links(src)
    if merged and (src / CHECKPOINT_MARKER).is_file():  # a training checkpoint tag: side files may sit beside it
        _check_side_links(src.parent)
    return merged


def _check_side_links(folder: Path) -> None:
    """Refuse side files (tokenizer, generation config) in `folder` that are links leading outside it."""
    real = os.path.realpath(folder)
    for name in SIDE_FILES:
        path = folder / name
        if os.path.islink(path):
            target = os.path.realpath(path)
            if not target.startswith(real.rstrip(os.sep) + os.sep):
                raise ShardkitError(
                    f"{path} is a symlink to {target}, outside {folder}: refusing to publish it; "
                    "replace the link with a copy of the file or remove it"
                )


def _merge_into(src: Path, folder: Path, config, hints, **options: Any) -> Checkpoint:
    """Merge a sharded `src` into `folder` (streaming); returns the opened source for the card."""
    ckpt = open_checkpoint(src, config, hints)
    log.info("merging %s (%s) before the upload", src, ckpt.describe())
    merge_checkpoint(ckpt, folder, **options)
    return ckpt


def _resume_hint(folder: Path, repo_id: str, merged: bool, revision: str | None, create_pr: bool) -> str:
    if not merged:
        return "re-run the same command to resume"
    return (
        f"the merged model is kept in {folder}; resume with: shardkit push {folder} {repo_id}"
        + (f" --revision {revision}" if revision else "")
        + (" --create-pr" if create_pr else "")
    )


def _pushed(
    folder: Path,
    described: Path,
    src: Path,
    repo_id: str,
    info: Any,
    endpoint: str | None,
    revision: str | None,
    merged: bool,
    card: bool,
) -> dict[str, Any]:
    """What `push` returns: where it went and what was uploaded (`described`: the folder holding
    the uploaded weights, read for their tensor count)."""
    from huggingface_hub import constants

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    log.info("pushed %s to %s (%d files, %d bytes)", src, repo_id, len(files), total)
    return {
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
        "tensors": weight_stats(described)["tensors"],
    }


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
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                revision=revision,
                commit_message=message,
                create_pr=create_pr or None,
            )
        except Exception as e:
            if not _is_transient(e):
                error = _translate(e, repo_id=repo_id, action="push", endpoint=endpoint, revision=revision, token=token)
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
