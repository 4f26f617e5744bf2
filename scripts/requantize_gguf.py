"""Write a copy of a GGUF whose Q4_K matrices are quantized again as another type (Q5_K by default), everything else
(metadata, tokenizer, the other tensors) as it is: a Q5_K_M-like file of a catalog model, for timing the lean
backend against llama.cpp on the types users bring when no model hub is reachable (docs/results/lean-types/).

    python scripts/requantize_gguf.py IN.gguf OUT.gguf [--type Q5_K]

The weights are the Q4_K ones de-quantized (`gguf.quants.dequantize`), so the copy is no better a model; its
matrices have the target type's layout and size, which is what decides the speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q5_K", choices=("Q5_K",))
    args = parser.parse_args(argv)

    import gguf
    import numpy as np

    from speculant.kernels.formats import quantize_q5_k

    reader = gguf.GGUFReader(args.source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.out, arch=arch, endianess=reader.endianess)
    target = gguf.GGMLQuantizationType[args.type]
    tensors = []
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if kind == gguf.GGMLQuantizationType.Q4_K:
            weights = gguf.quants.dequantize(data, kind).astype(np.float32)
            data, kind = quantize_q5_k(weights.reshape(-1, weights.shape[-1])), target
        tensors.append((tensor.name, data, kind))
    for field in reader.fields.values():  # the metadata as it is (gguf's own scripts/gguf_new_metadata.py does so)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    print(f"wrote {args.out}: {sum(k == target for _, _, k in tensors)} matrices as {args.type}")


if __name__ == "__main__":
    main(sys.argv[1:])
