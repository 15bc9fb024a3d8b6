"""`mlxspec bench`: mlx-lm and mlxspec side by side, same prompts, same greedy settings.

suites.py   the shipped prompt suites and the user's own JSONL
methods.py  what can be benchmarked (plain-mlx-lm, mlx-lm-speculative, mlxspec:...)
runners.py  one timed generation of one method
run.py      the interleaved schedule, warm-up and calibration, lossless checks
rows.py     runs -> table rows (medians, speedups) and per-class summaries
machine.py  the machine section and the memory-bandwidth roofline
report.py   JSON and markdown; plot.py the optional PNG chart
"""


class BenchError(ValueError):
    """A bench request that cannot run (bad prompts file, unknown method): one line."""
