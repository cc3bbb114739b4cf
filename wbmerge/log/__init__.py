"""The bytes of a `.wandb` file: framing, records, items, steps (the first stage's input).

`txlog` frames a transaction log (7-byte header, 32 KiB blocks of CRC-checked chunks) and
never looks inside a record; its block walk is compiled (`_walk.c`) with a Python twin
(`purewalk`). `proto` loads wandb's `Record` classes, `records` says what each payload is,
`wire` and `items` read history and summary items as bytes and as columns, and `steps` is
the step rule that merge, export and report share. Nothing here knows ranks, jobs or
servers: every later stage reads logs through this package.
"""
