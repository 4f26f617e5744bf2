"""How often a requantized copy of the 1.5B picks the same next token as the packaged Q4_K_M (docs/results/cpu.md,
"Q4_0, where ggml's tinyBLAS applies").

    python scripts/q4_0_agreement.py                     # Q4_0 (ftype 2) against Q4_K_M
    python scripts/q4_0_agreement.py --ftype 7           # Q8_0
    python scripts/q4_0_agreement.py --results docs/results/bench-core-humaneval/results.json

Requantizes the catalog GGUF once with llama-cpp-python's `llama_model_quantize` (`allow_requantize`), loads both
on speculant's llama.cpp backend, and teacher-forces `ar`'s outputs from bench result files (first repeat of each
prompt): at every position, whether the two models' argmax agree. Prints the share and the number of positions per
results file. Why: ggml's tinyBLAS makes Q4_0 verification flatter than Q4_K_M's, and this measures what that
format costs in quality. The page's numbers were counted on the `ar` outputs of bench-learned-*, removed from the
tree since (git keeps them at 7dd390a).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

DEFAULT_RESULTS = ["docs/results/bench-core-humaneval/results.json", "docs/results/bench-core-mixed/results.json"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ftype", type=int, default=2, help="llama.cpp's file type: 2 Q4_0, 7 Q8_0")
    parser.add_argument("--out", default="/tmp/requantized.gguf")
    parser.add_argument("--results", nargs="+", default=DEFAULT_RESULTS,
                        help="bench results.json files whose ar rows are teacher-forced")
    parser.add_argument("--source", default=os.path.expanduser("~/.cache/speculant/models/qwen2.5-coder-1.5b-gguf/"
                                                               "model.gguf"), help="the Q4_K_M GGUF")
    args = parser.parse_args(argv)

    import llama_cpp

    from speculant.api import encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.models.loading import load_gguf

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = args.ftype, True
    llama_cpp.llama_model_quantize(args.source.encode(), args.out.encode(), ctypes.byref(params))
    a = load_gguf("qwen2.5-coder-1.5b")
    b = load_gguf(args.out, tokenizer=a.tokenizer)
    for path in args.results:
        data = json.load(open(path))
        config = data["config"]
        prompts = {p.id: p for p in load_dataset(config["prompts"] or config["dataset"])}
        same = total = 0
        for r in (r for r in data["rows"] if r["method"] == "ar" and r["repeat"] == 0):
            p, n = prompts[r["prompt_id"]], len(r["token_ids"])
            ids, picks = encode_prompt(a.tokenizer, p.text, p.chat) + r["token_ids"], []
            for m in (a, b):
                m.prefill(ids[:-n])
                picks.append(m.forward(ids[-n:-1]).argmax(-1))
            same, total = same + int((picks[0] == picks[1]).sum()), total + n - 1
        print(path, f"{same / total:.3f}", total)


if __name__ == "__main__":
    main(sys.argv[1:])
