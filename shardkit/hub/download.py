"""Hub repo ids as sources: fetch only what shardkit reads into huggingface_hub's cache.

`resolve_source` returns a local path for a local path, and for a Hub repo id (`org/name`)
downloads the weights (safetensors preferred over .bin; with an index, only the files it names),
config and tokenizer files. Everything huggingface_hub honours applies: the cache (`HF_HOME`,
`HF_HUB_CACHE`), the token (`HF_TOKEN`), the endpoint (`HF_ENDPOINT`) and offline mode
(`HF_HUB_OFFLINE`).
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import FormatError, ShardkitError
from ..formats import MANIFEST, hf
from ..io.safety.small import read_json
from .errors import HubError, HubOfflineError, _api, _offline, _offline_message, _translate

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "generation_config.json")
"""Files every download takes besides the weights (tokenizer and chat files: hf.SIDE_FILES)."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def looks_like_repo_id(text: str) -> bool:
    """`namespace/name` as the Hub spells them. Anything that looks like a path (`./x`, `../x`,
    `/x`, `~/x`, a bare name, a backslash) is not: a missing local path is never looked up."""
    return bool(_REPO_ID.match(text)) and ".." not in text and "--" not in text and not text.endswith(".")


def missing_local_path(text: str) -> str | None:
    """The one-line error for `text`, a path that does not exist, when it is meant as a local path
    rather than a Hub repo id: it looks like a path (`looks_like_repo_id`), or its first part is a
    folder here (`runs/llama70b-tp16pp2` beside `runs/`). None when it may be a Hub repo id."""
    if not looks_like_repo_id(text):
        return f"{text} does not exist"
    parent = os.path.dirname(text)
    if os.path.lexists(parent):
        return f"{text} does not exist ({parent}/ is a local folder, so it is not looked up as a Hub repo id)"
    return None


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


def resolve_source(
    src: str | Path,
    revision: str | None = None,
    token: str | None = None,
    *,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
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
    missing = missing_local_path(text)
    if missing is not None:
        raise FormatError(missing)
    repo_id = text
    try:
        return _download(repo_id, revision, token, endpoint, cache_dir)
    except HubError:
        raise
    except FormatError as e:
        raise FormatError(f"Hub repo {repo_id}: {e}") from None
    except Exception as e:
        error = _translate(
            e, repo_id=repo_id, action="download", endpoint=endpoint, revision=revision, token=token, src=text
        )
        if error is None:
            raise
        raise error from None


def _download(
    repo_id: str, revision: str | None, token: str | None, endpoint: str | None, cache_dir: str | Path | None
) -> Path:
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
        listing = (
            [s.rfilename for s in siblings] if siblings is not None else api.list_repo_files(repo_id, revision=revision)
        )
    wanted = choose_files(listing)
    index_names = [f for f in wanted if f.endswith(".index.json")]
    if index_names:
        index_path = hf_hub_download(
            repo_id, index_names[0], revision=revision, cache_dir=cache_dir, token=token, endpoint=endpoint
        )
        index = read_json(index_path, index_names[0])
        wanted = choose_files(listing, index)
    log.info("fetching %d files of %s: %s", len(wanted), repo_id, ", ".join(wanted))
    folder = snapshot_download(
        repo_id,
        revision=revision,
        cache_dir=cache_dir,
        token=token,
        endpoint=endpoint,
        allow_patterns=[glob.escape(f) for f in wanted],
    )
    return Path(folder)
