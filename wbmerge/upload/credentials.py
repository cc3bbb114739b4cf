"""Credentials for the upload: the server's URL and an API key, and wandb's own uploader."""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from ..errors import WbmergeError

DEFAULT_BASE_URL = "https://api.wandb.ai"


@dataclass(frozen=True)
class Credentials:
    base_url: str
    api_key: str


def find_credentials(env: Mapping[str, str] | None = None) -> Credentials:
    """WANDB_BASE_URL (default api.wandb.ai) and a key from WANDB_API_KEY or ~/.netrc."""
    env = os.environ if env is None else env
    base_url = (env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    key = env.get("WANDB_API_KEY")
    if not key:
        host = urlparse(base_url).hostname or ""
        try:
            entry = netrc.netrc(env.get("NETRC") or None).authenticators(host)
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            entry = None
        key = entry[2] if entry else None
    if not key:
        raise WbmergeError(
            f"no W&B credentials for {base_url}: set WANDB_API_KEY or run `wandb login` "
            "(for the local sink: the WANDB_BASE_URL and WANDB_API_KEY `wbmerge sink serve` prints)"
        )
    return Credentials(base_url, key)
