"""Who may talk to the sink: loopback Host names only, and signed upload URLs for files.

The sink listens on 127.0.0.1 only, but a web page in the user's browser can still reach it
through DNS rebinding (a name of the attacker's that first resolves to their server, then to
127.0.0.1); such requests carry the attacker's name in their Host header, so every request
whose Host is not a loopback name is refused.

Files are uploaded by wandb-core with a plain `PUT` to the `uploadUrl` that `CreateRunFiles`
hands out. Measured with wandb 0.31: those PUTs carry no `Authorization` header (only Host,
User-Agent, Content-Length and Accept-Encoding), as on W&B's cloud the upload URLs are
pre-signed storage URLs. The sink does the same: each upload URL carries a token, an
HMAC-SHA256 of the run's entity, project, id and the file's name under a secret of this
data directory, and a PUT is accepted only with the token for exactly that file. The
secret is kept (readable by its owner only) in the data directory, so URLs handed out
before a restart of the sink still work when wandb-core retries an upload after it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
SECRET_FILE = "upload-secret"
SECRET_BYTES = 32


def is_loopback_host(host: str | None) -> bool:
    """True for a Host header naming this machine's loopback (any port, or none)."""
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # an IPv6 literal in brackets, then maybe ":port"
        end = name.find("]")
        if end < 0:
            return False
        name, rest = name[: end + 1], name[end + 1 :]
    else:
        name, colon, port = name.partition(":")
        rest = colon + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return False
    return name in LOOPBACK_HOSTS


class UploadTokens:
    """Signs and checks the tokens of upload URLs with this data directory's secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise ValueError("the upload secret is too short")
        self._secret = secret

    @classmethod
    def for_data_dir(cls, data_root: Path) -> UploadTokens:
        """The tokens of the secret kept in `data_root` (made there, mode 0600, if absent)."""
        path = data_root / SECRET_FILE
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            fresh = secrets.token_bytes(SECRET_BYTES)
            create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(path, create, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(fresh.hex().encode())
            return cls(fresh)
        except OSError as exc:  # a symlink planted there (ELOOP), or not readable
            raise ValueError(f"cannot read the upload secret {path}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as handle:
            text = handle.read().decode("ascii", "replace").strip()
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise ValueError(f"{path} does not hold an upload secret") from None

    def token(self, entity: str, project: str, run_id: str, file_name: str) -> str:
        message = json.dumps([entity, project, run_id, file_name]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check(
        self, token: str | None, entity: str, project: str, run_id: str, file_name: str
    ) -> bool:
        """True only for the token of exactly this file (compared in constant time)."""
        if not token or not token.isascii():
            return False
        return hmac.compare_digest(token, self.token(entity, project, run_id, file_name))
