"""Seconds to read a GGUF file's metadata and tensor table with `speculant.models.gguf_file.GGUFFile` and with gguf's
own `GGUFReader` (the lean backend's first load of a model reads it), and whether both give the same fields and
tensors: `python scripts/gguf_read_time.py ~/.cache/speculant/models/qwen2.5-coder-1.5b-gguf/model.gguf`."""

import argparse
import time

import numpy as np
from gguf import GGUFReader

from speculant.models.gguf_file import GGUFFile

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("paths", nargs="+")
for path in parser.parse_args().paths:
    start = time.perf_counter()
    ours = GGUFFile(path)
    middle = time.perf_counter()
    theirs = GGUFReader(path)
    end = time.perf_counter()
    fields = ours.fields == {key: field.contents() for key, field in theirs.fields.items()
                             if not key.startswith("GGUF.")}
    tensors = len(ours.tensors) == len(theirs.tensors) and all(
        (a.name, a.tensor_type, a.data_offset, a.n_bytes) == (b.name, b.tensor_type, b.data_offset, b.n_bytes)
        and np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    print(f"{path}: GGUFFile {middle - start:.2f} s, GGUFReader {end - middle:.2f} s; same fields {fields}, same "
          f"{len(ours.tensors)} tensors {tensors}")
