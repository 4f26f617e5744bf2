"""Yggdrasil's depth predictor (Guan et al. 2025): before a tree is drafted, a small MLP predicts
how many of its levels the target will accept, and the depth that maximizes the latency-aware objective
(expected accepted tokens per second of drafting and verification, Eq. 3) is drafted in one go, instead of
deciding after every drafting step whether another pays.

The MLP reads the target's distribution at the last committed token (its top two probabilities and its
entropy) and the per-level acceptance of the last few trees, rather than the target's hidden state: every
backend has these (llama.cpp exposes no hidden state without a second context), and four numbers train
from a few hundred logged steps. Its output is a distribution over the accepted length of a tree drafted to
`max_depth`. `speculant train-depth` logs and trains it; the tree method uses it where one was trained for
its target and drafter. It decides only how deep to draft, so output stays exactly the target's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from speculant.cache import cache_root

FEATURES = 4
HIDDEN = 16
RECENT = 0.5  # how much of the per-level acceptance a tree leaves to the trees before it


class Recent:
    """The per-level acceptance of the last few trees: accepted levels over levels tried, a rejection counting
    as one; the same whatever depth was drafted (a tree accepted whole says only that its depth was not too
    deep), so what a predictor drafts does not shift its own input."""

    def __init__(self) -> None:
        self.accepted, self.tried = 0.0, 0.0

    def observe(self, accepted: int, depth: int) -> None:
        self.accepted = RECENT * self.accepted + accepted
        self.tried = RECENT * self.tried + accepted + (accepted < depth)

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.tried + 2)


def features(logits: torch.Tensor, recent: Recent) -> list[float]:
    """The predictor's input: the target's top two probabilities and normalized entropy at the last
    committed token (`logits`, one row), and the recent trees' per-level acceptance."""
    logp = torch.log_softmax(logits.float(), -1)
    top = logp.topk(2).values.exp()
    entropy = -float((logp.exp() * logp).sum()) / math.log(logits.shape[-1])
    return [float(top[0]), float(top[1]), entropy, recent.rate]


class DepthPredictor:
    """P(accepted depth = a), a = 0..max_depth, of a tree drafted to `max_depth`, and the depth to draft."""

    def __init__(self, max_depth: int, state: dict[str, torch.Tensor] | None = None):
        self.max_depth = max_depth
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, max_depth + 1))
        if state is not None:
            self.net.load_state_dict(state)

    @torch.no_grad()
    def accepted(self, x: Sequence[float]) -> torch.Tensor:
        return torch.softmax(self.net(torch.tensor([x], dtype=torch.float32))[0], -1)

    def depth(self, x: Sequence[float], cost: Callable[[int], float], step_s: float, width: int) -> int:
        """argmax over d of (1 + E[min(accepted, d)]) / (d drafting steps + T(1 + d x width)) (Eq. 3)."""
        at_least = self.accepted(x).flip(0).cumsum(0).flip(0)  # P(accepted >= a)
        tokens = (1 + at_least[1:].cumsum(0)).tolist()  # drafting d levels: 1 + sum_{j <= d} P(accepted >= j)
        return max(range(1, self.max_depth + 1), key=lambda d: tokens[d - 1] / (d * step_s + cost(1 + d * width)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {name: value.tolist() for name, value in self.net.state_dict().items()}
        path.write_text(json.dumps({"max_depth": self.max_depth, "state": state}))

    @classmethod
    def load(cls, path: Path) -> DepthPredictor:
        saved = json.loads(path.read_text())
        return cls(saved["max_depth"], {name: torch.tensor(value) for name, value in saved["state"].items()})


def train(samples: Sequence[tuple[list[float], int]], max_depth: int, epochs: int = 150) -> DepthPredictor:
    """Fit the MLP to logged (features, accepted depth) pairs by cross-entropy (full batch, Adam, seeded)."""
    torch.manual_seed(0)
    predictor = DepthPredictor(max_depth)
    x = torch.tensor([s[0] for s in samples], dtype=torch.float32)
    y = torch.tensor([s[1] for s in samples], dtype=torch.long)
    optimizer = torch.optim.Adam(predictor.net.parameters(), lr=0.01)
    for _ in range(epochs):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(predictor.net(x), y).backward()
        optimizer.step()
    return predictor


def predictor_path(target, drafter) -> Path | None:
    """Where the predictor for this target and drafter lies, beside the machine profiles; None for models
    built in memory (no identity)."""
    if any(getattr(model, "identity", None) is None for model in (target, drafter)):
        return None
    key = "|".join(f"{model.identity}|{getattr(model, 'numerics', '')}" for model in (target, drafter))
    return cache_root() / "machine" / "depth" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
