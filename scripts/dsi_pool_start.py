"""Seconds a DSI process pool takes to start (`ProcessExecutor.start`: every server process up with its model) on a
tiny transformers model, for pools of 1 and 3 servers one after another in one process, optionally pinned to one
core as a test worker is: `python scripts/dsi_pool_start.py [--one-core]`. Run it with PYTHONPATH set to another
checkout to time that commit's executor on the same machine."""

import argparse
import os
import time
from functools import partial

from transformers import LlamaConfig, LlamaForCausalLM

from speculant.config import SamplingConfig
from speculant.decoding.dsi import executors
from speculant.models.backends.hf import hf_replica

if __name__ == "__main__":  # (server processes import this file again where they are spawned)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--one-core", action="store_true")
    if parser.parse_args().one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    for servers in (1, 3):
        spec = executors.ServerSpec(partial(hf_replica, model, "tiny", frozenset()), ["cpu"] * servers,
                                    SamplingConfig())
        pool = executors.make_executor("process", spec)
        start = time.perf_counter()
        pool.start()
        print(f"{servers} servers: {time.perf_counter() - start:.2f} s ({executors.__file__})", flush=True)
        pool.close()
