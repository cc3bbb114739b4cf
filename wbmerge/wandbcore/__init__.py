"""What wandb's uploader (wandb-core) makes of a log: the rows, lines and files a server ends
with.

wbmerge verifies every upload against what the ranks wrote, so it must know what wandb-core
will send of a log: `sentrows` the `_step` it sends each history row at, `terminal` a port
of its terminal emulator (the console lines and `output.log` it makes), and `content` the
counts of a whole log a read at a time. All of it is pure: it reads logs, never a server.
"""
