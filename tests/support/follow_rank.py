"""One rank of a small job for the follow tests: logs offline with wbmerge.init, paced.

    python tests/support/follow_rank.py STEPS PACE [--crash-at STEP] [--kill-at STEP]

The rank comes from torchrun's variables in the environment. At step s it logs
`loss = rank + s / 1000` (so a test can check every value it finds), prints a console line
every 10 steps, and sleeps PACE seconds. `--crash-at` raises at that step (wandb records
exit code 1); `--kill-at` SIGKILLs the process there (no exit record, as an OOM kill).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import wbmerge


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("pace", type=float)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--flush-every", type=float, default=0.3)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    run = wbmerge.init(project="follow", flush_every=args.flush_every)
    for step in range(args.steps):
        if step == args.crash_at:
            raise RuntimeError(f"rank {rank} crashes at step {step}")
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        run.log({"loss": rank + step / 1000})
        if step % 10 == 0:
            print(f"rank {rank} at step {step}", flush=True)
        time.sleep(args.pace)
    run.finish()


if __name__ == "__main__":
    main()
