"""Looking at a job's runs without uploading them: columns, Parquet export, per-rank report.

`columns` reads one rank's values as columns, `export` writes every value of a job to one
Parquet file, `report` (with `report_format`) answers which rank is slow and by how much,
and `spread` is the one definition of a metric's spread across ranks, which the shared
merge's `--skew-metrics` uses too.
"""
