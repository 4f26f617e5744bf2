"""Benchmark harness: prompt sets, a method matrix run interleaved on one loaded target, summaries."""

MOST_RESULTS_BYTES = 1 << 28  # the size of a results file read back at most (bench's results.json, bench-serve's
# results.jsonl)
