"""Whether the server holds a run's artifacts: each artifact the sources logged (as the
merge read them, `artifactfiles.LoggedArtifact`) committed under the run with its digest,
and every file at its size and MD5, asked the way wandb's public API asks
(`RunOutputArtifacts`, then `ArtifactVersionFiles` of the version found).

wandb's uploader reports a failed artifact only in its debug log, and goes on to finish
the run: without this check a sync whose artifact never committed said "verified".
The answers are untrusted: one of another shape is a ServerError, said as the run's
problem, and the run is sent again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..merge import LoggedArtifact
from ..upload import Delivery, ServerClient, ServerError

# The public API's queries of a run's logged versions (`run.logged_artifacts()`) and of one
# version's files (`project.artifact(name).files()`), asking only for fields W&B's schema has.
RUN_OUTPUT_ARTIFACTS = """query RunOutputArtifacts($entity: String!, $project: String!,
    $run: String!, $cursor: String, $perPage: Int) {
  project(entityName: $entity, name: $project) { run(name: $run) {
    artifacts: outputArtifacts(after: $cursor, first: $perPage) {
      pageInfo { endCursor hasNextPage }
      edges { node { id digest state versionIndex artifactSequence { name } } }
    } } } }"""
ARTIFACT_VERSION_FILES = """query ArtifactVersionFiles($entity: String!, $project: String!,
    $name: String!, $after: String) {
  project(name: $project, entityName: $entity) { artifact(name: $name) {
    id digest state versionIndex
    files(after: $after, first: 1000) {
      edges { node { name sizeBytes md5 } } pageInfo { endCursor hasNextPage }
    } } } }"""
MAX_PAGES = 100  # pages of a run's versions, or of a version's files, read at most
FILES_PER_PAGE = 1000  # (as `ArtifactVersionFiles` asks)


def artifacts_missing(
    client: ServerClient, entity: str | None, project: str, delivery: Delivery
) -> list[str]:
    """A line for each artifact of `delivery` that the server does not hold committed
    under the run with its digest and files; [] when it holds every one."""
    try:
        entity = entity or client.viewer_entity() or ""
        versions = logged_artifacts(client, entity, project, delivery.run_id) or []
        problems = []
        # each once: two ranks that logged the same content made one version
        for artifact in dict.fromkeys(delivery.artifacts):
            problems += _missing(client, entity, project, artifact, versions)
        return problems
    except ServerError as exc:
        return [f"artifacts could not be verified: {exc}"]


def logged_artifacts(
    client: ServerClient, entity: str, project: str, run_id: str
) -> list[dict] | None:
    """The name, version index, digest and state of each artifact version the run logged;
    None when there is no such run."""
    variables = {"entity": entity, "project": project, "run": run_id, "perPage": 100}
    nodes = _all_pages(
        client,
        RUN_OUTPUT_ARTIFACTS,
        "RunOutputArtifacts",
        variables,
        "cursor",
        lambda data: _field(_field(data, "project"), "run"),
        "artifacts",
        f"the artifacts of {run_id}",
        f"{run_id}'s artifacts",
    )
    if nodes is None:
        return None
    return [
        {
            "name": _text(_field(node.get("artifactSequence"), "name")),
            "version": node.get("versionIndex"),
            "digest": _text(node.get("digest")),
            "state": _text(node.get("state")),
        }
        for node in nodes
    ]


def artifact_files(
    client: ServerClient, entity: str, project: str, version: str, entries: int = 0
) -> dict[str, tuple[int, str]] | None:
    """{path: (size, MD5)} of the files of the version `version` (`name:vN`); None when
    there is no such version. `entries`: how many files the version should list (its
    manifest's entries), so that a version of many is read to its end."""
    variables = {"entity": entity, "project": project, "name": version}
    nodes = _all_pages(
        client,
        ARTIFACT_VERSION_FILES,
        "ArtifactVersionFiles",
        variables,
        "after",
        lambda data: _field(_field(data, "project"), "artifact"),
        "files",
        f"the files of {version}",
        f"{version}'s files",
        MAX_PAGES + entries // FILES_PER_PAGE,
    )
    if nodes is None:
        return None
    files: dict[str, tuple[int, str]] = {}
    for node in nodes:
        size = node.get("sizeBytes")
        files[_text(node.get("name"))] = (
            size if isinstance(size, int) else -1,
            _text(node.get("md5")),
        )
    return files


def _all_pages(
    client: ServerClient,
    query: str,
    operation: str,
    variables: dict,
    cursor_name: str,
    holder: Callable[[object], object],
    connection: str,
    page_of: str,
    listed: str,
    most: int | None = None,
) -> list[dict] | None:
    """Every node of a paged connection (`holder(answer)[connection]`), asked page after
    page with the cursor in `cursor_name`; None when the holder does not exist. A server
    that keeps answering pages is asked `most` times (`MAX_PAGES` unless given), then
    refused."""
    most = MAX_PAGES if most is None else most
    nodes: list[dict] = []
    cursor = None
    for _ in range(most):
        data = client.query(query, {**variables, cursor_name: cursor}, operation)
        found = holder(data)
        if not isinstance(found, dict):
            return None
        page, cursor = _page(found.get(connection), page_of)
        nodes += page
        if cursor is None:
            return nodes
    raise ServerError(f"the server lists over {most} pages of {listed}")


def _missing(
    client: ServerClient,
    entity: str,
    project: str,
    artifact: LoggedArtifact,
    versions: list[dict],
) -> list[str]:
    name = f"artifact {artifact.name!r}"
    candidates = [
        v
        for v in versions
        if v["name"] == artifact.name
        and artifact.digest in (None, v["digest"])
        and isinstance(v["version"], int)
    ]
    committed = [v for v in candidates if v["state"] == "COMMITTED"]
    if not committed:
        state = f" (it is {candidates[0]['state'] or 'in no state'})" if candidates else ""
        digest = f" with digest {artifact.digest}" if artifact.digest else ""
        return [f"{name}{digest} is not committed under the run{state}"]
    expected = {path: (size, md5) for path, size, md5 in artifact.files}
    problems: list[str] = []
    for version in committed:
        version_name = f"{artifact.name}:v{version['version']}"
        held = artifact_files(client, entity, project, version_name, artifact.entries)
        problems = [
            _file_problem(name, path, size_md5, (held or {}).get(path))
            for path, size_md5 in sorted(expected.items())
            if (held or {}).get(path) != size_md5
        ]
        if not problems:
            return []
    return problems


def _file_problem(
    name: str, path: str, expected: tuple[int, str], held: tuple[int, str] | None
) -> str:
    if held is None:
        return f"{name} holds no file {path!r}"
    if held[0] != expected[0]:
        return f"{name} file {path!r} holds {held[0]} bytes of {expected[0]}"
    return f"{name} file {path!r} is not the one the rank logged (MD5)"


def _field(value: object, name: str) -> Any:
    """`value[name]` when `value` is a JSON object, else None."""
    return value.get(name) if isinstance(value, dict) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _page(connection: object, what: str) -> tuple[list[dict], str | None]:
    """The nodes of a page of a GraphQL connection and the cursor of the next page (None:
    the last); a ServerError for an answer of another shape, or a next page without a
    cursor."""
    edges = _field(connection, "edges")
    info = _field(connection, "pageInfo")
    if not isinstance(edges, list) or not isinstance(info, dict):
        raise ServerError(f"the server answered with no list of {what}")
    nodes = [node for edge in edges if isinstance(node := _field(edge, "node"), dict)]
    if len(nodes) != len(edges):
        raise ServerError(f"the server answered with a malformed entry among {what}")
    if not info.get("hasNextPage"):
        return nodes, None
    cursor = info.get("endCursor")
    if not (isinstance(cursor, str) and cursor):
        raise ServerError(f"the server answered with more of {what} but no cursor")
    return nodes, cursor
