"""Benchmark harness: prompt sets, a method matrix run interleaved on one loaded target, summaries."""
