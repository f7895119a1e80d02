"""The Hugging Face Hub: repo ids as sources (download) and pushing models (merge, model card,
upload). Called by `shardkit.api`, never by the engine."""

from .card import model_card, weight_stats
from .download import CONFIG_FILES, choose_files, looks_like_repo_id, resolve_source
from .errors import (
    GatedRepoAccessError,
    HubAuthError,
    HubError,
    HubOfflineError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    HubUploadError,
)
from .push import DEFAULT_RETRIES, check_repo, push

__all__ = [
    "CONFIG_FILES",
    "DEFAULT_RETRIES",
    "GatedRepoAccessError",
    "HubAuthError",
    "HubError",
    "HubOfflineError",
    "HubRepoNotFoundError",
    "HubRevisionNotFoundError",
    "HubUploadError",
    "check_repo",
    "choose_files",
    "looks_like_repo_id",
    "model_card",
    "push",
    "resolve_source",
    "weight_stats",
]
