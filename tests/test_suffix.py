"""Suffix decoding: the drafter follows the most frequent continuation of the longest match in the context and
in earlier generations, never reads an earlier generation of the same prompt, and stays exact under sd and auto."""

import numpy as np
import pytest

from helpers import ARCHS, random_prompt, tiny_model
from speculant import generate
from speculant.drafters.maxgram import suffix_ends
from speculant.drafters.suffix import History, SuffixDrafter
from speculant.session import Session
from speculant.errors import ConfigError

VOCAB = 64


def test_suffix_ends_finds_every_occurrence_of_the_longest_match():
    corpus = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 2, 3])
    ends, length = suffix_ends(corpus, np.array([0, 1, 2, 3]))
    assert length == 3 and ends.tolist() == [3, 7]
    assert suffix_ends(corpus, np.array([4]))[1] == 0
    ends, length = suffix_ends(corpus, np.array([2, 3]))  # the corpus's last index has no continuation
    assert length == 2 and ends.tolist() == [3, 7]


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_context():
    history = History()
    context = [1, 2, 3, 4, 5, 1, 2, 3]
    assert SuffixDrafter(history).propose(context, 4).tokens == [4, 5, 1, 2]  # prompt lookup alone
    history.add([9, 9], [1, 2, 3, 7, 8])
    history.add([9, 8], [1, 2, 3, 7, 8])
    drafter = SuffixDrafter(history).begin([0])
    assert drafter.match_length(context) == 3
    assert drafter.propose(context, 4).tokens == [7, 8]  # two occurrences say 7, one says 4; the gap ends it
    # Without the generations of its own prompt, one says 7 and one 4: the context's wins.
    assert SuffixDrafter(history).begin([9, 9]).propose(context, 4).tokens == [4, 5, 1, 2]
    assert SuffixDrafter(history).begin([0]).propose([6, 6], 4).tokens == []  # no match


def test_a_draft_ends_where_its_path_probability_falls_below_min_prob():
    history = History()
    for tail in ([7, 8], [7, 9], [6, 8], [5, 8]):
        history.add([0], [1, 2, *tail])
    # 7 follows 2 of the 4 occurrences (0.5), then 8 or 9 one each of those 2 (a tie: the latest occurrence's 9):
    # the path's 0.25 ends the draft at min_prob 0.3, not at 0.2.
    assert SuffixDrafter(history, min_prob=0.3).begin([4]).propose([3, 1, 2], 4).tokens == [7]
    assert SuffixDrafter(history, min_prob=0.2).begin([4]).propose([3, 1, 2], 4).tokens == [7, 9]


def test_the_history_keeps_its_capacity_and_the_latest_generations():
    history = History(capacity=20)
    for n in range(10):
        history.add([100 + n], [n, n, n])  # 5 tokens each with the gap
    assert len(history.tokens) == 20 and history.tokens[-5:].tolist() == [109, 9, 9, 9, -1]
    assert [start for start, _ in history.keys] == [0, 5, 10, 15]
    assert history.tokens[0] == 106
    # A generation cut at the front keeps its key while any of it is left: the same prompt never drafts from it.
    history = History(capacity=12)
    history.add([1, 2, 3], [4, 5, 6, 7])
    history.add([9, 9], [8, 8])  # (the first generation's first token goes)
    assert history.tokens[0] == 2 and [start for start, _ in history.keys] == [0, 7]
    assert SuffixDrafter(history).begin([1, 2, 3]).propose([1, 2, 3], 4).tokens == []


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_sd_and_auto_with_suffix_equal_ar_as_the_history_grows(arch):
    target = tiny_model(arch, 3, VOCAB)
    prompts = [random_prompt(seed, VOCAB, 10) for seed in range(4)]
    for prompt in prompts * 2:  # the second round finds the first round's generations, of other prompts too
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=32).token_ids
        for options in (dict(method="sd", drafter="suffix", k=4),
                        dict(method="auto", drafters=["suffix"], k_max=6)):
            assert generate(target, prompt_ids=prompt, max_new_tokens=32, **options).token_ids == expected
    history = Session.of(target).history
    assert len(history.keys) == 16 and history.tokens.size == 16 * (10 + 32 + 1)


def test_a_repeated_prompt_does_not_draft_from_its_own_earlier_answer():
    target = tiny_model("llama", 4, VOCAB)
    prompt = random_prompt(7, VOCAB, 10)
    first = generate(target, prompt_ids=prompt, method="sd", drafter="suffix", k=8, max_new_tokens=40).stats
    again = generate(target, prompt_ids=prompt, method="sd", drafter="suffix", k=8, max_new_tokens=40).stats
    assert again.accepted_lengths == first.accepted_lengths  # the same drafts: only the context to read
    other = generate(target, prompt_ids=[prompt[0], *prompt], method="sd", drafter="suffix", k=8,
                     max_new_tokens=40).stats
    assert sum(other.accepted_lengths) > sum(first.accepted_lengths)  # another prompt reads them


def test_suffix_takes_no_quantization_or_confidence():
    with pytest.raises(ConfigError, match="suffix runs no model"):
        generate(tiny_model("llama", 0, VOCAB), prompt_ids=[1, 2], method="sd", drafter="suffix@int4")
    with pytest.raises(ConfigError, match="not suffix"):
        generate(tiny_model("llama", 0, VOCAB), prompt_ids=[1, 2], method="sd", drafter="suffix", draft_confidence=0.5)


def test_a_repeated_run_in_the_context_drafts_k_tokens_not_one_period():
    """An occurrence in the context that runs into its end goes on with what it drafted (an overlapping copy, as
    Max-Gram's): a run of period 2 or 1 drafts k tokens; the history's occurrences still end at their gap."""
    assert SuffixDrafter(History()).begin([]).propose([3, 4] * 10, 8).tokens == [3, 4] * 4
    assert SuffixDrafter(History()).begin([]).propose([9, 7, 7, 7], 5).tokens == [7] * 5
    history = History()
    history.add([0], [5, 6, 1, 2])
    assert SuffixDrafter(history).begin([1]).propose([5, 6], 4).tokens == [1, 2]
