"""One speculation step, shared by every speculative decoder (`sd`, `cascade`, `tree`, `auto`): the target runs the
last committed token and a draft (a chain, or a token tree with tree attention) in one forward, the verifier keeps
the accepted prefix and one target token (corrected where a draft token was rejected, the bonus token where none
was), and the target's cache keeps exactly what was accepted (rolled back, or a tree compacted to its path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.config import SamplingConfig
from speculant.drafters.base import Draft
from speculant.models.base import CausalLM
from speculant.sampling import logits_to_probs, next_token
from speculant.trees.tree import TokenTree
from speculant.verify import verify_block, verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


@dataclass(frozen=True)
class Verified:
    """What one step committed: the `accepted` draft tokens, then the target's `token`; `drafted` the draft's
    length (a tree's depth), `width` the tokens the target's forward ran; for a tree, `logits` at its last accepted
    node (what the target's `token` was chosen from) and, where the backend gives it (`hidden_states`), the target's
    last hidden state there (what Yggdrasil's depth predictor reads)."""

    accepted: list[int]
    token: int
    drafted: int
    width: int
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        return self.accepted + [self.token]


def verify_step(target: CausalLM, last: int, draft: Draft, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Verified:
    """Verify `draft` (after the last committed token `last`) in one target forward: a chain or a tree."""
    if draft.tree is not None:
        path, token, logits = verify_tree(target, draft.tree, sampling, generator)
        hidden = target.last_hidden[path[-1] if path else 0] if target.capabilities.hidden_states else None
        return Verified([draft.tree.tokens[node] for node in path], token, max(draft.tree.depths), len(draft.tree),
                        logits, hidden)
    n, token = verify_draft(target, last, draft, sampling, generator)
    return Verified(draft.tokens[:n], token, len(draft.tokens), 1 + len(draft.tokens))


def verify_draft(target: CausalLM, last: int, draft: Draft, sampling: SamplingConfig,
                 generator: torch.Generator | None) -> tuple[int, int]:
    """One target forward over the last committed token and the draft, then verification: (accepted count,
    the target's token after them). The target's cache keeps `last` and the accepted drafts. An empty draft is a
    plain decoding step, run as `ar` runs it: nothing to verify, roll back or copy to the device (on a GPU, where a
    forward takes a few ms, that work is not noise)."""
    if not draft.tokens:
        return 0, next_token(target.forward([last])[-1], sampling, generator)
    cached = target.cache_len
    target_logits = target.forward([last, *draft.tokens])  # [1 + len(draft), vocab]
    if sampling.greedy:
        n, token = verify_greedy(draft.tokens, target_logits)
    else:
        drafted = torch.tensor(draft.tokens, dtype=torch.long, device=target.device)
        q = draft.probs.to(target.device) if draft.probs is not None else None
        verify = verify_block if sampling.verifier == "block" else verify_sampling
        n, token = verify(drafted, logits_to_probs(target_logits, sampling), q, generator)
    target.rollback(cached + 1 + n)
    return n, token


def verify_tree(target: CausalLM, tree: TokenTree, sampling: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], int, torch.Tensor]:
    """One target forward over a tree rooted at the last committed token, with tree attention, then tree
    verification: (accepted nodes, the target's token after them, the logits it was chosen from). The
    target's cache keeps the root and the accepted path."""
    cached = target.cache_len
    target_logits = target.forward(list(tree.tokens), tree=tree)  # [len(tree), vocab]
    if sampling.greedy:
        path, token = verify_tree_greedy(tree, target_logits)
    else:
        path, token = verify_tree_sampling(tree, logits_to_probs(target_logits, sampling), generator)
    target.keep(cached, [cached + node for node in [0, *path]])
    return path, token, target_logits[path[-1] if path else 0]


def until_eos(draft: Draft, eos: frozenset[int]) -> Draft:
    """The draft up to its first end-of-sequence token: nothing after it could ever be committed."""
    stop = next((i for i, token in enumerate(draft.tokens) if token in eos), None)
    if stop is None or stop == len(draft.tokens) - 1:
        return draft
    probs = draft.probs[: stop + 1] if draft.probs is not None else None
    return Draft(draft.tokens[: stop + 1], probs, draft.usage)
