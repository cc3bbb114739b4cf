"""The CPU time of a command's whole process tree, split into wbmerge's own and the uploader's.

Both parts come from the kernel's accounting of ended processes (`wait4`), never from
samples of `/proc`. `run_measured` starts the command under `RUNNER`, which makes itself
the child subreaper of the tree, so that it reaps both the command and every descendant
whose parent ended first (a wandb-core outliving its `wandb sync`); the command's own
rusage then holds all it waited for. A `wbmerge sync` runs under `HOOK`, which makes its
`os.waitpid` a `wait4` and notes each child's CPU when wbmerge reaps it, and each child's
command line when it starts. `split` adds it all up: the uploader's part is its processes'
(`wandb sync`, with the wandb-core each waited for) and any wandb-core the runner reaped;
wbmerge's own part is the rest of the tree (the `wbmerge sync` process, the relay, any
other helper).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Run as `python -I -S -c RUNNER OUT LINGER CMD...`: starts CMD, reaps every process of its tree
# as it ends (a subreaper is given its descendants' orphans), and writes to OUT the CPU of
# each (user + system seconds, with what it waited for), its command name, and the
# seconds from CMD's start to its end. Processes still running `LINGER` seconds after CMD
# ended are left running and named with the CPU they have used so far.
RUNNER = """\
import ctypes, json, os, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    raise SystemExit("cannot become a child subreaper")
out, linger, command = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
began = time.monotonic()
top = subprocess.Popen(command).pid
reaped, ended, code = [], None, None
while True:
    options = os.WEXITED | os.WNOWAIT | (os.WNOHANG if ended is not None else 0)
    try:
        info = os.waitid(os.P_ALL, 0, options)
    except ChildProcessError:
        break
    if info is None:
        if time.monotonic() - ended > linger:
            break
        time.sleep(0.01)
        continue
    try:
        with open(f"/proc/{info.si_pid}/comm") as comm:
            name = comm.read().strip()
    except OSError:
        name = "?"
    pid, status, usage = os.wait4(info.si_pid, 0)
    reaped.append({"pid": pid, "comm": name, "cpu": usage.ru_utime + usage.ru_stime})
    if pid == top:
        ended, code = time.monotonic(), os.waitstatus_to_exitcode(status)
left = []
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/stat") as stat:
            head, fields = stat.read().rsplit(")", 1)
    except OSError:
        continue
    fields = fields.split()
    if entry.isdigit() and int(fields[1]) == os.getpid():
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        cpu = ticks / os.sysconf("SC_CLK_TCK")
        left.append({"pid": int(entry), "comm": head.split("(", 1)[1], "cpu": cpu})
with open(out, "w") as report:
    json.dump({"top": top, "seconds": ended - began, "returncode": code,
               "reaped": reaped, "left": left}, report)
sys.exit(code)
"""

# Run as `python -c HOOK OUT MODULE ARGS...`, in place of `python -m MODULE ARGS...`: the
# module runs as `__main__` as it would there, and at exit OUT holds the command line of
# every child it started and the CPU of each it reaped (user + system seconds, with what
# that child waited for). `subprocess` binds `os.waitpid` when it is imported, so the
# hook replaces it first.
HOOK = """\
import atexit, json, os, sys
out, module = sys.argv.pop(1), sys.argv.pop(1)
reaped, started, wait4 = {}, {}, os.wait4
def waitpid(pid, options):
    got, status, usage = wait4(pid, options)
    if got > 0:
        reaped[got] = usage.ru_utime + usage.ru_stime
    return got, status
os.waitpid = waitpid
import subprocess
start = subprocess.Popen.__init__
def popen(self, *args, **kwargs):
    start(self, *args, **kwargs)
    given = self.args if isinstance(self.args, (list, tuple)) else [self.args]
    started[self.pid] = [os.fsdecode(arg) for arg in given]
subprocess.Popen.__init__ = popen
def report():
    with open(out, "w") as stream:
        json.dump({"started": started, "reaped": reaped}, stream)
atexit.register(report)
import runpy
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

LINGER = 10.0  # seconds the runner waits for the tree's last processes after the command
UPLOADER_NAMES = ("wandb", "wandb-core")  # the uploader's executables (a command's name)
STANDBY_MARK = "from wandb.cli.cli import cli"  # in the code of wbmerge's uploader process


@dataclass
class Measured:
    """One command's wall seconds, exit code and CPU seconds: `own` is None for a command
    run without the hook (all of its CPU is then `uploader`); `left` counts processes that
    outlived it by `LINGER` seconds (their CPU so far is counted, read from /proc)."""

    seconds: float
    returncode: int
    own: float | None
    uploader: float
    left: int = 0


def is_uploader(argv: Sequence[str]) -> bool:
    """Whether a command line is the uploader's: `wandb`, wandb-core, or wbmerge's
    uploader process (a Python running wandb's command line)."""
    if not argv:
        return False
    if os.path.basename(argv[0]) in UPLOADER_NAMES:
        return True
    return len(argv) >= 3 and argv[1] == "-c" and STANDBY_MARK in argv[2]


def split(runner: Mapping, hook: Mapping | None) -> tuple[float | None, float]:
    """(own, uploader) CPU seconds of a tree from the runner's and the hook's reports
    (`RUNNER`, `HOOK`; None: all of the tree is the uploader's, own is None). JSON keeps
    the hook's pids as strings."""
    tree = runner["reaped"] + runner["left"]
    total = sum(process["cpu"] for process in tree)
    if hook is None:
        return None, total
    uploaders = {int(pid) for pid, argv in hook["started"].items() if is_uploader(argv)}
    uploader = sum(cpu for pid, cpu in hook["reaped"].items() if int(pid) in uploaders)
    # what the runner reaped or found running of the uploader's: its processes that
    # outlived their parent (wbmerge), and a wandb-core that outlived its own
    uploader += sum(
        process["cpu"]
        for process in tree
        if process["pid"] != runner["top"]
        and (process["pid"] in uploaders or process["comm"] in UPLOADER_NAMES)
    )
    return total - uploader, uploader


def run_measured(
    command: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    timeout: float,
    hooked: bool,
) -> tuple[Measured, str]:
    """Run `command` under the runner (and, `hooked`, a `python -m MODULE ...` command
    under the hook) and measure it; also returns what it wrote to stderr."""
    with tempfile.TemporaryDirectory(prefix="wbmerge-bench-cpu-") as tmp:
        runner_out, hook_out = Path(tmp, "runner.json"), Path(tmp, "hook.json")
        if hooked:
            if list(command[1:2]) != ["-m"]:
                raise ValueError(f"the hook runs a `python -m` command, not {command}")
            command = [command[0], "-c", HOOK, str(hook_out), *command[2:]]
        runner = [sys.executable, "-I", "-S", "-c", RUNNER, str(runner_out), str(LINGER)]
        done = subprocess.run(
            [*runner, *command],
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not runner_out.exists():
            raise RuntimeError(f"the runner failed:\n{done.stderr[-2000:]}")
        report = json.loads(runner_out.read_text())
        hook = json.loads(hook_out.read_text()) if hooked and hook_out.exists() else None
    if hooked and hook is None:
        raise RuntimeError(f"the hook wrote no report:\n{done.stderr[-2000:]}")
    own, uploader = split(report, hook)
    measured = Measured(report["seconds"], report["returncode"], own, uploader, len(report["left"]))
    return measured, done.stderr
