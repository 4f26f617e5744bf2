"""Seconds to read a GGUF file's metadata and tensor table with `speculant.models.gguf_header.GGUFFile` and with gguf's
own `GGUFReader` (the lean backend's first load of a model reads it), and what the two read differently
(`same_as_gguf_reader`), for each file named:
`python scripts/gguf_read_time.py ~/.cache/speculant/models/qwen2.5-coder-1.5b-gguf/model.gguf`."""

import argparse
import time

from gguf import GGUFReader

from speculant.models.gguf_header import GGUFFile, same_as_gguf_reader

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("paths", nargs="+")
for path in parser.parse_args().paths:
    start = time.perf_counter()
    GGUFFile(path)
    middle = time.perf_counter()
    GGUFReader(path)
    end = time.perf_counter()
    print(f"{path}: GGUFFile {middle - start:.2f} s, GGUFReader {end - middle:.2f} s; read differently: "
          f"{same_as_gguf_reader(path) or 'nothing'}")
