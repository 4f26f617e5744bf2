"""Seconds FR-Spec's prose counts take to compute (`corpus.prose_counts`, paid once per tokenizer and machine) for a
catalog model's tokenizer, in a throwaway cache, and a digest of the counts (the same digest: the same counts):
`python scripts/prose_counts_time.py qwen2.5-coder-0.5b`. Run it with PYTHONPATH set to another checkout to time
that commit's counting on the same machine."""

import argparse
import hashlib
import os
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("model")
name = parser.parse_args().model
with tempfile.TemporaryDirectory() as cache:
    from speculant import corpus, load_model

    tokenizer = load_model(f"{name}@gguf").tokenizer  # (the packaged model's cache is read before the switch)
    os.environ["SPECULANT_CACHE"] = cache
    start = time.perf_counter()
    counts = corpus.prose_counts(tokenizer, len(tokenizer))
    seconds = time.perf_counter() - start
print(f"{name}: {seconds:.1f} s, counts {hashlib.sha256(counts.tobytes()).hexdigest()[:12]} ({corpus.__file__})")
