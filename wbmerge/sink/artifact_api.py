"""The GraphQL operations of artifacts: what wandb-core 0.31 sends to save one (with exactly
the fields it reads), the public API's queries of a run's logged and used versions, and
one query to read a version back with its files.

Upload URLs carry a token like those of run files (`access.UploadTokens`): wandb-core
PUTs artifact files and manifests without the API key. A request of the wrong shape is
an `ArtifactError` (a `ValueError`), answered 400 (or its own status) for it alone.
"""

from __future__ import annotations

import json
import mimetypes
import time
import urllib.parse
from typing import Any

from .artifact_values import ArtifactError, md5_digest
from .artifactstore import parse_id, server_id
from .names import DEFAULT_ENTITY, check_entity, check_file_name, check_project, check_run_path
from .store import Store

MAX_FILES_PER_REQUEST = 10_000  # wandb-core asks for at most 10000 upload URLs at once
MAX_PAGE = 1000
READ_URL_SECONDS = 3600  # how long a download URL reads without the key, as W&B's do


def _input(v: dict[str, Any]) -> dict[str, Any]:
    spec = v.get("input")
    if not isinstance(spec, dict):
        raise ArtifactError("input must be a JSON object")
    return spec


def _run_path(entity: object, project: object, run: object) -> tuple[str, str, str]:
    return check_run_path(entity or DEFAULT_ENTITY, project or "uncategorized", run)


def create_artifact(store: Store, v: dict[str, Any], base_url: str) -> dict:
    spec = _input(v)
    entity, project, run = _run_path(
        spec.get("entityName"), spec.get("projectName"), spec.get("runName")
    )
    made = store.artifacts.create(entity, project, run, spec)
    latest = None if made["latest"] is None else {"id": server_id("Artifact", made["latest"])}
    return {
        "createArtifact": {
            "artifact": {
                "id": server_id("Artifact", made["id"]),
                "state": made["state"],
                "artifactSequence": {"latestArtifact": latest},
            }
        }
    }


def _manifest_answer(artifact: int, v: dict[str, Any], base_url: str, store: Store) -> dict:
    """The manifest of a version (one per version: its id is the version's number) and,
    when wandb-core asks for it, the URL to PUT the manifest file to; `digest` is then the
    MD5 (base64) the manifest file must arrive with."""
    manifest: dict[str, Any] = {"id": server_id("ArtifactManifest", artifact), "file": {}}
    if v.get("includeUpload"):
        store.artifacts.declare_manifest(artifact, md5_digest(v.get("digest"), "digest"))
        token = store.upload_tokens.artifact_token(artifact, None)
        manifest["file"] = {
            "id": server_id("File", artifact),  # (read, never used, by wandb-core)
            "uploadUrl": f"{base_url}/artifact-storage/{artifact}/manifest?token={token}",
            "uploadHeaders": [],
        }
    return manifest


def create_artifact_manifest(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """A version's one FULL manifest. Distributed artifacts (several runs' PATCH manifests,
    merged by the server, and UpdateArtifactManifest) are not supported: refused, never
    stored half-understood."""
    if v.get("manifestType", "FULL") != "FULL":
        raise ArtifactError("only FULL manifests are supported by this sink (no patches)")
    artifact = parse_id("Artifact", v.get("artifactID"))
    answer = _manifest_answer(artifact, v, base_url, store)
    return {"createArtifactManifest": {"artifactManifest": answer}}


def create_artifact_files(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """An upload URL for each file, after noting the MD5 it must arrive with."""
    files = _input(v).get("artifactFiles")
    if not isinstance(files, list) or len(files) > MAX_FILES_PER_REQUEST:
        raise ArtifactError(f"artifactFiles must be a list of at most {MAX_FILES_PER_REQUEST}")
    specs = []
    for item in files:
        if not isinstance(item, dict):
            raise ArtifactError("each of artifactFiles must be a JSON object")
        artifact = parse_id("Artifact", item.get("artifactID"))
        path = check_file_name(item.get("name"))
        specs.append((artifact, path, md5_digest(item.get("md5"), f"the md5 of {path!r}")))
    store.artifacts.declare_files(specs)
    edges = []
    for artifact, path, _ in specs:
        token = store.upload_tokens.artifact_token(artifact, path)
        url = f"{base_url}/artifact-storage/{artifact}/files/{urllib.parse.quote(path)}"
        node = {
            "storagePath": None,
            "uploadUrl": f"{url}?token={token}",
            "uploadHeaders": [],
            "uploadMultipartUrls": None,  # (multipart uploads, from 2 GiB on, are not supported)
            "artifact": {"id": server_id("Artifact", artifact)},
        }
        edges.append({"node": node})
    return {"createArtifactFiles": {"files": {"edges": edges}}}


def commit_artifact(store: Store, v: dict[str, Any], base_url: str) -> dict:
    artifact = parse_id("Artifact", v.get("artifactID"))
    store.artifacts.commit(artifact)
    digest = store.artifacts.version(artifact)["digest"]
    return {
        "commitArtifact": {"artifact": {"id": server_id("Artifact", artifact), "digest": digest}}
    }


def use_artifact(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """A run used a version: from wandb-core (an `input` object) or from the public API's
    `run.use_artifact` (the same fields as variables of their own)."""
    spec = _input(v) if "input" in v else v
    entity, project, run = _run_path(
        spec.get("entityName"), spec.get("projectName"), spec.get("runName")
    )
    artifact = parse_id("Artifact", spec.get("artifactID"))
    store.artifacts.use(entity, project, run, artifact)
    facts = store.artifacts.version(artifact)
    return {
        "useArtifact": {
            "artifact": {
                "id": server_id("Artifact", artifact),
                "digest": facts["digest"],
                "description": facts["description"],
                "state": facts["state"],
                "createdAt": facts["created"],
                "metadata": json.dumps(facts["metadata"]),
            }
        }
    }


def client_id_mapping(store: Store, v: dict[str, Any], base_url: str) -> dict:
    client_id = v.get("clientID")
    if not isinstance(client_id, str):
        raise ArtifactError("clientID must be a string")
    found = store.artifacts.server_id_of(client_id)
    return {"clientIDMapping": None if found is None else {"serverID": found}}


def _named_version(store: Store, v: dict[str, Any]) -> Any:
    """The version the variables name (`entity`, `project`, `name` as `name:alias`,
    `name:vN` or `name`), None when there is none; names checked as W&B checks them."""
    entity = check_entity(v.get("entity") or DEFAULT_ENTITY)
    project = check_project(v.get("project"))
    name = v.get("name")
    if not isinstance(name, str):
        raise ArtifactError("name must be a string (name:alias or name:vN)")
    return store.artifacts.find(entity, project, name)


def artifact_version_files(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """A version named `name:alias`, `name:vN` (or by `id`), as W&B's schema has it
    (`project.artifact(name)`): digest, state, version, aliases, metadata and a page of its
    files (`first` after the cursor `after`), each with its size and the MD5 of the bytes
    stored, read again from the disk."""
    found = _named_version(store, v)
    if found is None:
        return {"project": {"artifact": None}}
    after, first = v.get("after"), v.get("first")
    start = int(after) + 1 if isinstance(after, str) and after.isdigit() and len(after) < 10 else 0
    first = first if isinstance(first, int) and 0 < first <= MAX_PAGE else MAX_PAGE
    facts = store.artifacts.version(found, files=True, window=(start, first))
    page = facts["files"]
    edges = [
        {
            "node": {
                "name": f["name"],
                "sizeBytes": f["size"],
                "md5": f["md5"],
                "digest": f["digest"],
                "ref": f["ref"],
                "directUrl": f"{base_url}/artifact-storage/{found}/files/"
                + urllib.parse.quote(f["name"]),
            },
            "cursor": str(start + i),
        }
        for i, f in enumerate(page)
    ]
    info = {
        "endCursor": edges[-1]["cursor"] if edges else None,
        "hasNextPage": start + first < facts["file_count"],
    }
    version = facts["version"]
    artifact = {
        "id": facts["id"],
        "digest": facts["digest"],
        "state": facts["state"],
        "versionIndex": None if version is None else int(version[1:]),
        "aliases": [{"alias": alias} for alias in facts["aliases"]],
        "metadata": json.dumps(facts["metadata"]),
        "description": facts["description"],
        "artifactType": {"name": facts["type"]},
        "artifactSequence": {"name": facts["name"]},
        "fileCount": facts["file_count"],
        "files": {"edges": edges, "pageInfo": info},
    }
    return {"project": {"artifact": artifact}}


def _artifact_fragment(facts: dict[str, Any]) -> dict[str, Any]:
    """A version as the public API's `ArtifactFragment` has it (every field it reads)."""
    project = {
        "id": server_id("Project", 0),
        "internalId": server_id("Project", 0),
        "name": facts["project"],
        "entity": {"name": facts["entity"]},
    }
    collection = {"__typename": "ArtifactSequence", "name": facts["name"], "project": project}
    version = facts["version"]
    return {
        "__typename": "Artifact",
        "id": facts["id"],
        "artifactSequence": collection,
        "versionIndex": None if version is None else int(version[1:]),
        "artifactType": {"name": facts["type"]},
        "description": facts["description"],
        "metadata": json.dumps(facts["metadata"]),
        "ttlDurationSeconds": -1,  # (no time to live: kept until deleted)
        "ttlIsInherited": True,
        "tags": [],
        "historyStep": None,
        "state": facts["state"],
        "size": facts["size"],
        "digest": facts["digest"],
        "digestAlgorithm": "MANIFEST_MD5",
        "commitHash": None,
        "fileCount": facts["file_count"],
        "createdAt": facts["created"],
        "updatedAt": facts["committed"],
        "aliases": [
            {
                "__typename": "ArtifactAlias",
                "id": f"{facts['collection_id']}:{alias}",
                "alias": alias,
                "artifactCollection": collection,
            }
            for alias in facts["aliases"]
        ],
    }


def _run_artifacts(role: str) -> Any:
    """The public API's `RunOutputArtifacts` (role "logged", `run.logged_artifacts()`) or
    `RunInputArtifacts` ("used", `run.used_artifacts()`): a page of `perPage` versions
    after the cursor (the index of the last one sent)."""

    def answer(store: Store, v: dict[str, Any], base_url: str) -> dict:
        entity, project, run = _run_path(v.get("entity"), v.get("project"), v.get("run"))
        if store.run(entity, project, run) is None:
            return {"project": {"run": None}}
        versions = store.artifacts.of_run(entity, project, run)[role]
        cursor, per_page = v.get("cursor"), v.get("perPage")
        start = (
            int(cursor) + 1
            if isinstance(cursor, str) and cursor.isdigit() and len(cursor) < 10
            else 0
        )
        per_page = per_page if isinstance(per_page, int) and 0 < per_page <= MAX_PAGE else 50
        page = versions[start : start + per_page]
        edges = [{"node": _artifact_fragment(facts)} for facts in page]
        end = str(start + len(page) - 1) if page else None
        info = {
            "__typename": "PageInfo",
            "endCursor": end,
            "hasNextPage": start + per_page < len(versions),
        }
        artifacts = {"totalCount": len(versions), "pageInfo": info, "edges": edges}
        return {"project": {"run": {"artifacts": artifacts}}}

    return answer


def _membership(facts: dict[str, Any]) -> dict[str, Any]:
    """A version as the public API's `ArtifactMembershipFragment` has it: the version in
    its own collection (the sink links no version into other collections)."""
    artifact = _artifact_fragment(facts)
    collection = {
        "__typename": "ArtifactSequence",
        "name": facts["name"],
        "project": artifact["artifactSequence"]["project"],
    }
    aliases = [
        {"__typename": "ArtifactAlias", "id": f"{facts['collection_id']}:{alias}", "alias": alias}
        for alias in facts["aliases"]
    ]
    return {
        "__typename": "ArtifactCollectionMembership",
        "id": facts["id"],
        "versionIndex": artifact["versionIndex"],
        "createdAt": facts["created"],
        "aliases": aliases,
        "artifactCollection": collection,
        "artifact": artifact,
    }


def artifact_membership_by_name(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """`api.artifact("entity/project/name:alias")`: the version `name:alias`, `name:vN` or
    `name` (its latest) names, or `artifactCollectionMembership: null`."""
    found = _named_version(store, v)
    member = None if found is None else _membership(store.artifacts.version(found))
    return {"project": {"artifactCollectionMembership": member}}


def artifact_by_id(store: Store, v: dict[str, Any], base_url: str) -> dict:
    found = _known(store, v.get("id"))
    artifact = None if found is None else _artifact_fragment(store.artifacts.version(found))
    return {"artifact": artifact}


def _known(store: Store, artifact_id: object) -> int | None:
    """The number of a version an id names, None when there is no such version."""
    artifact = parse_id("Artifact", artifact_id)
    try:
        store.artifacts.version(artifact)
    except ArtifactError:
        return None
    return artifact


def read_url(store: Store, base_url: str, artifact: int, path: str | None) -> str:
    """A URL that reads one file (or the manifest, None) of a version without the API key
    for `READ_URL_SECONDS`, as W&B's pre-signed URLs do: wandb fetches them with no key."""
    expires = int(time.time()) + READ_URL_SECONDS
    token = store.upload_tokens.read_token(artifact, path, expires)
    where = "manifest" if path is None else "files/" + urllib.parse.quote(path)
    return f"{base_url}/artifact-storage/{artifact}/{where}?expires={expires}&read={token}"


def fetch_artifact_manifest(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """Where a version's manifest is read."""
    found = _known(store, v.get("id"))
    if found is None:
        return {"artifact": None}
    if store.artifacts.manifest_path(found) is None:
        return {"artifact": {"currentManifest": None}}
    url = read_url(store, base_url, found, None)
    return {"artifact": {"currentManifest": {"file": {"directUrl": url}}}}


def _membership_files(with_details: bool) -> Any:
    """`artifact.files()` (`ArtifactMembershipFiles`, every field of a file) or the URLs
    `artifact.download()` reads (`GetArtifactMembershipFileUrls`): a page of `perPage` files
    of the version `collection:alias` after the cursor, only those in `fileNames` if given."""

    def answer(store: Store, v: dict[str, Any], base_url: str) -> dict:
        entity, project = (
            check_entity(v.get("entity") or DEFAULT_ENTITY),
            check_project(v.get("project")),
        )
        collection, alias = v.get("collection"), v.get("alias")
        if not isinstance(collection, str) or not isinstance(alias, str):
            raise ArtifactError("collection and alias must be strings")
        found = store.artifacts.find(entity, project, f"{collection}:{alias}")
        if found is None:
            return {"project": None}
        facts = store.artifacts.version(found, files=True, reread=with_details)
        files = facts["files"]
        names = v.get("fileNames")
        if names is not None and not isinstance(names, list):
            raise ArtifactError("fileNames must be a list of file names")
        if names:
            wanted = {check_file_name(name) for name in names}
            files = [f for f in files if f["name"] in wanted]
        after, per_page = v.get("cursor"), v.get("perPage")
        start = (
            int(after) + 1 if isinstance(after, str) and after.isdigit() and len(after) < 10 else 0
        )
        per_page = per_page if isinstance(per_page, int) and 0 < per_page <= 10_000 else 50
        page = files[start : start + per_page]
        edges = []
        for i, f in enumerate(page):
            node: dict[str, Any] = {
                "__typename": "File",
                "name": f["name"],
                "directUrl": read_url(store, base_url, found, f["name"]),
            }
            if with_details:
                node.update(
                    id=server_id("File", start + i),
                    url=node["directUrl"],
                    sizeBytes=f["size"] or 0,
                    storagePath=None,
                    mimetype=mimetypes.guess_type(f["name"])[0] or "application/octet-stream",
                    updatedAt=facts["committed"],
                    digest=f["digest"],
                    md5=f["md5"],
                )
            edges.append({"node": node, "cursor": str(start + i)})
        info = {
            "__typename": "PageInfo",
            "endCursor": edges[-1]["cursor"] if edges else None,
            "hasNextPage": start + per_page < len(files),
        }
        connection: dict[str, Any] = {"pageInfo": info, "edges": edges}
        if with_details:
            connection["totalCount"] = len(files)
        membership = {"files": connection}
        return {
            "project": {
                "artifactCollection": {
                    "__typename": "ArtifactSequence",
                    "artifactMembership": membership,
                }
            }
        }

    return answer


def _run_info(entity: str, project: str, run: str) -> dict[str, Any]:
    return {
        "__typename": "Run",
        "id": f"{entity}/{project}/{run}",
        "name": run,
        "project": {
            "id": server_id("Project", 0),
            "internalId": server_id("Project", 0),
            "name": project,
            "entity": {"name": entity},
        },
    }


def artifact_created_by(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """The run that logged a version (`artifact.logged_by()`)."""
    found = _known(store, v.get("id"))
    if found is None:
        return {"artifact": None}
    runs = store.artifacts.runs_of(found, "output")
    return {"artifact": {"createdBy": _run_info(*runs[0]) if runs else None}}


def artifact_used_by(store: Store, v: dict[str, Any], base_url: str) -> dict:
    """The runs that used a version (`artifact.used_by()`)."""
    found = _known(store, v.get("id"))
    if found is None:
        return {"artifact": None}
    edges = [{"node": _run_info(*run)} for run in store.artifacts.runs_of(found, "input")]
    return {"artifact": {"usedBy": {"edges": edges}}}


HANDLERS = {
    "CreateArtifact": create_artifact,
    "CreateArtifactManifest": create_artifact_manifest,
    "CreateArtifactFiles": create_artifact_files,
    "CommitArtifact": commit_artifact,
    "UseArtifact": use_artifact,
    "ClientIDMapping": client_id_mapping,
    "ArtifactVersionFiles": artifact_version_files,
    "RunOutputArtifacts": _run_artifacts("logged"),
    "RunInputArtifacts": _run_artifacts("used"),
    "ArtifactMembershipByName": artifact_membership_by_name,
    "ArtifactByID": artifact_by_id,
    "FetchArtifactManifest": fetch_artifact_manifest,
    "ArtifactMembershipFiles": _membership_files(True),
    "GetArtifactMembershipFileUrls": _membership_files(False),
    "ArtifactCreatedBy": artifact_created_by,
    "ArtifactUsedBy": artifact_used_by,
}
