"""Pure verification of a drafted chain: tensors in, (n_accepted, next_token) out.

Notation of the papers: p = target distribution, q = draft distribution. Of k drafted tokens the
first n are *accepted*; the token after them is either *recovered* (resampled from the residual
after a rejection) or the *bonus* token (drawn from the target after all k were accepted).
"""

from __future__ import annotations

import torch

from speculant.sampling import sample
from speculant.tree import TokenTree


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: the longest prefix of `draft` that matches the target's argmax.

    draft [k] token ids; target_logits [k + 1, vocab], row i scoring the position after draft[:i].
    Returns the accepted count n and the target's own token after it (its argmax at row n).
    """
    target_tokens = target_logits.argmax(-1)  # [k + 1]
    k = draft.shape[0]
    n = int((draft == target_tokens[:k]).int().cumprod(0).sum())
    return n, int(target_tokens[n])


def verify_sampling(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    draft [k] tokens drawn from q; p [k + 1, vocab] target probabilities; q [k, vocab] draft
    probabilities, or None for a deterministic drafter (q is then one-hot on the drafted token).
    Token i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
    recovered token is drawn from norm(max(0, p_i - q_i)); after k acceptances the bonus token is
    drawn from p_k. The emitted tokens are then distributed exactly as under p.
    """
    k = draft.shape[0]
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft]  # [k]
    q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)
    r = torch.rand(k, generator=generator, device=p.device)
    rejected = (r * q_x >= p_x).nonzero()  # accept iff r < p/q, i.e. with probability min(1, p/q)
    if rejected.numel() == 0:
        return k, sample(p[k], generator)
    n = int(rejected[0])
    if q is not None:
        residual = (p[n] - q[n]).clamp_min(0)
    else:
        residual = p[n].clone()
        residual[draft[n]] = 0.0
    total = residual.sum()
    # p <= q everywhere only when p == q, where rejection has probability 0: guard rounding anyway.
    return n, sample(residual / total if total > 0 else p[n], generator)


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy tree verification: from the root, follow the child whose token is the target's argmax.

    target_logits [len(tree), vocab], row i scoring the position after node i. Returns the accepted
    nodes (root excluded) along the longest such path, and the target's token after its last node.
    """
    target_tokens = target_logits.argmax(-1).tolist()
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tree)):
        children.setdefault(tree.parents[node], {}).setdefault(tree.tokens[node], node)
    path, node = [], 0
    while (child := children.get(node, {}).get(target_tokens[node])) is not None:
        path.append(child)
        node = child
    return path, target_tokens[node]
