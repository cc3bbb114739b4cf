"""End to end: `wbmerge sync` against plain `wandb sync -n 8` of the raw runs, into the local sink.

    python bench/bench_sync_e2e.py                      # 8, 64, 256 ranks; 32k rows each job
    python bench/bench_sync_e2e.py --rows 64000 --repeat 5
    python bench/bench_sync_e2e.py --before /path/to/an/older/checkout   # adds its variants
    python bench/bench_sync_e2e.py --ranks 64 --repeat 1 --modes new     # a quick look
    python bench/bench_sync_e2e.py --latency 0.05   # every sink answer 50 ms late, as over a network
    python bench/bench_sync_e2e.py --like-wandb     # a sink like W&B: lag, write cursor, 429s

Three synthetic jobs of 8, 64 and 256 ranks hold the same rows in all (`--rows`, 20 metrics
a row). Each is uploaded, every repeat, to a fresh project of one local sink by

- `plain`: `wandb sync -p P -n 8 RUN_DIR...` of a fresh copy of the raw rank directories
  (wandb 0.31's `wandb sync` takes `-n` as the runs it uploads at a time);
- `new`: `wbmerge sync JOB --run-mode new -n 8` (one run per rank, exactly once, verified);
- `shared`: `wbmerge sync JOB --run-mode shared -n 8` (all ranks merged into one run);
- `full` (asked for with `--modes`): `new` with `--verify full`, every row's values read
  back and compared rather than a sample's;

and, with `--before DIR`, `new@before` and `shared@before`: the same commands run from the
wbmerge tree in DIR (`PYTHONPATH=DIR`), to compare two versions in one invocation. The
machine is shared and noisy, so within every repeat the variants run one after the other in
an order that rotates from repeat to repeat, and the sink (which fills up as the repeats go
on) is the same for all. Reported: the median seconds of each variant (from its command's
start to its end) and its ratio to the median of `plain`, as a markdown table. With
`--like-wandb` the sink behaves like W&B (`sink serve --like-wandb`: counts 3 s late, a
write cursor, sampled history, and W&B's rate limits of 2 file_stream requests a second per
run and 500 requests a second per project, answered 429), and the table adds each variant's
429s per upload (median).

A second table gives each variant's CPU seconds (user + system, median): the uploader's
(`wandb sync` and the wandb-core it starts) and, for wbmerge, its own (the `wbmerge sync`
process, the relay and any other helper), with their ratio; the lines after it say whether
`new` keeps its own to a quarter of the uploader's. Both come from the kernel's accounting
of ended processes (`wait4`), not from samples of /proc, which miss what a process uses
between the last sample and its end: every command runs under a subreaper that reaps the
whole tree, and `wbmerge sync` under a hook that notes each child's CPU as wbmerge reaps
it (see `cputime`).
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cputime import LINGER, Measured, run_measured  # noqa: E402

from tests.support import synthetic  # noqa: E402
from wbmerge.sink import SinkClient, read_api_key  # noqa: E402

RANKS = (8, 64, 256)
TIMEOUT = 900  # seconds for one upload before the benchmark gives up


def start_sink(
    data: Path, latency: float = 0.0, like_wandb: bool = False
) -> tuple[subprocess.Popen, str]:
    """The local sink; with `latency`, every upload request waits that long before its answer,
    as a server a network away would make it (the sink's own delay fault, which waits without
    holding the sink up)."""
    port_file = data / "port"
    data.mkdir(parents=True)
    delay = ["--fault", f"*=delay:{latency}"] if latency > 0 else []
    delay += ["--like-wandb"] if like_wandb else []
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wbmerge.sink",
            "--port",
            "0",
            "--data",
            str(data),
            "--port-file",
            str(port_file),
            *delay,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the sink did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def commands(variant: str, job: Path, project: str, work: Path, before: Path | None) -> list:
    """The command of `variant` for `job` into `project`, and the PYTHONPATH it runs with."""
    if variant == "plain":
        copy = work / project
        shutil.copytree(job, copy)  # wandb sync writes beside the runs it reads
        wandb = str(Path(sys.executable).with_name("wandb"))
        dirs = [str(d) for d in sorted((copy / "wandb").glob("offline-run-*"))]
        return [[wandb, "sync", "-p", project, "-e", "local", "-n", "8", *dirs], str(ROOT)]
    mode, _, version = variant.partition("@")
    tree = before if version else ROOT
    verify = ["--verify", "full"] if mode == "full" else []
    mode = "new" if mode == "full" else mode
    cmd = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "sync",
        str(job),
        "--run-mode",
        mode,
        "-n",
        "8",
        "-p",
        project,
        "-e",
        "local",
        *verify,
    ]
    return [cmd, str(tree)]


def throttled(client: SinkClient) -> int:
    """The requests the sink has answered 429 so far (0 for a sink not like W&B)."""
    return sum(client.like_wandb().get("throttled", {}).values())


def run_once(
    variant: str,
    ranks: int,
    job: Path,
    repeat: int,
    env: dict,
    work: Path,
    before: Path | None,
    client: SinkClient,
) -> Measured:
    project = f"{variant.replace('@', '-')}-{ranks}-{repeat}"
    cmd, pythonpath = commands(variant, job, project, work, before)
    run_env = {**env, "PYTHONPATH": pythonpath, "WBMERGE_STATE_DIR": str(work / f"state-{project}")}
    # in the tree it runs from: `python -m` puts the working directory first on sys.path
    done, stderr = run_measured(cmd, run_env, pythonpath, TIMEOUT, hooked=variant != "plain")
    if done.returncode != 0:
        raise SystemExit(f"{variant} of {ranks} ranks failed:\n{stderr[-2000:]}")
    runs = len(client.runs(project=project))
    want = 1 if variant.startswith("shared") else ranks
    if runs != want:
        raise SystemExit(f"{variant} of {ranks} ranks: {runs} runs arrived, not {want}")
    shutil.rmtree(work / project, ignore_errors=True)
    return done


def table(
    times: dict[tuple[str, int], list[float]],
    variants: list[str],
    ranks_of: list[int],
    refused: dict[tuple[str, int], list[int]] | None = None,
) -> str:
    """The markdown table of medians and ratios; with `refused`, each variant's 429s too."""
    heads = [f"{v} s" for v in variants] + [f"{v} / plain" for v in variants if v != "plain"]
    heads += [f"{v} 429s" for v in variants] if refused else []
    lines = ["| ranks | " + " | ".join(heads) + " |", "|" + " --- |" * (1 + len(heads))]
    for ranks in ranks_of:
        medians = {v: statistics.median(times[v, ranks]) for v in variants}
        cells = [f"{medians[v]:.2f}" for v in variants]
        cells += [f"{medians[v] / medians['plain']:.2f}" for v in variants if v != "plain"]
        if refused:
            cells += [f"{statistics.median(refused[v, ranks]):.0f}" for v in variants]
        lines.append(f"| {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_medians(runs: list[Measured]) -> tuple[float | None, float]:
    """The median CPU seconds of wbmerge's own processes (None for plain) and the uploader's."""
    own = [run.own for run in runs if run.own is not None]
    return (statistics.median(own) if own else None), statistics.median(r.uploader for r in runs)


def cpu_table(
    results: dict[tuple[str, int], list[Measured]], variants: list[str], ranks_of: list[int]
) -> str:
    """The markdown table of each variant's median CPU seconds: wbmerge's own, the
    uploader's, and their ratio (of the medians)."""
    heads = ["plain uploader CPU s"]
    for v in variants[1:]:
        heads += [f"{v} own CPU s", f"{v} uploader CPU s", f"{v} own / uploader"]
    lines = ["| ranks | " + " | ".join(heads) + " |", "|" + " --- |" * (1 + len(heads))]
    for ranks in ranks_of:
        cells = [f"{cpu_medians(results['plain', ranks])[1]:.2f}"]
        for v in variants[1:]:
            own, uploader = cpu_medians(results[v, ranks])
            cells += [f"{own:.2f}", f"{uploader:.2f}", f"{own / uploader:.2f}"]
        lines.append(f"| {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(results: dict[tuple[str, int], list[Measured]], ranks_of: list[int]) -> list[str]:
    """Whether `new` mode keeps wbmerge's own CPU to a quarter of the uploader's (medians)."""
    lines = []
    for ranks in ranks_of:
        if ("new", ranks) in results:
            own, uploader = cpu_medians(results["new", ranks])
            verdict = "yes" if own <= uploader / 4 else "NO"
            lines.append(
                f"new, {ranks} ranks: own {own:.2f} s <= 1/4 of the uploader's {uploader:.2f} s"
                f" ({uploader / 4:.2f} s): {verdict}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32_000, help="history rows of each job")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another wbmerge tree to compare with")
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=list(RANKS),
        help="the jobs' rank counts (default: 8 64 256)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["new", "shared"],
        choices=["new", "shared", "full"],
        help="the wbmerge run modes to run beside plain",
    )
    parser.add_argument(
        "--latency",
        type=float,
        default=0.0,
        help="seconds every request to the sink waits, as over a network",
    )
    parser.add_argument(
        "--like-wandb", action="store_true", help="a sink that behaves like W&B, its 429s counted"
    )
    args = parser.parse_args()
    variants = ["plain", *args.modes]
    if args.before:
        variants += [f"{mode}@before" for mode in args.modes]
    for tree in filter(None, [ROOT, args.before]):
        # Bytecode, as an installed wandb has it: with PYTHONDONTWRITEBYTECODE set, every
        # `python -m wbmerge.cli` would compile the package anew (about 0.1 s of a start).
        compileall.compile_dir(tree / "wbmerge", quiet=1)
    with tempfile.TemporaryDirectory(prefix="wbmerge-bench-e2e-") as tmp:
        work = Path(tmp)
        jobs = {}
        for ranks in args.ranks:
            jobs[ranks] = work / f"job-{ranks}"
            synthetic.write_job(
                jobs[ranks],
                max(1, ranks // 8),
                min(ranks, 8),
                args.rows // ranks,
                metrics=20,
                job_id=f"bench-{ranks}",
            )
            size = sum(p.stat().st_size for p in jobs[ranks].rglob("*.wandb")) / 1e6
            print(f"{ranks} ranks x {args.rows // ranks} steps: {size:.0f} MB", flush=True)
        sink, url = start_sink(work / "sink", args.latency, args.like_wandb)
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        key = read_api_key(work / "sink")
        env.update(WANDB_BASE_URL=url, WANDB_API_KEY=key, WANDB_SILENT="true")
        client = SinkClient(url, key)
        results: dict[tuple[str, int], list[Measured]] = {}
        refused: dict[tuple[str, int], list[int]] = {}
        try:
            for repeat in range(args.repeat):
                for ranks in args.ranks:
                    shift = repeat % len(variants)  # each variant goes first in turn
                    for variant in variants[shift:] + variants[:shift]:
                        before_429s = throttled(client)
                        done = run_once(
                            variant, ranks, jobs[ranks], repeat, env, work, args.before, client
                        )
                        results.setdefault((variant, ranks), []).append(done)
                        refused.setdefault((variant, ranks), []).append(
                            throttled(client) - before_429s
                        )
                        own = "" if done.own is None else f", own {done.own:5.2f} s"
                        print(
                            f"  repeat {repeat} {ranks:>3} ranks {variant:>13}:"
                            f" {done.seconds:6.2f} s; CPU: uploader {done.uploader:5.2f} s{own}",
                            flush=True,
                        )
        finally:
            sink.terminate()
            sink.wait(timeout=30)
    latency = f", {args.latency * 1000:.0f} ms a request" if args.latency else ""
    latency += ", a sink like W&B" if args.like_wandb else ""
    print(f"\nmedian of {args.repeat}, {args.rows} rows per job, 20 metrics a row{latency}:\n")
    times = {key: [run.seconds for run in runs] for key, runs in results.items()}
    print(table(times, variants, args.ranks, refused if args.like_wandb else None))
    print(f"\nCPU seconds (user + system), median of {args.repeat}:\n")
    print(cpu_table(results, variants, args.ranks))
    print("", *verdicts(results, args.ranks), sep="\n")
    left = sum(run.left for runs in results.values() for run in runs)
    if left:
        print(f"({left} processes outlived their command by {LINGER:.0f} s: CPU so far counted)")


if __name__ == "__main__":
    main()
