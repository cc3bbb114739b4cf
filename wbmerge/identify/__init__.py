"""Discovery and identification: offline runs -> ranks -> jobs.

`discover` finds the offline runs under the paths a user names and groups them into jobs;
`offlinerun` reads what one run says about itself; `rankclaims` (pure) turns a label,
name, config, command line, SLURM task or GPU into a claim of a rank, `jobs` (pure)
decides which runs make a job and which claims to believe, and `placement` (pure) turns a
job's claims into ranks, local ranks and workers. `hints` is the user's own word
(`--label-pattern`, `--ranks`, `--primary`), `merged` knows the runs a merge wrote, and
`inspection` is the `inspect` command's report.
"""
