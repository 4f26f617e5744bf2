"""Pure verification of a drafted chain: tensors in, (n_accepted, next_token) out.

Notation of the papers: p = target distribution, q = draft distribution. Of k drafted tokens the
first n are *accepted*; the token after them is either *recovered* (resampled from the residual
after a rejection) or the *bonus* token (drawn from the target after all k were accepted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculant.sampling import sample, uniform
from speculant.trees.tree import TokenTree


def verify_greedy(
    draft: Sequence[int],
    target_logits: torch.Tensor,
    leniency: float = 1.0,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Greedy verification: the longest prefix of `draft` that matches the target's argmax.

    draft: k token ids; target_logits [k + 1, vocab], row i scoring the position after draft[:i].
    Returns the accepted count n and the target's own token after it (its argmax at row n).

    With `leniency` l > 1 (CS Drafting, section 3.1; inner reviews of a cascade only, never the
    target's) a token that is not the argmax is accepted too when l * p(x) > q(x), with p the
    reviewer's softmax and q(x) `draft_probs` [k], the drafter's probability of its token (1 if None).

    Without leniency the target's tokens are read back once and compared on the host with the draft (on a GPU,
    the step's only sync).
    """
    target_tokens = target_logits.argmax(-1)  # [k + 1]
    k = len(draft)
    if leniency > 1 and k:
        drafted = torch.tensor(draft, dtype=torch.long, device=target_logits.device)
        p_x = torch.softmax(target_logits[:k], -1).gather(-1, drafted[:, None])[:, 0]
        q_x = draft_probs if draft_probs is not None else torch.ones_like(p_x)
        accepted = (drafted == target_tokens[:k]) | (leniency * p_x > q_x)
        n = int(accepted.int().cumprod(0).sum())
        return n, int(target_tokens[n])
    wanted = target_tokens.tolist()
    n = next((i for i, (token, target_token) in enumerate(zip(draft, wanted)) if token != target_token), k)
    return n, wanted[n]


def verify_sampling(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    leniency: float = 1.0,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    draft [k] tokens drawn from q; p [k + 1, vocab] target probabilities; q [k, vocab] draft
    probabilities, or None for a deterministic drafter (q is then one-hot on the drafted token).
    Token i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
    recovered token is drawn from norm(max(0, p_i - q_i)); after k acceptances the bonus token is
    drawn from p_k. The emitted tokens are then distributed exactly as under p.

    `leniency` l >= 1 (CS Drafting, section 3.1) accepts with probability min(1, l p / q) and
    recovers from norm(max(0, p - min(q, l p))); the emitted tokens then follow
    `lenient_distribution(p, q, l)`, not p, so only a cascade's inner reviews may be lenient.
    """
    k = draft.shape[0]
    draft = draft.to(p.device)
    q = q.to(p.device) if q is not None else None  # a drafter may live on another device
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft]  # [k]
    q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)
    r = uniform((k,), generator, p.device)
    rejected = (r * q_x >= leniency * p_x).nonzero()  # accept iff r < l p / q
    if rejected.numel() == 0:
        return k, sample(p[k], generator)
    n = int(rejected[0])
    return n, recover(p[n], q[n] if q is not None else None, int(draft[n]), generator, leniency)


def verify_block(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                 generator: torch.Generator | None) -> tuple[int, int]:
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", Alg. 2): the
    draft judged as a whole, which accepts at least as many tokens as token-by-token verification in expectation
    (their Theorem 2: optimal among valid verifiers) and emits the tokens with the target's distribution.

    draft [k] drawn from q; p [k + 1, vocab] and q [k, vocab] (None: one-hot on the draft) as `verify_sampling`.
    With w_0 = 1 and w_i = min(w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i), 1) (line 4), the residual mass after i tokens
    R_i = sum_x max(w_i p_i(x) - q_i(x), 0) and h_i = R_i / (R_i + 1 - w_i) for i < k, h_k = w_k (line 5), the
    block keeps its longest prefix i whose draw eta_i <= h_i (none: 0); the next token is drawn from p_k after the
    whole block, else from norm(max(w_i p_i - q_i, 0)) (lines 10-11)."""
    k = draft.shape[0]
    draft = draft.to(p.device)
    q = one_hot(draft, p.shape[-1]) if q is None else q.to(p.device)
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, draft] / q[rows, draft]  # q of a drawn token is never 0
    weights = [1.0]
    for value in ratio.tolist():
        weights.append(min(weights[-1] * value, 1.0))
    w = torch.tensor(weights, dtype=p.dtype, device=p.device)  # [k + 1]
    residual = (w[:k, None] * p[:k] - q).clamp_min(0)  # [k, vocab]
    mass = residual.sum(-1)  # R_0 .. R_{k-1}
    denominator = mass + 1 - w[:k]
    h = torch.where(denominator > 0, mass / denominator.clamp_min(1e-30), torch.ones_like(mass))
    h = torch.cat([h[1:], w[k:]])  # h_1 .. h_k
    kept = (uniform((k,), generator, p.device) < h).nonzero()  # (P = h; a draw of 0 keeps no h of 0: a p(x) of 0)
    n = int(kept[-1]) + 1 if kept.numel() else 0
    if n == k:
        return k, sample(p[k], generator)
    total = mass[n]
    return n, sample(residual[n] / total if total > 0 else p[n], generator)


def recover(p: torch.Tensor, q: torch.Tensor | None, rejected: int, generator: torch.Generator | None,
            leniency: float = 1.0) -> int:
    """The token emitted after rejecting draft token `rejected`: drawn from norm(max(0, p - min(q, l p))),
    with q one-hot on `rejected` when None. p, q [vocab] at one position."""
    if q is None:  # one-hot q: min(q, l p) covers p at the drafted token (l >= 1) and nothing elsewhere
        residual = p.clone()
        residual[rejected] = 0.0
    else:
        residual = (p - torch.minimum(q, leniency * p)).clamp_min(0)
    total = residual.sum()
    # p <= q everywhere only when p == q, where rejection has probability 0: guard rounding anyway.
    return sample(residual / total if total > 0 else p, generator)


def verify_one(draft: int, p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None) -> int:
    """Speculative sampling at one position (p, q [vocab]; q None for a deterministic draft): the draft
    token when accepted, with probability min(1, p(x) / q(x)), else the recovered token. As used by DSI,
    where each position is decided on its own as soon as a target server's row for it arrives."""
    q = q.to(p.device) if q is not None else None
    q_x = float(q[draft]) if q is not None else 1.0
    if float(uniform((), generator, p.device)) * q_x < float(p[draft]):
        return draft
    return recover(p, q, draft, generator)


def lenient_distribution(p: torch.Tensor, q: torch.Tensor, leniency: float) -> torch.Tensor:
    """What one lenient review emits when the draft token comes from q: the accepted mass
    A = min(q, l p) plus the rejected mass (1 - sum A) spread as norm(max(0, p - A)); p itself when
    l = 1. p, q [..., vocab]. A cascade hands this to the next reviewer as the draft distribution."""
    if leniency == 1:
        return p
    accepted = torch.minimum(q, leniency * p)
    residual = (p - accepted).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
    return accepted + (1 - accepted.sum(-1, keepdim=True)) * residual


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The distribution of a deterministic drafter: [k] tokens -> [k, vocab]."""
    return torch.zeros(tokens.shape[0], vocab, device=tokens.device).scatter_(-1, tokens[:, None], 1.0)


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy tree verification: from the root, follow the child whose token is the target's argmax.

    target_logits [len(tree), vocab], row i scoring the position after node i. Returns the accepted
    nodes (root excluded) along the longest such path, and the target's token after its last node.
    """
    target_tokens = target_logits.argmax(-1).tolist()
    path, node = [], 0
    while True:
        wanted = target_tokens[node]
        child = next((c for c in tree.child_lists[node] if tree.tokens[c] == wanted), None)
        if child is None:
            return path, wanted
        path.append(child)
        node = child


def verify_tree_sampling(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless sampling over a tree whose children are chosen deterministically (multi-draft
    speculative sampling, SpecInfer Alg. 2, with one-hot drafts; Yggdrasil section 4.1).

    p [len(tree), vocab] holds the target's distribution after each node. At a node, its children are
    tried in order: child x is accepted with probability r(x), r the residual distribution (first p
    itself); a rejected child is removed from r (r <- norm(max(0, r - onehot(x)))) before the next one
    is tried. If one is accepted the walk moves to it; if none is, the token is drawn from r. Each
    emitted token is then distributed exactly as under p, whatever the tree.

    The walk runs on the host from one transfer: the children's probabilities and a uniform draw per child (a
    child is tried at most once); removing rejected children x_1..x_j from a row of p (a distribution: its total is
    1) leaves the residual's total at 1 - sum_i p(x_i). Only the last node's residual is built, for the final draw.
    """
    edges = [(node, child) for node, children in enumerate(tree.child_lists) for child in children]
    rows = torch.tensor([node for node, _ in edges], dtype=torch.long, device=p.device)
    tokens = torch.tensor([tree.tokens[child] for _, child in edges], dtype=torch.long, device=p.device)
    mass, draws = torch.stack([p[rows, tokens].double(), uniform((len(edges),), generator, p.device)]).tolist()
    edge_of = {child: i for i, (_, child) in enumerate(edges)}
    path, node = [], 0
    while True:
        total, removed = 1.0, []
        for child in tree.child_lists[node]:
            token, i = tree.tokens[child], edge_of[child]
            left = 0.0 if token in removed else mass[i]  # a sibling's token already removed has no mass left
            if total > 0 and draws[i] * total < left:
                break
            total -= left
            removed.append(token)
        else:
            residual = p[node]
            if removed:  # `sample` draws in proportion: the residual needs no normalizing
                residual = residual.clone()
                residual[removed] = 0.0
                if not residual.sum() > 0:  # rejected children that held all the mass: only by rounding
                    residual = p[node]
            return path, sample(residual, generator)
        path.append(child)
        node = child
