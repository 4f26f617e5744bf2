"""Seconds a machine profile takes to measure (`latency._measure`, what a model's first run on a machine pays), for
catalog models on their default backend: `python scripts/profile_time.py qwen2.5-coder-0.5b qwen2.5-coder-1.5b`.
Run it with PYTHONPATH set to another checkout to time that commit's profile on the same machine."""

import argparse
import time

from speculant import latency, load_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("models", nargs="+")
for name in parser.parse_args().models:
    model = load_model(name)
    start = time.perf_counter()
    latency._measure(model, repeats=3, progress=False)
    print(f"{name}: {time.perf_counter() - start:.1f} s ({latency.__file__})", flush=True)
    del model
