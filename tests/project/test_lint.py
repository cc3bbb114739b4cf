"""ruff is part of the test command: lint and format check of the project's Python code."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from ..conftest import ROOT

# The project's own trees: a scratch script a user leaves in the clone is not the project's.
CODE = ["wbmerge", "tests", "bench", "examples", "fixtures", "docs"]


@pytest.mark.parametrize(
    "args", [["check", *CODE], ["format", "--check", *CODE]], ids=["lint", "format"]
)
def test_ruff(args):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


MODULES = sorted((ROOT / "wbmerge").rglob("*.py"))


PACKAGES = sorted(p.parent for p in MODULES if p.name == "__init__.py")


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_says_what_it_holds(package):
    """Cohesion, not a line count, decides where code goes: each stage is a sub-package
    whose docstring says what it holds, so a newcomer finds the room by its door."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 12, f"{package.name}/__init__.py says too little"


def test_the_framing_knows_nothing_of_records():
    """`txlog` frames bytes; what a payload is belongs to `records` (and `wire`)."""
    source = (ROOT / "wbmerge" / "log" / "txlog.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in imports if "proto" in line or "wire" in line or "records" in line]


def test_the_errors_import_nothing_of_the_package():
    """Every stage raises `errors`' types, so `errors` must not pull any stage in."""
    tree = ast.parse((ROOT / "wbmerge" / "errors.py").read_text())
    inner = [
        node.module or "."
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or "wbmerge" in (node.module or ""))
    ]
    assert inner == []


def module_imports() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports, at any depth of
    its code (inside functions, and type-only imports too: a cycle of those is still a
    knot a reader has to untie)."""
    names = {}
    for path in MODULES:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    target = f"{module}.{alias.name}"
                    if target in names or module in names:
                        graph[name].add(target if target in names else module)
            elif isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in names}
    return graph


def test_the_package_imports_form_no_cycle():
    graph = module_imports()
    assert len(graph) > 60 and sum(map(len, graph.values())) > 200  # (the graph was read)
    cycles, done, path = [], set(), []

    def visit(name: str) -> None:
        path.append(name)
        for target in sorted(graph[name]):
            if target in path:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in done:
                visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name)
    assert cycles == []


# The stages, lowest first: a part of the package imports only the parts before it (and
# itself). The data flows discover -> plan -> merge -> upload; the rules and types a stage
# consumes sit below it, the command line sits on top, and `__main__` modules, which are
# programs rather than library, may import anything.
LAYERS = [
    "errors",
    "safepaths",
    "runtime",
    "log",
    "wandbcore",
    "training",
    "plan",
    "identify",
    "analyse",
    "merge",
    "upload",
    "verify",
    "sync",
    "follow",
    "sink",
    "api",
    "flyte",
    "cli",
]


def part_of(module: str) -> str:
    """`wbmerge.merge.shared` -> `merge`: the stage a module belongs to."""
    return module.split(".")[1] if "." in module else ""


def test_no_stage_imports_a_later_one():
    graph = module_imports()
    parts = {part_of(name) for name in graph} - {"", "__main__"}
    assert parts == set(LAYERS), "every part of the package has its place in LAYERS"
    upward = [
        f"{name} -> {target}"
        for name, targets in graph.items()
        if part_of(name) in LAYERS and not name.endswith("__main__")
        for target in targets
        if part_of(target) in LAYERS and LAYERS.index(part_of(target)) > LAYERS.index(part_of(name))
    ]
    assert upward == []


def test_the_sink_shares_no_code_with_what_it_checks():
    """The sink is the judge of every end-to-end test: were it to reuse the merge's or the
    uploader's code, a bug there would agree with itself. It may share only the name
    rules of W&B (`plan.wandbnames`), path safety and the error type."""
    graph = module_imports()
    shared = {
        target
        for name, targets in graph.items()
        if part_of(name) == "sink" and not name.endswith("__main__")
        for target in targets
        if part_of(target) != "sink"
    }
    assert shared <= {
        "wbmerge.plan",
        "wbmerge.plan.wandbnames",
        "wbmerge.safepaths",
        "wbmerge.errors",
    }, shared


def exported(package: str) -> set[str]:
    """The names a sub-package's `__init__` lists in `__all__`: what other parts may use."""
    tree = ast.parse((ROOT / "wbmerge" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
            "__all__"
        ]:
            return set(ast.literal_eval(node.value))
    return set()


def where_of(path):
    """A file's dotted place (`wbmerge.merge.shared`, `tests.merge.test_rows`) and whether
    it is a package's `__init__`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return (parts[:-1] if is_package else parts), is_package


def imported_from(node: ast.ImportFrom, here: list[str], is_package: bool) -> list[str]:
    """The dotted module an import takes names from, relative imports resolved."""
    if not node.level:
        return (node.module or "").split(".")
    package = here if is_package else here[:-1]
    base = package[: len(package) - node.level + 1]
    return [*base, *((node.module or "").split(".") if node.module else [])]


def bindings(tree: ast.AST, here: list[str], is_package: bool) -> dict[str, str]:
    """Each local name a file binds by importing from wbmerge -> what it names, dotted
    (`from wbmerge import merge` binds merge -> wbmerge.merge)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = ".".join(imported_from(node, here, is_package))
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
    return {name: target for name, target in bindings_in_wbmerge(bound)}


def bindings_in_wbmerge(bound: dict[str, str]):
    for name, target in bound.items():
        if target == "wbmerge" or target.startswith("wbmerge."):
            yield name, target


def dotted_uses(tree: ast.AST, bound: dict[str, str]):
    """Each attribute chain on a name bound from wbmerge, spelled out with what the name
    names: `merge.rows` with merge -> wbmerge.merge gives (line, wbmerge.merge.rows)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(
            getattr(node, "parent", None), ast.Attribute
        ):
            chain, value = [], node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                yield node.lineno, ".".join([bound[value.id], *reversed(chain)])


def users_of_the_package():
    yield from MODULES
    for folder in CODE[1:]:
        yield from (p for p in (ROOT / folder).rglob("*.py") if "data" not in p.parts)


def test_other_parts_use_a_package_through_its_door():
    """A sub-package's modules are its inside: every other part of wbmerge, and every test,
    benchmark and example but the package's own tests (`tests/<package>/`), uses only what
    its `__init__` exports (in `__all__`), by import or by attribute, so a stage can be
    rebuilt behind its door. A door may list a module
    as a whole (its public names are then part of the door). `__main__` modules are
    programs, not users of a door."""
    packages = {p.name for p in PACKAGES if p.parent == ROOT / "wbmerge"}
    doors = {name: exported(name) for name in packages}
    through_the_wall = []
    for path in users_of_the_package():
        here, is_package = where_of(path)
        if here[-1] == "__main__":
            continue
        # A package's own tests (tests/<package>/) may use its modules, as the package does.
        own = here[1] if here[0] in ("wbmerge", "tests") and len(here) > 1 else None
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node  # (so that only whole attribute chains are read)
        uses = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (here[0] == "wbmerge" or not node.level):
                module = imported_from(node, here, is_package)
                uses += [(node.lineno, ".".join([*module, alias.name])) for alias in node.names]
            elif isinstance(node, ast.Import):
                uses += [(node.lineno, alias.name) for alias in node.names]
        uses += dotted_uses(tree, bindings(tree, here, is_package))
        for line, dotted in uses:
            parts = dotted.split(".")
            if (
                len(parts) < 3
                or parts[0] != "wbmerge"
                or parts[1] not in packages
                or parts[1] == own
            ):
                continue
            if parts[2] not in doors[parts[1]]:
                through_the_wall.append(f"{path.relative_to(ROOT)}:{line} {dotted}")
    assert through_the_wall == []


def test_tests_use_public_names_only():
    """Tests use no `_private` name of wbmerge, imported or reached by attribute through
    anything they imported from it, so the inside can be rebuilt."""
    private = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        here, is_package = where_of(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node
        uses = [
            (node.lineno, f"{node.module}.{alias.name}")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wbmerge")
            for alias in node.names
        ]
        uses += dotted_uses(tree, bindings(tree, here, is_package))
        private += [
            f"{path.relative_to(ROOT)}:{line} {dotted}"
            for line, dotted in uses
            if dotted.startswith("wbmerge") and any(map(_private, dotted.split(".")))
        ]
    assert private == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
