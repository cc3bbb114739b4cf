"""The paths of a job's runs: resolved with their directories resolved once, as
`Path.resolve` resolves each, and an output directory refused inside any of them."""

import os
from pathlib import Path

import pytest

from wbmerge.errors import WbmergeError
from wbmerge.safepaths import Resolver, check_out_dir, source_trees


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Runs reached through links: a linked job directory, a linked run, a linked file, a
    dangling link, a link loop, a relative link and a `..` in a path."""
    real = tmp_path / "real" / "job"
    for run in ("a", "b"):
        (real / "wandb" / run).mkdir(parents=True)
        (real / "wandb" / run / f"run-{run}.wandb").write_bytes(b"x")
    (tmp_path / "job").symlink_to(real)
    (tmp_path / "runlink").symlink_to(real / "wandb" / "a")
    (real / "wandb" / "b" / "file").symlink_to("run-b.wandb")
    (real / "wandb" / "b" / "gone").symlink_to(tmp_path / "nowhere")
    (real / "wandb" / "b" / "up").symlink_to("../a")
    (real / "wandb" / "loop").symlink_to(real / "wandb" / "loop")
    return tmp_path


NAMES = [
    "job/wandb/a/run-a.wandb",
    "job/wandb/b/run-b.wandb",
    "job/wandb/a/../b/run-b.wandb",
    "runlink/run-a.wandb",
    "job/wandb/b/file",
    "job/wandb/b/gone",
    "job/wandb/b/up/run-a.wandb",
    "job/wandb/b/missing/more",
    "job/wandb/b/up/..",
    "job",
    "real/job/wandb/a",
]


def test_paths_resolve_as_path_resolve_resolves_each(tree, monkeypatch):
    resolve = Resolver()
    for name in NAMES:
        assert resolve(tree / name) == (tree / name).resolve(), name
    monkeypatch.chdir(tree / "job" / "wandb")
    for name in ("a/run-a.wandb", "b/file", "b/up/run-a.wandb", "."):
        assert resolve(name) == Path(name).resolve(), name
    assert resolve(tree / "job/wandb/b/file") == tree / "real/job/wandb/b/run-b.wandb"
    assert resolve(tree / "runlink/run-a.wandb") == tree / "real/job/wandb/a/run-a.wandb"


def test_a_link_loop_is_an_error_as_with_path_resolve(tree):
    with pytest.raises(RuntimeError):
        (tree / "real/job/wandb/loop/x").resolve()
    with pytest.raises(RuntimeError):
        Resolver()(tree / "real/job/wandb/loop/x")


def test_each_directory_is_looked_at_once(tree, monkeypatch):
    """A directory shared by many paths costs one `lstat`, not one per path."""
    calls = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: calls.append(str(p)) or real_lstat(p))
    resolve = Resolver()
    resolve(tree / "job/wandb/a/run-a.wandb")
    first = len(calls)
    resolve(tree / "job/wandb/b/run-b.wandb")
    assert len(calls) - first == 2  # `b` and its file: the job's directories are known


def test_an_output_inside_any_run_directory_reached_by_a_link_is_refused(tree):
    runs = [tree / "job/wandb/a/run-a.wandb", tree / "runlink/run-a.wandb"]
    runs += [tree / f"job/wandb/r{i}/run-{i}.wandb" for i in range(50)]
    trees = source_trees([tree / "job/wandb/b"], runs)
    assert trees[:2] == [tree / "real/job/wandb/b", tree / "real/job/wandb/a"]
    assert len(trees) == 52  # (the run named twice, through a link, once)
    for out in ("real/job/wandb/r49/out", "job/wandb/b", "job/wandb/b/up/x"):
        with pytest.raises(WbmergeError, match="inside the source directory"):
            check_out_dir(tree / out, trees)
    check_out_dir(tree / "real/job/out", trees)
    check_out_dir(tree / "job/wandb/r50", trees)
