"""Hub failures as `HubError`s whose one-line messages say what to do next (the token is never
put in a message), and the small helpers every Hub call shares."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..errors import ShardkitError
from ..version import __version__

log = logging.getLogger(__name__)


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


def _http_error(cause: Any, *, repo_id: str, action: str, token: str | None, has_token: bool, login: str) -> HubError:
    """The HubError of an HTTP status the Hub answered with."""
    status = _status(cause)
    detail = _server_message(cause)
    detail = f": {detail}" if detail else ""
    if status == 401:
        if has_token:
            return HubAuthError(
                _one_line(f"the Hub rejected your token (401 Unauthorized{detail}): {login} with a valid token", token)
            )
        return HubAuthError(_one_line(f"the Hub wants a token for {repo_id} (401 Unauthorized): {login}", token))
    if status == 403:
        if action in ("push", "check"):
            return HubAuthError(
                _one_line(
                    f"your token cannot write to {repo_id} (403 Forbidden{detail}): use a token with write access "
                    f"to it ({login})",
                    token,
                )
            )
        return HubAuthError(
            _one_line(
                f"access to {repo_id} is denied (403 Forbidden{detail}): use a token that can read it ({login})", token
            )
        )
    if status is not None and status >= 500:
        return HubError(_one_line(f"the Hub failed ({status}{detail}): try again later", token))
    return HubError(_one_line(f"the Hub refused the request ({status}{detail})", token))


def _translate(
    exc: BaseException,
    *,
    repo_id: str,
    action: str,
    endpoint: str | None,
    revision: str | None = None,
    token: str | None = None,
    src: str | None = None,
) -> HubError | None:
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
        return GatedRepoAccessError(
            _one_line(
                f"{repo_id} is a gated repo and {who}: request access at {url}, then use a token of an account "
                f"that has it ({login})",
                token,
            )
        )
    if isinstance(cause, RevisionNotFoundError):
        return HubRevisionNotFoundError(
            _one_line(
                f"{repo_id} has no revision {revision or 'main'!r}: give an existing branch, tag or commit with --revision",
                token,
            )
        )
    if isinstance(cause, DisabledRepoError):
        return HubError(_one_line(f"{repo_id} has been disabled on the Hub ({url}): use another repo", token))
    if isinstance(cause, RepositoryNotFoundError):
        if action == "download":
            what = f"{src} is neither a local path nor a Hub repo" if src else f"the Hub has no repo {repo_id}"
            hint = "check the spelling" + ("" if has_token else f"; for a private repo, {login}")
            return HubRepoNotFoundError(_one_line(f"{what} you can access at {_endpoint(endpoint)}: {hint}", token))
        hint = "pass --create to create it" if action == "check" else "check the repo id"
        return HubRepoNotFoundError(
            _one_line(f"the Hub has no model repo {repo_id} (or your token cannot see it): {hint}", token)
        )
    if isinstance(cause, (OfflineModeIsEnabled, LocalEntryNotFoundError)) and (
        _offline() or any(isinstance(e, OfflineModeIsEnabled) for e in _chain(exc))
    ):
        if action == "download":
            return HubOfflineError(_one_line(_offline_message(repo_id), token))
        return HubOfflineError("pushing needs the network but offline mode is on (HF_HUB_OFFLINE=1): unset it")
    if isinstance(cause, (LocalEntryNotFoundError, httpx2.TransportError)):
        where = f" and {repo_id} is not in the local cache" if action == "download" else ""
        return HubError(
            _one_line(
                f"cannot reach the Hub at {_endpoint(endpoint)}{where} ({type(cause).__name__}): check the network, "
                "proxy settings or HF_ENDPOINT, then retry",
                token,
            )
        )
    if isinstance(cause, HfHubHTTPError):
        return _http_error(cause, repo_id=repo_id, action=action, token=token, has_token=has_token, login=login)
    return None


def _offline_message(repo_id: str) -> str:
    return (
        f"{repo_id} is not a local path and not in the local Hugging Face cache, and offline mode is on "
        "(HF_HUB_OFFLINE=1): download the repo once online, or unset HF_HUB_OFFLINE"
    )


def _has_token() -> bool:
    from huggingface_hub import get_token

    try:
        return bool(get_token())
    except Exception:  # an OIDC misconfiguration must not hide the real error
        return False


def _api(endpoint: str | None, token: str | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token, library_name="shardkit", library_version=__version__)
