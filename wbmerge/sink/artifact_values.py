"""Which artifact requests the sink accepts: names, digests, aliases and manifests, each
checked before anything of its request is written (as `values` does for runs).

A value that is not of the form W&B gives it is an `ArtifactError`, answered with 400 (or
the error's own status) for that request alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from . import values
from .names import check_alias, check_file_name

MANIFEST_HEADER = b"wandb-artifact-manifest-v1\n"
MAX_CLIENT_ID = 256
VERSION = re.compile(r"v(0|[1-9][0-9]{0,8})")  # `vN`, how a version is named


class ArtifactError(ValueError):
    """A request about artifacts that cannot be done; `status` is the HTTP status to send."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def md5_base64(data: bytes) -> str:
    """The MD5 of `data` in base64, as W&B's manifests give a file's digest."""
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def manifest_digest(entries: dict[str, str]) -> str:
    """The digest of a manifest from its {path: digest}, as wandb computes it (hex MD5)."""
    hasher = hashlib.md5(MANIFEST_HEADER, usedforsecurity=False)
    for path, digest in sorted(entries.items()):
        hasher.update(f"{path}:{digest}\n".encode())
    return hasher.hexdigest()


def md5_digest(value: object, what: str) -> str:
    """A file digest as W&B's manifests give it: the base64 of 16 bytes of MD5."""
    if isinstance(value, str) and len(value) == 24:
        try:
            if len(base64.b64decode(value, validate=True)) == 16:
                return value
        except binascii.Error:
            pass
    raise ArtifactError(f"{what} must be a base64 MD5 digest")


def check_aliases(value: object, name: str) -> list[str]:
    """CreateArtifact's aliases ([{alias, artifactCollectionName}]) of this artifact, without
    `latest` (always the newest version) and W&B's reserved `vN`."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 256:
        raise ArtifactError("aliases must be a list")
    aliases = set()
    for item in value:
        if not isinstance(item, dict):
            raise ArtifactError("an alias must be a JSON object")
        alias = check_alias(item.get("alias"))
        if item.get("artifactCollectionName") not in (None, name):
            raise ArtifactError("an alias must name the artifact it is given with")
        if VERSION.fullmatch(alias):
            raise ArtifactError(f"alias {alias!r} is reserved for version numbers")
        if alias != "latest":
            aliases.add(alias)
    return sorted(aliases)


def check_client_id(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.isascii() or not 0 < len(value) <= MAX_CLIENT_ID:
        raise ArtifactError(f"{what} must be a short ASCII string")
    return value


def manifest_entries(data: bytes) -> dict[str, tuple[str, int | None, str | None]]:
    """The {path: (digest, size, ref)} of a manifest file; ArtifactError unless it is a JSON
    object of W&B's manifest form (version 1, `contents` of entries with a digest)."""
    try:
        manifest = values.json_object(data.decode("utf-8"), "the manifest")
    except UnicodeDecodeError:
        raise ArtifactError("the manifest is not UTF-8 text") from None
    if manifest.get("version") != 1:
        raise ArtifactError("the manifest's version must be 1")
    contents = manifest.get("contents")
    if not isinstance(contents, dict):
        raise ArtifactError("the manifest's contents must be a JSON object")
    entries = {}
    for path, entry in contents.items():
        check_file_name(path)
        if not isinstance(entry, dict):
            raise ArtifactError(f"the manifest entry of {path!r} must be a JSON object")
        ref = entry.get("ref")
        if ref is not None and not isinstance(ref, str):
            raise ArtifactError(f"the ref of {path!r} must be a string")
        digest = entry.get("digest")
        if ref is None:
            md5_digest(digest, f"the digest of {path!r}")
        elif not isinstance(digest, str) or not digest:
            raise ArtifactError(f"the digest of {path!r} must be a string")
        size = entry.get("size")
        if size is not None and (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not 0 <= size <= values.MAX_OFFSET
        ):
            raise ArtifactError(f"the size of {path!r} must be a non-negative integer")
        entries[path] = (digest, size, ref)
    return entries
