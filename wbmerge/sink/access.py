"""Who may talk to the sink: loopback Host names, the sink's own API key, signed upload URLs.

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

Every other request needs the sink's API key, as HTTP basic auth `api:<key>` (how wandb
sends its key, and what a browser asks for). The key is made on the sink's first start,
40 hex characters as wandb requires of a key, and kept in the data directory (`api-key`,
mode 0600), so that only the user who can read the data directory can read or write runs;
other users of a shared machine reach the same 127.0.0.1 port, so a key of any form would
let them in. A key or secret file is read only when it is this user's own regular file,
with one name, unreadable by others: a data directory others could once write may hold one
another user planted, whose bytes they know.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
SECRET_FILE = "upload-secret"
SECRET_BYTES = 32
API_KEY_FILE = "api-key"
API_KEY_BYTES = 20  # 40 hex characters: the length wandb requires of a key
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


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
        try:
            fd = open_private(path, "the upload secret")
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

    def artifact_token(self, artifact: int, path: str | None) -> str:
        """The token of a file of an artifact version (`path`), or of its manifest (None);
        a message of three parts, so that it never equals a run file's."""
        message = json.dumps(["artifact", artifact, path]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check_artifact(self, token: str | None, artifact: int, path: str | None) -> bool:
        if not token or not token.isascii():
            return False
        return hmac.compare_digest(token, self.artifact_token(artifact, path))

    def read_token(self, artifact: int, path: str | None, expires: int) -> str:
        """The token of a download URL of an artifact file (or manifest, None) until
        `expires` (seconds since the epoch): wandb fetches these without the API key, as
        W&B's pre-signed URLs. Its message differs from an upload token's, so a URL to read
        a file never lets anyone write it."""
        message = json.dumps(["artifact-read", artifact, path, expires]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check_read(
        self, token: str | None, artifact: int, path: str | None, expires: str | None, now: float
    ) -> bool:
        if not token or not token.isascii() or not expires or not expires.isdigit():
            return False
        if len(expires) > 12 or int(expires) < now:
            return False
        return hmac.compare_digest(token, self.read_token(artifact, path, int(expires)))


class ApiKey:
    """The sink's own API key, kept in its data directory; checks the key of a request."""

    def __init__(self, key: str) -> None:
        self.key = key

    @classmethod
    def for_data_dir(cls, data_root: Path) -> ApiKey:
        """The key kept in `data_root` (made there, mode 0600, if absent)."""
        path = data_root / API_KEY_FILE
        if not os.path.lexists(path):
            fresh = secrets.token_hex(API_KEY_BYTES)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
            except FileExistsError:  # another sink made it just now: read theirs
                return cls(read_api_key(data_root))
            with os.fdopen(fd, "w") as out:
                out.write(fresh + "\n")
            return cls(fresh)
        return cls(read_api_key(data_root))

    def accepts(self, authorization: str | None) -> bool:
        """True only for HTTP basic auth that carries this key (compared in constant time)."""
        key = basic_auth_key(authorization)
        return key is not None and hmac.compare_digest(key.encode(), self.key.encode())


def read_api_key(data_root: str | Path) -> str:
    """The key of the sink whose data directory is `data_root`; ValueError if there is none."""
    path = Path(data_root) / API_KEY_FILE
    try:
        fd = open_private(path, "the sink's API key")
    except OSError as exc:  # absent, a planted symlink (ELOOP), or not readable
        raise ValueError(f"cannot read the sink's API key {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        key = handle.read(1024).decode("ascii", "replace").strip()
    if len(key) != 2 * API_KEY_BYTES or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"{path} does not hold a sink API key (40 hex characters)")
    return key


def open_private(path: Path, what: str) -> int:
    """A descriptor of the file `path` (never a link), read only if it is this user's own
    regular file, with no other name, that nobody else may read; a ValueError naming it
    otherwise. A data directory others could once write may hold a key another user
    planted (and so knows): taking it as this sink's own would let them in."""
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.getuid():
        problem = f"belongs to another user (uid {info.st_uid})"
    elif info.st_nlink != 1:
        problem = "has another name (a hard link)"
    elif info.st_mode & 0o077:
        problem = f"may be read by other users (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is None:
        return fd
    os.close(fd)
    raise ValueError(f"{what} {path} {problem}; not used: remove it to make a new one")


def basic_auth_key(authorization: str | None) -> str | None:
    """The password of an HTTP basic `Authorization` header (wandb's `api:<key>`), or None."""
    if not authorization or not authorization.startswith("Basic "):
        return None
    try:
        decoded = base64.b64decode(authorization[6:], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    user, colon, key = decoded.partition(":")
    return key if colon else None


def make_private_dir(path: Path) -> None:
    """Create `path` (mode 0700) or make it private: ValueError if another user owns it.

    A data directory others can list or read would show them the database, the key and
    every run file, so an existing one is made 0700 (its owner may; nobody else should
    own the sink's data)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)


def refuse_foreign(path: Path) -> None:
    """ValueError if `path` exists and is not this user's own, or is a file with a second
    name: another user who put the database or the files folder in a data directory they
    could once write would read every run stored there (through a name of theirs)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to another user (uid {info.st_uid}); not used")
    if stat.S_ISREG(info.st_mode) and info.st_nlink != 1:
        raise ValueError(f"{path} has another name (a hard link); not used")


def write_replacing(path: Path, data: bytes) -> None:
    """Put `data` at `path` whole or not at all: into a fresh temporary file beside it
    (created exclusively, so a planted symlink is never written through) that then
    replaces the path."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_private_file(path: Path) -> None:
    """Make an existing file of the data directory readable by its owner only."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077 and info.st_uid == os.getuid():
        os.chmod(path, 0o600)
