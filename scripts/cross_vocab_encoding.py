"""The cost per decoding step of re-tokenizing the target's text for a drafter with another tokenizer, whole
against incremental (docs/results/cross-vocab.md, "Encoding only the new text").

    python scripts/cross_vocab_encoding.py

SmolLM2-135M's tokenizer encodes the Qwen 1.5B's tokens of this repository's speculant/decoding/adaptive.py and
README.md, contexts growing from 300 to 1,200 tokens two tokens a step, once whole (`VocabPair.drafter_ids`) and
once with `drafters.vocab.GrowingEncoding` (which re-encodes only from the last word boundary before the change);
prints the mean ms per step of each and how many incremental encodings equal the whole ones. Why: a
cross-vocabulary drafter (Timor et al. 2025) re-tokenizes the context every step, so its cost grows with the
context unless only the new text is encoded.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=int, default=300)
    parser.add_argument("--end", type=int, default=1200)
    args = parser.parse_args(argv)

    from speculant.drafters.spec import load_drafter
    from speculant.drafters.vocab import GrowingEncoding, vocab_pair
    from speculant.models import load_model

    target = load_model("qwen2.5-coder-1.5b")
    pair = vocab_pair(target, load_drafter("smollm2-135m", target), {})
    text = open("speculant/decoding/adaptive.py").read() + open("README.md").read()
    ids = target.tokenizer.encode(text)[:args.end]
    growing, whole, spliced, same, steps = GrowingEncoding(pair), 0.0, 0.0, 0, 0
    for end in range(args.start, args.end, 2):  # two tokens more each step
        if (context := pair.text(ids[:end])) is None:
            continue
        a = time.perf_counter()
        w = pair.drafter_ids(context)
        b = time.perf_counter()
        g = growing.encode(context)
        whole, spliced, same, steps = whole + b - a, spliced + time.perf_counter() - b, same + (w == g), steps + 1
    print(f"{steps} steps: whole {whole / steps * 1e3:.3f} ms, incremental {spliced / steps * 1e3:.3f} ms, "
          f"{same} equal")


if __name__ == "__main__":
    main(sys.argv[1:])
