"""Cascade speculative drafting (Chen et al., "Cascade Speculative Drafting for Even Faster LLM
Inference", sections 3.1-3.2 and Algorithm 1).

Levels are drafters from largest to smallest, Max-Gram (if present) last. The draft for the reviewer
above level i (the target above level 0) follows row i of the upper-triangular K matrix: level i
produces the first K[i][i] tokens, level i+1 the next K[i][i+1], and so on (horizontal cascade). A
model level that has levels below it does not generate autoregressively: it reviews a draft built
from the rows below (vertical cascade), one forward per review, keeping the accepted prefix plus its
own next token. The last model level with nothing below it drafts autoregressively, and so does a model
with another tokenizer (`CrossVocabDrafter`): its tokens do not line up with a draft's to review it in one
forward, so the levels below it only extend its drafts horizontally. So does any other drafter (a user's, a
registered one): it proposes at its level as Max-Gram does. Each generation runs on its levels' own `begin`.

Leniency l >= 1 relaxes these inner reviews only. What an inner review emits is not the reviewer's
distribution then, so each emitted token carries the distribution it was actually drawn from
(`lenient_distribution`); the target reviews the final draft exactly against it, so the output is
lossless whatever l and K are. It relaxes nothing where no model level reviews another (one level, Max-Gram
alone, a drafter of another tokenizer or a user's above Max-Gram): a leniency there is refused.

A draft ends at the target's first end-of-sequence token, at every level: nothing after it could be committed, so
no level drafts or reviews past it.
"""

from __future__ import annotations

import torch

from speculant.config import SamplingConfig, as_integer, integer
from speculant.drafters.base import Draft, Drafter
from speculant.drafters.cross_vocab import CrossVocabDrafter
from speculant.drafters.maxgram import MaxGramDrafter
from speculant.drafters.model import ModelDrafter
from speculant.errors import ConfigError, OptionError
from speculant.models.wrappers.metered import Usage
from speculant.sampling import logits_to_probs
from speculant.verify import lenient_distribution, one_hot, verify_greedy, verify_sampling

Rows = list[torch.Tensor | None]  # per drafted token: the distribution it came from, None = one-hot


def parse_k_matrix(text: str, levels: int) -> list[list[int]]:
    """`"4,2;6"` or `"4,2;0,6"` -> [[4, 2], [0, 6]]: rows split by ';', entries by ','; row i may give
    only its upper-triangular part (levels - i entries)."""
    try:
        rows = [[integer(v) for v in row.split(",")] for row in text.split(";")]
    except ValueError:
        raise ConfigError(f"the K matrix must be integers like '4,2;0,6', got '{text}'") from None
    if len(rows) != levels:
        raise ConfigError(f"the K matrix needs one row per drafter level ({levels}), got {len(rows)}")
    return full_rows(rows, levels)


def unreviewed(leniency: float) -> OptionError:
    """The refusal of a leniency where no level of a cascade reviews another (no model level above another level):
    it would change nothing."""
    return OptionError("leniency", f"leniency {leniency} relaxes a model level's review of the levels below it, and "
                       "no level of this cascade reviews another: give 1, or a model drafter of the target's "
                       "vocabulary above another level")


def full_rows(rows: list[list[int]], levels: int) -> list[list[int]]:
    """Each row i that gives only its upper-triangular part (levels - i entries) with its i leading zeros."""
    return [[0] * (levels - len(row)) + list(row) if len(row) == levels - i else row for i, row in enumerate(rows)]


def default_k_matrix(levels: list[Drafter], k: int) -> list[list[int]]:
    """k tokens from each level's own drafter, plus a horizontal tail of 2 Max-Gram tokens when
    Max-Gram is the last level: [[k, 2], [0, k]] for [model, maxgram]."""
    n = len(levels)
    matrix = [[k if j == i else 0 for j in range(n)] for i in range(n)]
    if isinstance(levels[-1], MaxGramDrafter):
        for row in matrix[:-1]:
            row[-1] = 2
    return matrix


def check_k_matrix(matrix: list[list[int]], levels: int) -> list[list[int]]:
    """`matrix` (from a spec or from Python: its entries as `as_integer` takes them), checked; a ConfigError says
    what is wrong with it."""
    if not isinstance(matrix, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in matrix):
        raise ConfigError("the K matrix is a list of rows of integers")
    if len(matrix) == levels:
        matrix = full_rows(matrix, levels)
    if len(matrix) != levels or any(len(row) != levels for row in matrix):
        raise ConfigError(f"the K matrix must be {levels} x {levels}, one row and column per drafter level (row i "
                          "may give only its last levels - i entries)")
    matrix = [[as_integer(v) for v in row] for row in matrix]
    if any(v is None for row in matrix for v in row):
        raise ConfigError("K matrix entries must be integers")
    for i, row in enumerate(matrix):
        if any(v < 0 for v in row):
            raise ConfigError("K matrix entries must be >= 0")
        if any(row[:i]):
            raise ConfigError(f"the K matrix is upper triangular: row {i + 1} must start with {i} zero(s)")
    if sum(matrix[0]) < 1:
        raise ConfigError("the K matrix's first row must draft at least one token")
    return matrix


class CascadeDrafter(Drafter):
    """Vertical and horizontal cascade over `levels` (largest first) with the K matrix `k_matrix`; drafts end at an
    id of `eos` (the target's end-of-sequence tokens)."""

    name = "cascade"

    def __init__(self, levels: list[Drafter], k_matrix: list[list[int]], leniency: float,
                 sampling: SamplingConfig, generator: torch.Generator | None, eos: frozenset[int] = frozenset()):
        if not levels:
            raise ConfigError("a cascade needs at least one drafter")
        if any(isinstance(level, MaxGramDrafter) for level in levels[:-1]):
            raise ConfigError("maxgram can only be the last (smallest) drafter of a cascade")
        if leniency < 1:
            raise ConfigError(f"leniency must be >= 1, got {leniency}")
        if leniency != 1 and not any(isinstance(level, ModelDrafter) for level in levels[:-1]):
            raise unreviewed(leniency)
        self.levels, self.k_matrix, self.leniency = levels, check_k_matrix(k_matrix, len(levels)), leniency
        self.sampling, self.generator, self.eos = sampling, generator, eos
        self.models = [level for level in levels if isinstance(level, (ModelDrafter, CrossVocabDrafter))]
        self.meters = list({id(m.model): m.model for m in self.models}.values())  # (levels on one drafter: one)

    @property
    def max_draft(self) -> int:
        return sum(self.k_matrix[0])

    def begin(self, prompt_ids: list[int]) -> CascadeDrafter:
        """The cascade over each level's drafter for this generation (Max-Gram's own context array, say)."""
        levels = [level.begin(prompt_ids) for level in self.levels]
        if all(began is level for began, level in zip(levels, self.levels)):
            return self
        return CascadeDrafter(levels, self.k_matrix, self.leniency, self.sampling, self.generator, self.eos)

    def propose(self, context: list[int], k: int) -> Draft:
        before = [meter.usage for meter in self.meters]
        usage: dict[str, Usage] = {}  # a model level's forwards, read off its meter; other levels' as they report
        tokens, rows = self._draft(0, context, min(k, self.max_draft), usage)
        probs = None if self.sampling.greedy else stack_rows(tokens, rows)
        for meter, start in zip(self.meters, before):  # each meter once; models sharing a name add up
            add_usage(usage, meter.name, meter.usage - start)
        return Draft(tokens, probs, usage)

    def most(self, context: list[int]) -> int | None:
        """The sum of what the levels the first row of K draws from can hold (a level whose positions are full
        offers nothing; the next is drawn from); None where one of them knows no bound."""
        bounds = [level.most(context) for level, k in zip(self.levels, self.k_matrix[0]) if k]
        return None if None in bounds else sum(bounds)

    def observe(self, n_accepted: int) -> None:
        """Nothing to adapt: every model level re-synchronises from the context, and no level's own tokens are
        known to be the accepted ones."""

    def end(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        for level in self.levels:
            level.end(prompt_ids, output_ids)

    def _draft(self, row: int, context: list[int], budget: int, usage: dict[str, Usage]) -> tuple[list[int], Rows]:
        """Up to `budget` tokens for the reviewer above level `row`, level by level along K[row]."""
        tokens: list[int] = []
        rows: Rows = []
        goal = 0
        for j in range(row, len(self.levels)):
            goal = min(goal + self.k_matrix[row][j], budget)
            while len(tokens) < goal:
                new, new_rows = self._generate(j, context + tokens, goal - len(tokens), budget - len(tokens), usage)
                if not new:
                    break  # this level has nothing to offer (Max-Gram without a match)
                tokens, rows = self._until_eos(tokens + new, rows + new_rows)
                if tokens[-1] in self.eos:
                    return tokens[:budget], rows[:budget]
        return tokens[:budget], rows[:budget]

    def _until_eos(self, tokens: list[int], rows: Rows) -> tuple[list[int], Rows]:
        """`tokens` and their rows up to the first end-of-sequence token: nothing after it could be committed. (Every
        level's tokens pass here, a review's too: the draft a review reads ends at its first one.)"""
        stop = next((i + 1 for i, token in enumerate(tokens) if token in self.eos), len(tokens))
        return tokens[:stop], rows[:stop]

    def _generate(self, j: int, context: list[int], want: int, room: int, usage: dict[str, Usage]
                  ) -> tuple[list[int], Rows]:
        """Tokens from level j: a proposal (Max-Gram, a user's drafter, autoregressive drafting at the bottom),
        else one review."""
        level = self.levels[j]
        if not isinstance(level, ModelDrafter) or j == len(self.levels) - 1:
            draft = level.propose(context, want)
            if draft.tree is not None:
                raise ConfigError(f"drafter '{level.name}' proposes token trees: a cascade's levels propose chains")
            if level not in self.models:
                for name, used in draft.usage.items():
                    add_usage(usage, name, used)
            rows = list(draft.probs) if draft.probs is not None else [None] * len(draft.tokens)
            return draft.tokens, rows
        sub, sub_rows = self._draft(j + 1, context, min(sum(self.k_matrix[j + 1]), room - 1), usage)
        return self._review(level, context, sub, sub_rows)

    def _review(self, reviewer: ModelDrafter, context: list[int], sub: list[int], sub_rows: Rows
                ) -> tuple[list[int], Rows]:
        """One forward of `reviewer` over `sub`: its accepted prefix plus the reviewer's own next token,
        each with the distribution it was drawn from (CS Drafting, Algorithm 1, inner review). Its rows are read
        as the target's (`ModelDrafter.as_target_rows`; under structured output, as the grammar allows:
        `guided_rows`), and it reviews no further than its own positions and ids
        (`ModelDrafter.readable`)."""
        room = reviewer.room(len(context))
        if room <= 0 or reviewer.readable(context) < len(context):
            return [], []
        room = min(room, reviewer.readable(sub))  # (none: the reviewer's own next token)
        sub, sub_rows = sub[:room], sub_rows[:room]
        logits = reviewer.guided_rows(reviewer.as_target_rows(reviewer.score(context, sub)), context, sub)
        if self.sampling.greedy:
            q_x = None if self.leniency == 1 else torch.tensor(
                [float(r[t]) if r is not None else 1.0 for t, r in zip(sub, sub_rows)], device=logits.device)
            n, token = verify_greedy(sub, logits, self.leniency, q_x)
            rows: Rows = [None] * (n + 1)
            if reviewer.keep_probs:  # an outer lenient review weighs the reviewer's confidence
                rows = list(torch.softmax(logits[: n + 1], -1))
            return sub[:n] + [token], rows
        drafted = torch.tensor(sub, dtype=torch.long, device=logits.device)
        p = logits_to_probs(logits, self.sampling)
        q = stack_rows(sub, sub_rows, logits.shape[-1])  # None: every sub-draft token is deterministic
        q = q.to(p.device, p.dtype) if q is not None else None
        n, token = verify_sampling(drafted, p, q, self.generator, self.leniency)
        emitted = range(min(n + 1, len(sub)))
        if self.leniency == 1:
            rows = [p[i] for i in emitted]  # an exact review emits the reviewer's own distribution
        else:
            q = q if q is not None else one_hot(drafted, logits.shape[-1])
            rows = [lenient_distribution(p[i], q[i], self.leniency) for i in emitted]
        if n == len(sub):
            rows.append(p[n])  # the bonus token comes from the reviewer itself
        return sub[:n] + [token], rows


def add_usage(usage: dict[str, Usage], name: str, used: Usage) -> None:
    usage[name] = usage.get(name, Usage()) + used


def stack_rows(tokens: list[int], rows: Rows, vocab: int | None = None) -> torch.Tensor | None:
    """[len(tokens), vocab] draft distributions, one-hot where a row is None; None if all are. On the first row's
    device and in its dtype (a user's level may give its q on another device than a model level's)."""
    known = next((r for r in rows if r is not None), None)
    if known is None:
        return None
    ids = torch.tensor(tokens, dtype=torch.long, device=known.device)
    hot = one_hot(ids, vocab or known.shape[-1]).to(known.dtype)
    return torch.stack([r.to(known.device, known.dtype) if r is not None else hot[i] for i, r in enumerate(rows)])
