"""Benchmark harness: prompt sets, a method matrix run interleaved on one loaded target, summaries."""

MOST_RESULTS_BYTES = 1 << 28  # a results file's (bench's results.json, bench-serve's results.jsonl), read back
