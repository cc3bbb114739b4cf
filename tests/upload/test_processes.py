"""Which processes are below the uploader: read from the kernel's lists of children, the
same as a walk of all of /proc finds, threads' children and grandchildren included."""

from __future__ import annotations

import subprocess
import sys
import time

from wbmerge.upload.processes import descendants, walked_descendants

# A child that starts a sleeper from a second thread (listed under that thread, not the
# main one) and a grandchild that starts a sleeper of its own, then prints "ready".
TREE = """
import subprocess, sys, threading
started = threading.Event()
def sleeper():
    subprocess.Popen(["sleep", "60"])
    started.set()
    threading.Event().wait()  # (alive: its child stays listed under it)
threading.Thread(target=sleeper, daemon=True).start()
started.wait()
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(['sleep', '60']); print('up', flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
)
grandchild.stdout.readline()
print("ready", flush=True)
sys.stdin.read()
"""


def test_descendants_are_every_process_below_as_a_walk_of_proc_finds_them():
    child = subprocess.Popen(
        [sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        found = descendants(child.pid)
        assert len(found) == 3, found  # (the thread's sleeper, the grandchild, its sleeper)
        assert sorted(found) == sorted(walked_descendants(child.pid))
    finally:
        for pid in {*descendants(child.pid), *walked_descendants(child.pid)}:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        child.kill()
        child.wait()
        time.sleep(0.05)
