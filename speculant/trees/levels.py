"""Equal growth on the device (Yggdrasil, Guan et al. 2025, section 6: a tree's draft levels as one graph): the same
tree `trees.drafter.TreeDrafter` grows level by level from Python (where every level has `width` candidates of some
probability; a grammar's trees, which may have fewer, grow from Python), written as tensor operations of static shapes,
so that a backend can run all of a tree's levels as one compiled graph (one CUDA graph on a GPU) with no host work
and no host sync between them.

Every level chooses the `width` frontier candidates of highest path log-probability anywhere in the tree (a fixed
buffer of candidates, each level adding `width` x `width`: each new node's `width` likeliest children), then runs the
new nodes through the model as tree rows: each at its root's position plus its depth, reading its ancestors' keys in
depth order (`ancestors`, one row per node, scattered into the step's key index). Scores add in float64, as the
Python loop's floats do, so in eager mode both grow the same tree, up to the order of candidates of equal scores
(the loop sorts them by parent and token; `topk` leaves it to the device).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow(step: Step, root_logits: torch.Tensor, root: torch.Tensor, depth: int, width: int, rows: int,
         span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An equal-growth tree of `depth` levels of `width` nodes below a cached root: (tokens, parents, scores), 1 +
    depth x width nodes in the Python loop's order (node 0 the root), scores the nodes' path log-probabilities.

    `root_logits` [vocab] are the drafter's at the root, `root` (a 0-d long tensor) its position. `step(ids,
    positions, slots, index)` runs `rows` rows (the backend's static width; a level of more nodes runs in several
    steps, a level of fewer is padded: a padded row sits at position span + r, slot span + r) and returns their
    logits; `slots` and `index` are positions of the sequence's cache, `index[r, j]` where key j of row r is read
    from. Node n of the tree is written at slot root + n, so a depth-`depth` tree needs root + (depth - 1) x width
    positions of `span` (the caller checks). The last level is chosen, not run: its children would never be used.
    """
    device, long = root_logits.device, torch.long
    nodes, capacity = 1 + depth * width, width + (depth - 1) * width * width
    tokens = torch.zeros(nodes, dtype=long, device=device)
    parents = torch.full((nodes,), -1, dtype=long, device=device)
    scores = torch.zeros(nodes, dtype=torch.float64, device=device)
    depths = torch.zeros(nodes, dtype=long, device=device)
    # [n, d]: node n's ancestor at depth d, for d up to its own depth (past it: d, which leaves the index's identity)
    ancestors = torch.arange(depth, device=device).repeat(nodes, 1)
    frontier = torch.full((capacity,), float("-inf"), dtype=torch.float64, device=device)
    frontier_tokens = torch.zeros(capacity, dtype=long, device=device)
    frontier_parents = torch.zeros(capacity, dtype=long, device=device)
    values, ids = torch.log_softmax(root_logits.float(), -1).topk(width)
    frontier[:width], frontier_tokens[:width] = values.double(), ids
    columns = root + torch.arange(depth, device=device)  # the key index's columns of depths 0 .. depth - 1
    keys = torch.arange(span, device=device)
    filled = width
    for level in range(1, depth + 1):
        best = frontier.topk(width).indices  # in descending order, as the Python loop's sort
        new = 1 + (level - 1) * width + torch.arange(width, device=device)
        tokens[new], parents[new], scores[new] = frontier_tokens[best], frontier_parents[best], frontier[best]
        frontier.index_fill_(0, best, float("-inf"))  # (`frontier[best] = -inf` copies a host scalar: no CUDA graph)
        if level == depth:
            break
        depths[new] = depths[parents[new]] + 1
        ancestors[new] = ancestors[parents[new]].scatter(1, depths[new][:, None], new[:, None])
        logits = []
        for at in range(0, width, rows):
            chunk, pad = new[at:at + rows], torch.arange(min(width - at, rows), rows, device=device)
            index = keys.repeat(rows, 1)
            index[:len(chunk)] = index[:len(chunk)].scatter(1, columns.expand(len(chunk), depth),
                                                            root + ancestors[chunk])
            logits.append(step(torch.cat([tokens[chunk], torch.zeros_like(pad)]),
                               torch.cat([root + depths[chunk], span + pad]),
                               torch.cat([root + chunk, span + pad]), index)[:len(chunk)])
        values, ids = torch.log_softmax(torch.cat(logits).float(), -1).topk(width)  # [width, width]
        frontier[filled:filled + width * width] = (scores[new][:, None] + values.double()).flatten()
        frontier_tokens[filled:filled + width * width] = ids.flatten()
        frontier_parents[filled:filled + width * width] = new.repeat_interleave(width)
        filled += width * width
    return tokens, parents, scores
