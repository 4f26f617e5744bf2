"""Yggdrasil's depth predictor (Guan et al. 2025): before a tree is drafted, a small MLP predicts
how many of its levels the target will accept, and the depth that maximizes the latency-aware objective
(expected accepted tokens per second of drafting and verification, Eq. 3) is drafted in one go, instead of
deciding after every drafting step whether another pays.

Two kinds, by what they read (`INPUTS`). `hidden`, the paper's: the target's last hidden state at the last
committed token, through an MLP encoder with one head per depth d giving P(accepted >= d); on backends that expose
it (`Capabilities.hidden_states`). `features`: four numbers every backend has (the target's top two probabilities
and entropy at that token, the recent trees' per-level acceptance), one layer, a distribution over the accepted
depth; kept for the comparison and for backends without hidden states (llama.cpp). `speculant train-depth` logs
trees on a corpus the project ships and trains either; the tree method uses the one trained for its target and
drafter. It decides only how deep to draft, so output stays exactly the target's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from speculant.cache import cache_root, read_text
from speculant.errors import ConfigError

FEATURES = 4
HIDDEN = 16  # the features predictor's layer
ENCODER = 64  # the hidden-state predictor's encoder width
INPUTS = ("hidden", "features")
MOST_PREDICTOR_BYTES = 1 << 26  # a predictor file's size at most (a hidden-state encoder of a 4096-wide model: 5 MB)
RECENT = 0.5  # how much of the per-level acceptance a tree leaves to the trees before it


@dataclass(frozen=True)
class Observation:
    """What a predictor may read before a tree is drafted: the four `features`, and the target's last hidden state
    at the last committed token where its backend exposes one."""

    features: list[float]
    hidden: torch.Tensor | None = None


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
    entropy = float(torch.special.entr(logp.exp()).sum()) / math.log(logits.shape[-1])  # (0 log 0 = 0: masked)
    return [float(top[0]), float(top[1]), entropy, recent.rate]


class DepthPredictor:
    """P(accepted depth >= a), a = 0..max_depth, of a tree drafted to `max_depth`, read from `inputs` (one of
    INPUTS; `width` numbers), and the depth to draft."""

    def __init__(self, max_depth: int, inputs: str = "features", width: int = FEATURES,
                 state: dict[str, torch.Tensor] | None = None):
        self.max_depth, self.inputs, self.width = max_depth, inputs, width
        if inputs == "hidden":  # an encoder, then a head per depth: P(accepted >= d), d = 1..max_depth
            self.net = torch.nn.Sequential(torch.nn.Linear(width, ENCODER), torch.nn.ReLU(),
                                           torch.nn.Linear(ENCODER, max_depth))
        else:  # a distribution over the accepted depth, 0..max_depth
            self.net = torch.nn.Sequential(torch.nn.Linear(width, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, max_depth + 1))
        self.mean, self.std = torch.zeros(width), torch.ones(width)  # the inputs' standardization
        if state is not None:
            self.mean, self.std = state.pop("mean", self.mean), state.pop("std", self.std)
            self.net.load_state_dict(state)

    def vector(self, observation: Observation) -> torch.Tensor:
        """The observation as this predictor's input, standardized."""
        x = observation.hidden if self.inputs == "hidden" else torch.tensor(observation.features)
        if x is None:
            raise ValueError("this depth predictor reads the target's hidden state, which its backend does not give")
        return (x.float().flatten() - self.mean) / self.std

    @torch.no_grad()
    def at_least(self, observation: Observation) -> torch.Tensor:
        """[max_depth + 1]: P(accepted >= a), a = 0..max_depth (non-increasing, 1 at a = 0)."""
        out = self.net(self.vector(observation)[None])[0]
        if self.inputs == "hidden":
            return torch.cat([out.new_ones(1), torch.sigmoid(out).cummin(0).values])
        return torch.softmax(out, -1).flip(0).cumsum(0).flip(0)

    def accepted(self, observation: Observation) -> torch.Tensor:
        """[max_depth + 1]: P(accepted = a)."""
        at_least = self.at_least(observation)
        return at_least - torch.cat([at_least[1:], at_least.new_zeros(1)])

    def depth(self, observation: Observation, cost: Callable[[int], float], step_s: float, width: int) -> int:
        """argmax over d of (1 + E[min(accepted, d)]) / (d drafting steps + T(1 + d x width)) (Eq. 3)."""
        tokens = (1 + self.at_least(observation)[1:].cumsum(0)).tolist()  # 1 + sum_{j <= d} P(accepted >= j)
        return max(range(1, self.max_depth + 1), key=lambda d: tokens[d - 1] / (d * step_s + cost(1 + d * width)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {name: value.tolist() for name, value in
                 {**self.net.state_dict(), "mean": self.mean, "std": self.std}.items()}
        path.write_text(json.dumps({"max_depth": self.max_depth, "inputs": self.inputs, "width": self.width,
                                    "state": state}))

    @classmethod
    def load(cls, path: Path) -> DepthPredictor:
        """A predictor `save` wrote; a ConfigError for a file that is not one."""
        try:
            saved = json.loads(read_text(path, MOST_PREDICTOR_BYTES))
            max_depth, inputs, width = saved["max_depth"], saved.get("inputs", "features"), saved.get("width", FEATURES)
            if not (all(type(n) is int and n >= 1 for n in (max_depth, width)) and inputs in INPUTS):
                raise ValueError(f"max_depth {max_depth!r} and width {width!r} (whole numbers >= 1), inputs "
                                 f"{inputs!r} (one of {', '.join(INPUTS)})")
            state = {name: torch.tensor(value) for name, value in saved["state"].items()}
            if any(state[name].shape != (width,) for name in ("mean", "std") if name in state):
                raise ValueError(f"its inputs' mean and std are not {width} numbers, its width")
            return cls(max_depth, inputs, width, state)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, RecursionError) as error:
            raise ConfigError(f"{path} is not a depth predictor `speculant train-depth` wrote "
                              f"({type(error).__name__}: {error})") from None


def train(samples: Sequence[tuple[Observation, int]], max_depth: int, inputs: str = "features",
          epochs: int = 150) -> DepthPredictor:
    """Fit the MLP to logged (observation, accepted depth) pairs (full batch, Adam, seeded): the features
    predictor by cross-entropy over the depths, the hidden-state one by each head's binary cross-entropy on
    whether the tree was accepted that deep."""
    torch.manual_seed(0)
    if inputs == "hidden":
        x = torch.stack([o.hidden.float().flatten() for o, _ in samples])
    else:
        x = torch.tensor([o.features for o, _ in samples], dtype=torch.float32)
    predictor = DepthPredictor(max_depth, inputs, x.shape[1])
    predictor.mean, predictor.std = x.mean(0), x.std(0).clamp_min(1e-6)
    x = (x - predictor.mean) / predictor.std
    y = torch.tensor([a for _, a in samples], dtype=torch.long)
    optimizer = torch.optim.Adam(predictor.net.parameters(), lr=0.01 if inputs == "features" else 0.003,
                                 weight_decay=0.0 if inputs == "features" else 1e-3)
    reached = (y[:, None] >= torch.arange(1, max_depth + 1)[None]).float()  # [n, max_depth]
    for _ in range(epochs):
        optimizer.zero_grad()
        out = predictor.net(x)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, reached) if inputs == "hidden" else \
            torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
    return predictor


def predictor_path(target, drafter, inputs: str = "features") -> Path | None:
    """Where the predictor of `inputs` for this target and drafter lies, beside the machine profiles; None for
    models built in memory (no identity)."""
    if any(getattr(model, "identity", None) is None for model in (target, drafter)):
        return None
    key = "|".join(f"{model.identity}|{getattr(model, 'numerics', '')}" for model in (target, drafter))
    suffix = "" if inputs == "features" else f"-{inputs}"
    return cache_root() / "machine" / "depth" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}{suffix}.json"
