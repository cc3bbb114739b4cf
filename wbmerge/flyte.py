"""Flyte 2: every rank of an `Elastic` training task logs offline; a final task merges and
uploads, and shows the links. Used like `flyteplugins-wandb` (install `wbmerge[flyte]`):

    @wbmerge.flyte.wandb_init(project="demo", run_mode="shared")    # outermost
    @train_env.task
    def train(steps: int) -> flyte.io.Dir:
        dist.init_process_group("gloo")
        run = wbmerge.flyte.get_wandb_run()          # this rank's offline run
        ...
        return wbmerge.flyte.offline_runs()          # every rank calls it (a barrier)

    sync_runs = wbmerge.flyte.merge_task(wf_env, train)   # the final task

    @wf_env.task
    async def pipeline() -> list[str]:
        runs = await train.aio(steps=30)
        return await wbmerge.flyte.sync(sync_runs, runs)  # merged, uploaded: the links

The job id of the offline runs is `{run_name}-{action_name}` of the training action, so
the merged run ids are the online plugin's. Runs go to `$WBMERGE_DIR/{job id}` (default:
the temp dir). On one node all ranks share it; a multi-node job mounts one shared volume
at `WBMERGE_DIR` on every node, so rank 0 hands the runs of all nodes to the next task.

Flyte's local mode runs an `Elastic` task in-process, as one process. The decorator then
launches the ranks itself, as torchrun would on the cluster: one torch elastic launcher per
node (`nnodes` of them, `nproc_per_node` workers each, a c10d rendezvous on 127.0.0.1), so
a local run writes the same real multi-rank offline runs as a cluster run.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import flyte
import flyte.io

from . import training
from .errors import WbmergeError
from .plan import app_url

RUNS_DIR_ENV = "WBMERGE_DIR"
_CONTEXT_PREFIX = "wandb_"
_RUN: Any = None  # this process's run (one rank per process)
_RUNS_ROOT: Path | None = None


@dataclass
class Settings:
    """What `wandb_init` was given; the context (`wandb_config`) fills what it was not."""

    run_mode: str | None = None
    rank_scope: str | None = None
    project: str | None = None
    entity: str | None = None
    init_kwargs: dict = field(default_factory=dict)
    nnodes: int = 1
    nproc_per_node: int = 1

    def resolved(self, context: dict[str, str]) -> dict[str, Any]:
        """The effective values: decorator, else `wandb_config` context, else defaults."""
        from_context = _read_context(context)
        kwargs = {**from_context.pop("init_kwargs", {}), **self.init_kwargs}
        return {
            "run_mode": self.run_mode or from_context.get("run_mode") or "auto",
            "rank_scope": self.rank_scope or from_context.get("rank_scope") or "global",
            "project": self.project or from_context.get("project"),
            "entity": self.entity or from_context.get("entity"),
            "host": from_context.get("host"),
            "init_kwargs": kwargs,
        }


# -- the training task ---------------------------------------------------------------------


def wandb_init(
    _func: Any = None,
    *,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    **init_kwargs: Any,
) -> Any:
    """Decorate an `Elastic` training task (outermost, like the plugin's `@wandb_init`):
    each rank gets an offline run with its rank metadata; run_mode and rank_scope are
    recorded in the runs as the merge's defaults. Other arguments go to `wandb.init`."""

    def decorate(task: Any) -> Any:
        plugin = getattr(task, "plugin_config", None)
        if plugin is None or type(plugin).__name__ != "Elastic":
            raise WbmergeError(
                "wbmerge.flyte.wandb_init decorates a task whose plugin_config is Elastic"
            )
        nnodes = plugin.nnodes
        if isinstance(nnodes, str):
            nnodes = int(nnodes.split(":")[-1])
        settings = Settings(
            run_mode,
            rank_scope,
            project,
            entity,
            dict(init_kwargs),
            int(nnodes),
            int(plugin.nproc_per_node),
        )
        original = task.func

        @functools.wraps(original)
        def each_rank(*args: Any, **kwargs: Any) -> Any:
            context = _flyte_context()
            resolved = settings.resolved(context)
            job_id = _job_id()
            if "RANK" in os.environ:  # a worker of the real Elastic launcher
                return _run_rank(original, args, kwargs, job_id, resolved)
            return _launch_ranks(original, args, kwargs, job_id, resolved, settings)

        task.func = each_rank
        task = task.override(links=(*task.links, *training_links(settings)))
        task.wbmerge_settings = settings
        return task

    return decorate if _func is None else decorate(_func)


def get_wandb_run() -> Any:
    """This rank's run (every rank has one: all ranks log offline), or None outside."""
    return _RUN


def offline_runs() -> flyte.io.Dir:
    """Finish this rank's run and hand the job's offline runs on as a Dir (call it on every
    rank: it waits for all of them, so that the Dir holds every rank's finished run)."""
    global _RUN
    if _RUN is not None:
        _RUN.finish()
        _RUN = None
    _barrier()
    if _RUNS_ROOT is None:
        raise WbmergeError("offline_runs() is for tasks decorated with wbmerge.flyte.wandb_init")
    context = flyte.ctx()
    if context is not None and getattr(context, "mode", "local") != "local":
        return flyte.io.Dir.from_local_sync(str(_RUNS_ROOT))
    return flyte.io.Dir(path=str(_RUNS_ROOT))


@contextmanager
def wandb_config(
    project: str | None = None,
    entity: str | None = None,
    host: str | None = None,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    **init_kwargs: Any,
) -> Iterator[None]:
    """Defaults for the decorated tasks called inside the block, as the plugin's
    `wandb_config` (the decorator's own arguments win)."""
    values = {"project": project, "entity": entity, "host": host, "run_mode": run_mode}
    values["rank_scope"] = rank_scope
    context = {f"{_CONTEXT_PREFIX}{k}": v for k, v in values.items() if v is not None}
    if init_kwargs:
        context[f"{_CONTEXT_PREFIX}init_kwargs"] = json.dumps(init_kwargs)
    with flyte.custom_context(**context):
        yield


def _read_context(context: dict[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in (context or {}).items():
        if key.startswith(_CONTEXT_PREFIX):
            name = key[len(_CONTEXT_PREFIX) :]
            found[name] = json.loads(value) if name == "init_kwargs" else value
    return found


def _flyte_context() -> dict[str, str]:
    context = flyte.ctx()
    return dict(context.custom_context or {}) if context is not None else {}


def _job_id() -> str:
    context = flyte.ctx()
    if context is None:
        raise WbmergeError("wbmerge.flyte tasks run inside Flyte (flyte.run or a cluster)")
    return f"{context.action.run_name}-{context.action.name}"


def runs_root(job_id: str) -> Path:
    return (
        Path(os.environ.get(RUNS_DIR_ENV) or Path(tempfile.gettempdir()) / "wbmerge-runs") / job_id
    )


def _run_rank(
    func: Callable[..., Any], args: tuple, kwargs: dict, job_id: str, resolved: dict[str, Any]
) -> Any:
    """One rank: an offline run recording its rank and the job's run mode, then the task."""
    global _RUN, _RUNS_ROOT
    _RUNS_ROOT = runs_root(job_id)
    _RUNS_ROOT.mkdir(parents=True, exist_ok=True)
    init_kwargs = dict(resolved["init_kwargs"])
    init_kwargs.setdefault("dir", str(_RUNS_ROOT))
    _RUN = training.init(
        job_id=job_id,
        run_mode=resolved["run_mode"],
        rank_scope=resolved["rank_scope"],
        project=resolved["project"],
        entity=resolved["entity"],
        **init_kwargs,
    )
    try:
        result = func(*args, **kwargs)
    except BaseException:
        if _RUN is not None:
            _RUN.finish(exit_code=1)  # a crashed rank: a failed run (the merge warns)
            _RUN = None
        raise
    if _RUN is not None:  # the task did not call offline_runs()
        _RUN.finish()
        _RUN = None
    return result


def _barrier() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# -- local mode: launch the ranks ----------------------------------------------------------


def _launch_ranks(
    func: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    job_id: str,
    resolved: dict[str, Any],
    settings: Settings,
) -> Any:
    """Run the task on `nnodes` x `nproc_per_node` real ranks on this machine, one torch
    elastic launcher per node; returns rank 0's result (as Elastic does)."""
    with tempfile.TemporaryDirectory(prefix="wbmerge-flyte-") as scratch:
        spec = Path(scratch) / "spec.pkl"
        result = Path(scratch) / "result.pkl"
        spec.write_bytes(
            cloudpickle.dumps(
                {"func": func, "args": args, "kwargs": kwargs, "job_id": job_id,
                 "resolved": resolved, "result": str(result), "root": str(runs_root(job_id))}
            )
        )  # fmt: skip
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env[RUNS_DIR_ENV] = str(runs_root(job_id).parent)
        launchers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(settings.nnodes),
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    str(settings.nproc_per_node),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    job_id,
                    "--max-restarts",
                    "0",
                    "-m",
                    "wbmerge.flyte",
                    str(spec),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for node in range(settings.nnodes)
        ]
        outputs = [launcher.communicate()[0] for launcher in launchers]
        failed = [
            (node, output)
            for node, (launcher, output) in enumerate(zip(launchers, outputs, strict=True))
            if launcher.returncode
        ]
        for output in outputs:
            sys.stdout.write(output)
        if failed:
            node, output = failed[0]
            tail = " | ".join(output.strip().splitlines()[-3:])
            raise RuntimeError(f"ranks of node {node} failed: {tail}")
        return cloudpickle.loads(result.read_bytes())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(spec_path: str) -> None:
    """A rank launched by `_launch_ranks` (`python -m wbmerge.flyte SPEC`)."""
    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    out = _run_rank(spec["func"], spec["args"], spec["kwargs"], spec["job_id"], spec["resolved"])
    if os.environ.get("RANK") == "0":
        Path(spec["result"]).write_bytes(cloudpickle.dumps(out))


# -- links ---------------------------------------------------------------------------------


def run_links(
    base: str,
    run_mode: str,
    rank_scope: str,
    num_workers: int,
    host: str,
    entity: str,
    project: str,
) -> list[str]:
    """The links of run-modes.md: a run, one per worker with rank_scope "worker" on several
    nodes, or the group(s) of `new`."""
    root = f"{host.rstrip('/')}/{entity}/{project}"
    per_worker = rank_scope == "worker" and num_workers > 1
    names = [f"{base}-worker-{i}" for i in range(num_workers)] if per_worker else [base]
    kind = "groups" if run_mode == "new" else "runs"
    return [f"{root}/{kind}/{name}" for name in names]


@dataclass
class RunLink(flyte.Link):
    """One W&B link of a wbmerge job, rendered by Flyte from the run and action names (on
    the training task) or from the context `sync` sets (on the merge task)."""

    index: int = 0
    settings: dict = field(default_factory=dict)
    from_context: bool = False
    name: str = "Weights & Biases"
    icon_uri: str = ""

    def get_link(
        self,
        run_name: str,
        project: str,
        domain: str,
        context: dict[str, str],
        parent_action_name: str,
        action_name: str,
        pod_name: str,
        **kwargs: Any,
    ) -> str:
        values = {**self.settings, **_read_context(context or {})}
        if self.from_context:
            values.update(
                {
                    k[len("wbmerge_") :]: v
                    for k, v in (context or {}).items()
                    if k.startswith("wbmerge_")
                }
            )
        base = values.get("base") or f"{run_name}-{action_name}"
        links = run_links(
            base,
            values.get("run_mode") or "auto",
            values.get("rank_scope") or "global",
            int(values.get("num_workers") or 1),
            values.get("host") or app_url(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")),
            values.get("entity") or os.environ.get("WANDB_ENTITY", "<entity>"),
            values.get("project") or os.environ.get("WANDB_PROJECT", "<project>"),
        )
        return links[self.index] if self.index < len(links) else links[-1]


def _link_count(settings: Settings) -> int:
    worker = (settings.rank_scope or "global") == "worker" and settings.nnodes > 1
    return settings.nnodes if worker else 1


def training_links(settings: Settings, from_context: bool = False) -> tuple[RunLink, ...]:
    values = {
        k: v for k, v in asdict(settings).items() if k not in ("init_kwargs",) and v is not None
    }
    values["num_workers"] = settings.nnodes
    count = _link_count(settings)
    return tuple(
        RunLink(
            index=i,
            settings=values,
            from_context=from_context,
            name=f"Weights & Biases worker {i}" if count > 1 else "Weights & Biases",
        )
        for i in range(count)
    )


# -- the merge task ------------------------------------------------------------------------


def merge_task(env: flyte.TaskEnvironment, training_task: Any, name: str = "wbmerge_sync") -> Any:
    """A task in `env` that merges and uploads the offline runs `training_task` returns,
    returns the links, and shows them in the Flyte UI. Call it through `sync(...)`."""
    settings: Settings = training_task.wbmerge_settings

    async def wbmerge_sync(
        runs: flyte.io.Dir,
        run_mode: str = "",
        rank_scope: str = "",
        project: str = "",
        entity: str = "",
    ) -> list[str]:
        from .pipeline import MergeRequest
        from .pipeline import sync as sync_runs

        context = flyte.ctx()
        local = runs.path
        if context is not None and getattr(context, "mode", "local") != "local":
            local = await runs.download()  # from the blob store, on the cluster
        request = MergeRequest(
            [local],
            run_mode=run_mode or None,
            rank_scope=rank_scope or None,
            project=project or None,
            entity=entity or None,
        )
        report = sync_runs(request)
        for line in report.warnings:
            print(f"wbmerge: warning: {line}", file=sys.stderr)
        return [link["url"] for link in report.links]

    # Flyte finds a task on the cluster as `{func.__module__}.{func.__name__}`: the caller
    # keeps it in a module-level variable called `name`.
    wbmerge_sync.__name__ = wbmerge_sync.__qualname__ = name
    wbmerge_sync.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    return env.task(links=training_links(settings, from_context=True))(wbmerge_sync)


async def sync(
    task: Any,
    runs: flyte.io.Dir,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    project: str | None = None,
    entity: str | None = None,
) -> list[str]:
    """Call the merge task on `runs`, with the context its UI links are rendered from."""
    base = Path(runs.path.rstrip("/")).name  # runs_root(job id): the job id names the Dir
    context = {"wbmerge_base": base, **_recorded_defaults(runs.path)}
    for key, value in (
        ("run_mode", run_mode),
        ("rank_scope", rank_scope),
        ("project", project),
        ("entity", entity),
    ):
        if value:
            context[f"wbmerge_{key}"] = value
    with flyte.custom_context(**context):
        return await task.aio(
            runs,
            run_mode=run_mode or "",
            rank_scope=rank_scope or "",
            project=project or "",
            entity=entity or "",
        )


def _recorded_defaults(path: str) -> dict[str, str]:
    """run_mode / rank_scope the training recorded, when the runs are on this machine."""
    if not Path(path).is_dir():
        return {}  # in the blob store: the merge task reads them; the links take the args
    from .discover import discover

    found: dict[str, str] = {}
    for run in discover([path]):
        for key in ("run_mode", "rank_scope"):
            if run.defaults.get(key):
                found.setdefault(f"wbmerge_{key}", str(run.defaults[key]))
    return found


if __name__ == "__main__":
    # `python -m wbmerge.flyte SPEC` runs this file as __main__; the task's code imports
    # wbmerge.flyte, a second module object: the rank must be set up in that one.
    import wbmerge.flyte

    wbmerge.flyte._rank_main(sys.argv[1])
