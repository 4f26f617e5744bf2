"""Seconds of one tree verification at temperature > 0 (`verify_tree_sampling`) and of one draw (`sample`), the host
work a sampled step pays after the target's forward (CHANGELOG, "Bounded caches, tree sampling verification from one
transfer").

    python scripts/verify_cost.py --vocab 151936 --widths 2 4 --depth 4 [--device cuda]

For each width: an equal-growth-like tree of that width and depth (every node's `width` children on the first
level, one child after), target distributions under which a lone child is accepted about half the time, and the
median seconds of `--repeats` verifications, in us; then the median of `--repeats` draws from one such row."""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def tree_of(width: int, depth: int, vocab: int):
    """The root's `width` children, then a chain of depth - 1 under each: 1 + width * depth nodes."""
    from speculant.trees.tree import TokenTree

    tokens, parents = [0], [-1]
    for branch in range(width):
        parent = 0
        for level in range(depth):
            tokens.append((97 * (branch + 1) + 13 * level) % vocab)
            parents.append(parent)
            parent = len(tokens) - 1
    return TokenTree(tuple(tokens), tuple(parents))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--widths", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    import torch

    from speculant.sampling import sample, seeded
    from speculant.verify import verify_tree_sampling

    device = torch.device(args.device)
    generator = seeded(device, 0)
    for width in args.widths:
        tree = tree_of(width, args.depth, args.vocab)
        logits = torch.randn(len(tree), args.vocab, generator=generator, device=device)
        for node, children in enumerate(tree.child_lists):
            for child in children:
                logits[node, tree.tokens[child]] += 12  # e^12 ~ the vocabulary: a lone child accepted half the time
        p = torch.softmax(logits, -1)
        seconds = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            verify_tree_sampling(tree, p, generator)
            seconds.append(time.perf_counter() - began)
        print(f"{len(tree)} nodes (width {width}, depth {args.depth}), vocab {args.vocab}: "
              f"{statistics.median(seconds) * 1e6:.0f} us")
    seconds = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        sample(p[0], generator)  # (on a GPU, its read-back waits for it)
        seconds.append(time.perf_counter() - began)
    print(f"a draw, vocab {args.vocab}: {statistics.median(seconds) * 1e6:.0f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
