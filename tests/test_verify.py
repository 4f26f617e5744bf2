"""verify.py alone: hand-made cases with known answers, and the statistics of speculative sampling."""

import pytest
import torch

from helpers import total_variation
from speculant.verify import verify_block, verify_greedy, verify_sampling


def one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([3, 4, 5], [3, 4, 9, 7], (2, 9)),  # mismatch at the third token
        ([3, 4, 5], [3, 4, 5, 7], (3, 7)),  # all accepted: the bonus token
        ([3, 4, 5], [1, 4, 5, 7], (0, 1)),  # first rejected; later matches do not count
        ([], [6], (0, 6)),  # nothing drafted: a plain target step
    ],
)
def test_greedy_verification_takes_longest_matching_prefix(draft, target, expected):
    assert verify_greedy(draft, one_hot_logits(target)) == expected


@pytest.mark.parametrize(("leniency", "draft_probs", "expected"), [
    (1.0, None, (1, 9)),  # exact: the second token is not the argmax
    (2.0, None, (1, 9)),  # 2 p(4) = 0.5 < q = 1 (a deterministic drafter)
    (5.0, None, (2, 9)),  # 5 p(4) > 1: kept; the third token, p(5) = 0, never is
    (2.0, [1.0, 0.4, 1.0], (2, 9)),  # 2 p(4) = 0.5 > q(4) = 0.4
    (2.0, [1.0, 0.6, 0.0], (1, 9)),  # 2 p(4) < q(4) = 0.6: the rest is not reviewed
])
def test_a_lenient_greedy_review_keeps_a_token_where_l_times_p_exceeds_q(leniency, draft_probs, expected):
    """CS Drafting, section 3.1: a reviewed token that is not the argmax is kept where l p(x) > q(x)."""
    logits = torch.full((4, 10), -float("inf"))
    logits[0, 3] = 0.0  # p(3) = 1 after nothing
    logits[1, [9, 4]] = torch.tensor([0.75, 0.25]).log()  # the argmax 9; p(4) = 0.25
    logits[2, 9] = logits[3, 9] = 0.0  # p(5) = 0
    probs = torch.tensor(draft_probs) if draft_probs is not None else None
    assert verify_greedy([3, 4, 5], logits, leniency=leniency, draft_probs=probs) == expected


P = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
Q = torch.tensor([0.1, 0.1, 0.4, 0.2, 0.1, 0.1])


def first_token_distribution(draws: int, q: torch.Tensor | None, fixed_draft: int | None, seed: int = 0):
    """Empirical distribution of the first emitted token, and of the second one given the first was accepted."""
    generator = torch.Generator().manual_seed(seed)
    p = torch.stack([P, P.flip(0), P])  # k = 2 rows plus the bonus row
    first = torch.zeros(len(P))
    second = torch.zeros(len(P))
    for _ in range(draws):
        if fixed_draft is None:
            draft = torch.multinomial(q, 2, replacement=True, generator=generator)
        else:
            draft = torch.tensor([fixed_draft, fixed_draft])
        qs = torch.stack([q, q]) if q is not None and fixed_draft is None else None
        n, token = verify_sampling(draft, p, qs, generator)
        emitted = draft[:n].tolist() + [token]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    return first / first.sum(), second / second.sum()


def test_speculative_sampling_first_token_follows_target():
    first, second = first_token_distribution(20_000, Q, None)
    assert total_variation(first, P) < 0.02
    assert total_variation(second, P.flip(0)) < 0.03
    # The tolerance is tight enough to catch a wrong residual: resampling from p instead of
    # norm(max(0, p - q)) after a rejection would give this distribution, 0.15 away from p.
    wrong = torch.minimum(P, Q) + (1 - torch.minimum(P, Q).sum()) * P
    assert total_variation(wrong, P) > 0.1


@pytest.mark.parametrize("fixed_draft", [0, 2, 5])
def test_deterministic_draft_is_verified_as_one_hot_q(fixed_draft):
    first, _ = first_token_distribution(8_000, None, fixed_draft)
    assert total_variation(first, P) < 0.03


@pytest.mark.parametrize("verify", [verify_sampling, verify_block])
def test_identical_p_and_q_accept_everything_and_draw_the_next_token_from_the_row_after(verify):
    """q = p on every drafted position: every draft is kept, and the token after it follows p's row after the last
    (each row another distribution, so a draw from any other row shows)."""
    generator = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, len(P), generator=generator) * 2, -1)
    counts = torch.zeros(len(P))
    for _ in range(3000):
        draft = torch.stack([torch.multinomial(row, 1, generator=generator)[0] for row in p[:2]])
        n, token = verify(draft, p, p[:2], generator)
        assert n == 2
        counts[token] += 1
    assert total_variation(counts / counts.sum(), p[2]) < 0.04 < total_variation(p[1], p[2])


def test_token_impossible_under_target_is_rejected_and_never_recovered():
    generator = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.0, 1.0]])
    for _ in range(200):
        n, token = verify_sampling(torch.tensor([2]), p, q, generator)
        assert n == 0 and token in (0, 1)


@pytest.mark.parametrize("q", [torch.tensor([[0.0, 0.0, 1.0]]), None])
def test_a_draw_of_exactly_zero_never_keeps_a_token_the_target_gives_nothing(q, monkeypatch):
    """A uniform draw of exactly 0 (once in 2^24 float32 draws) kept block verification's token of p = 0 (`u <= h`,
    h = 0): a token outside top-k/top-p, or one a grammar forbids, was emitted. Draws are now float64 as well."""
    from speculant import sampling, verify

    monkeypatch.setattr(verify, "uniform", lambda size, generator, device: torch.zeros(size, dtype=torch.float64))
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    for verifier in (verify.verify_block, verify_sampling):
        n, token = verifier(torch.tensor([2]), p, q, torch.Generator().manual_seed(0))
        assert n == 0 and token in (0, 1), verifier.__name__
    masses = sampling.uniform((4096,), torch.Generator().manual_seed(0), torch.device("cpu")) * 2 ** 24
    assert (masses != masses.floor()).any()  # draws finer than float32's 2^-24 grid: a smaller mass can be drawn


def chains() -> tuple[torch.Tensor, torch.Tensor]:
    """A target's and a drafter's Markov chains on three tokens, [4, 3]: row i follows token i (3: none yet)."""
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.softmax(torch.randn(4, 3, generator=generator) * 1.5, -1) for _ in range(2))


def emitted_joint(verify, draws: int, deterministic: bool, seed: int = 1) -> tuple[float, float]:
    """The TV distance of the joint distribution of the first three tokens that one verification of a two-token
    draft emits (the rest drawn from the target's chain) from the target's, and the mean accepted count. Drafts
    from the drafter's chain, or the same fixed tokens 2, 2 (a deterministic drafter: q one-hot, None)."""
    target, drafter = chains()
    generator = torch.Generator().manual_seed(seed)
    counts, accepted = {}, 0
    for _ in range(draws):
        if deterministic:
            x1, x2, q = 2, 2, None
        else:
            x1 = int(torch.multinomial(drafter[3], 1, generator=generator))
            x2 = int(torch.multinomial(drafter[x1], 1, generator=generator))
            q = torch.stack([drafter[3], drafter[x1]])
        n, token = verify(torch.tensor([x1, x2]), torch.stack([target[3], target[x1], target[x2]]), q, generator)
        accepted += n
        sequence = [x1, x2][:n] + [token]
        while len(sequence) < 3:
            sequence.append(int(torch.multinomial(target[sequence[-1]], 1, generator=generator)))
        counts[tuple(sequence)] = counts.get(tuple(sequence), 0) + 1
    exact = {}
    for a in range(3):
        for b in range(3):
            for c in range(3):
                exact[a, b, c] = float(target[3, a] * target[a, b] * target[b, c])
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in exact.items())
    return tv, accepted / draws


@pytest.mark.parametrize("deterministic", [False, True])
def test_block_verification_emits_the_target_s_joint_distribution_and_accepts_at_least_as_many(deterministic):
    """The joint law of 27 three-token sequences, 10000 draws (noise ~0.012; a residual left unweighted gives 0.12-
    0.13, h_i taken as w_i 0.05 with drafted drafts). Token-level verification accepts its exact expected count;
    block verification accepts more of drafted drafts (Sun et al. 2024, Theorem 2: 0.818 against 0.777 here), and
    as many of a fixed draft, where both accept a prefix with the probability that the target emits it, the most
    any valid verifier can. (A count's standard error is ~0.006, a difference's ~0.01.)"""
    from speculant.verify import verify_block

    block, block_accepted = emitted_joint(verify_block, 10000, deterministic)
    token, token_accepted = emitted_joint(verify_sampling, 10000, deterministic)
    assert block < 0.03 and token < 0.03, (block, token)
    target, drafter = chains()
    if deterministic:  # P(x1 = 2) + P(x1 = 2, x2 = 2)
        expected = float(target[3, 2] * (1 + target[2, 2]))
        assert abs(block_accepted - expected) < 0.025 and abs(token_accepted - expected) < 0.025, \
            (block_accepted, token_accepted, expected)
    else:  # x1 accepted with min(p, q) summed over x1, then x2 likewise given x1
        kept = torch.minimum(target, drafter)
        expected = float(sum(kept[3, x] * (1 + kept[x].sum()) for x in range(3)))
        assert abs(token_accepted - expected) < 0.025, (token_accepted, expected)
        assert block_accepted > token_accepted + 0.01, (block_accepted, token_accepted)
