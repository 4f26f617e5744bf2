"""Distributed speculative inference (speculation parallelism): engine, executors, latency twin, planning."""
