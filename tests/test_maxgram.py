"""Max-Gram drafting: longest and most recent matches, bigram fallback, edge cases, losslessness."""

import numpy as np
import pytest

from helpers import ARCHS, byte_tokenizer, random_prompt, tiny_model
from speculant import generate
from speculant.drafters.maxgram import ContextArray, MaxGramDrafter, bigram_table, load_bigram, longest_suffix_match


def test_longest_match_wins():
    #            0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 9, 2, 3, 8, 7, 2, 3]
    assert longest_suffix_match(np.array(context)) == (5, 2)  # "2 3" at 4-5 and 1-2; the latest end wins
    context = [5, 2, 3, 6, 4, 2, 3, 7, 5, 2, 3]
    assert longest_suffix_match(np.array(context)) == (2, 3)  # "5 2 3" beats the later "2 3"
    assert MaxGramDrafter().propose(context, 3).tokens == [6, 4, 2]


def test_most_recent_occurrence_wins():
    context = [4, 1, 10, 4, 1, 11, 4, 1, 12, 4, 1]
    assert MaxGramDrafter().propose(context, 1).tokens == [12]


def test_k_larger_than_what_follows_keeps_matching_on_the_draft():
    context = [1, 2, 3, 1, 2]
    # "1 2" is followed by 3; the draft extends the context, which then repeats with period 3.
    assert MaxGramDrafter().propose(context, 7).tokens == [3, 1, 2, 3, 1, 2, 3]


def test_a_repeated_run_drafts_k_tokens_in_one_lookup(monkeypatch):
    """A match that runs into the context's end is copied with overlap, not looked up again per token: on a
    long run of one token, k lookups over the whole context per proposal made Max-Gram cost more than a step."""
    import speculant.drafters.maxgram as maxgram

    lookups = []
    monkeypatch.setattr(maxgram, "longest_suffix_match",
                        lambda tokens: lookups.append(len(tokens)) or longest_suffix_match(tokens))
    assert MaxGramDrafter().propose([7] * 500, 16).tokens == [7] * 16
    assert MaxGramDrafter().propose([5, 1, 2, 3] + [1, 2, 3] * 100, 8).tokens == [1, 2, 3, 1, 2, 3, 1, 2]
    assert len(lookups) == 2


def test_no_match_falls_back_to_bigram():
    table = bigram_table([[7, 8, 7, 9, 7, 8]], vocab_size=12)
    assert table[7] == 8 and table[8] == 7 and table[0] == -1
    drafter = MaxGramDrafter(table)
    assert drafter.propose([3, 4, 7], 1).tokens == [8]
    # After the bigram token the context matches itself again ("7 8" ... ) or keeps using the bigram.
    assert drafter.propose([3, 4, 7], 3).tokens == [8, 7, 8]


def test_a_context_s_array_is_its_tokens_whatever_came_before():
    """ContextArray converts only what differs from the last context: the array equals the whole context's after
    growth, a replaced draft (within and beyond its tail), truncation, a new prompt, and a list changed in place."""
    rng = np.random.default_rng(0)
    arrays, context = ContextArray(), rng.integers(0, 50, 300).tolist()
    for _ in range(400):
        move = rng.integers(6)
        if move == 0:
            context = context + rng.integers(0, 50, rng.integers(1, 20)).tolist()  # a step's tokens
        elif move == 1:
            cut = len(context) - int(rng.integers(1, 120))  # a draft replaced (beyond TAIL as well)
            context = context[:max(cut, 1)] + rng.integers(0, 50, rng.integers(0, 20)).tolist()
        elif move == 2:
            context = context[:int(rng.integers(1, len(context) + 1))]  # a shorter one
        elif move == 3:
            context[int(rng.integers(len(context)))] += 1  # the same list, changed in place
        elif move == 4:
            context = rng.integers(0, 50, rng.integers(1, 400)).tolist()  # another prompt
        assert arrays(context).tolist() == context
        assert arrays(tuple(context)).tolist() == context
    drafter = MaxGramDrafter()
    assert drafter.begin([1]).array is not drafter.array  # each generation its own


def test_empty_or_unmatched_context_without_bigram_proposes_nothing():
    assert MaxGramDrafter().propose([], 4).tokens == []
    assert MaxGramDrafter(bigram_table([[1, 2, 1]], 4)).propose([], 4).tokens == []  # (a bigram follows nothing)
    assert MaxGramDrafter().propose([5], 4).tokens == []
    assert MaxGramDrafter().propose([1, 2, 3], 4).tokens == []
    assert MaxGramDrafter(np.full(10, -1)).propose([1, 2, 3], 4).tokens == []


def test_bigram_table_from_a_corpus_is_built_once(tmp_path, monkeypatch):
    tokenizer = byte_tokenizer()
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def f():\n    return f\n" * 20)
    table = load_bigram(tokenizer, len(tokenizer), [corpus], tmp_path / "cache")
    assert table[ord("d")] == ord("e") and table[ord(" ")] == ord(" ")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the cached table should have been used")

    monkeypatch.setattr(type(tokenizer), "__call__", no_tokenizing)
    np.testing.assert_array_equal(load_bigram(tokenizer, len(tokenizer), [corpus], tmp_path / "cache"), table)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_maxgram_speculation_matches_autoregressive(arch, k):
    accepted = 0
    for seed in range(4):
        target = tiny_model(arch, seed, 64)
        prompt = random_prompt(seed, 64, 12)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
        table = bigram_table([prompt], 64)
        result = generate(target, prompt_ids=prompt, drafter=MaxGramDrafter(table), k=k, max_new_tokens=40)
        assert result.token_ids == expected
        accepted += sum(result.stats.accepted_lengths)
    assert accepted > 0


def test_a_one_token_match_is_no_match():
    context = [5, 1, 9, 7, 1]  # only "1" repeats
    assert MaxGramDrafter().propose(context, 3).tokens == []
    assert MaxGramDrafter(min_match=1).propose(context, 3).tokens == [9, 7, 1]
    assert MaxGramDrafter().match_length([5, 1, 9, 7, 5, 1]) == 2 and MaxGramDrafter().match_length(context) == 0


def test_fr_spec_s_frequent_tokens_keep_every_special_token(tmp_path, monkeypatch):
    """FR-Spec's head: the n tokens commonest in the corpus, with the special ones whatever their count."""
    from speculant.corpus import frequent_tokens

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    tokenizer = byte_tokenizer()
    ids = frequent_tokens(tokenizer, 257, 40)
    assert len(ids) == 40 and list(ids) == sorted(set(ids.tolist())) and 256 in ids
    assert {ord(" "), ord("e")} <= set(ids.tolist()) and ord("~") not in ids
    assert list(frequent_tokens(tokenizer, 257, 40)) == list(ids)  # again, from the cache
    assert len(list(tmp_path.glob("frequency/*.npy"))) == 2  # the code's counts and the prose's


def test_fr_spec_s_frequent_tokens_are_n_where_special_tokens_are_frequent_too(monkeypatch):
    """The special and added tokens go in whatever their count, and the rest of the n are ranked among the others:
    a special token that is also among the commonest takes no place twice."""
    from speculant import corpus

    counts = np.arange(10, 0, -1, dtype=float)  # id 0 the commonest
    monkeypatch.setattr(corpus, "code_counts", lambda tokenizer, vocab_size: counts)
    monkeypatch.setattr(corpus, "prose_counts", lambda tokenizer, vocab_size: counts)

    class Tokenizer:
        all_special_ids = [1, 9]

        @staticmethod
        def get_added_vocab():
            return {"<x>": 0, "<y>": 1}

    assert corpus.frequent_tokens(Tokenizer(), 10, 5).tolist() == [0, 1, 2, 3, 9]
    assert corpus.frequent_tokens(Tokenizer(), 10, 2).tolist() == [0, 1]


def test_counts_are_kept_per_way_of_splitting_text_not_per_vocabulary(tmp_path, monkeypatch):
    """What is counted with a tokenizer is cached under its fingerprint: the same tokenizer made again (padding set,
    as a padded call leaves it) reads the first one's counts; one of the same vocabulary that normalizes text first
    counts its own, not the first one's."""
    from tokenizers import normalizers

    from speculant import corpus

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    code = tmp_path / "code.py"
    code.write_text("THE The the")
    monkeypatch.setattr(corpus, "default_corpus", lambda: [code])
    plain, again, folding = byte_tokenizer(), byte_tokenizer(), byte_tokenizer()
    again.backend_tokenizer.enable_padding(pad_id=256, pad_token="<eos>")
    folding.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert plain.get_vocab() == folding.get_vocab()
    assert corpus.code_counts(plain, 257)[ord("T")] == 2
    assert list(corpus.code_counts(again, 257)) == list(corpus.code_counts(plain, 257))
    assert len(list(tmp_path.glob("frequency/*.npy"))) == 1  # (read, not counted again)
    assert corpus.code_counts(folding, 257)[ord("T")] == 0 and corpus.code_counts(folding, 257)[ord("t")] == 3


def test_prose_words_are_encoded_as_the_tokenizer_encodes_them():
    """`words_ids` (a fast tokenizer's own batch encoder) gives the ids the tokenizer gives, special tokens left
    out: here a tokenizer whose template opens every text with one, then one whose tokenizer.json pads and
    truncates (which transformers' own call turns off)."""
    from tokenizers.processors import TemplateProcessing

    from speculant.corpus import words_ids

    tokenizer = byte_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", 256)])
    words = [" the", " Über", "Naïve", " 🐍", "x" * 40, ""]
    assert tokenizer(words[0])["input_ids"][0] == 256  # (the template applies)
    assert words_ids(tokenizer, words) == tokenizer(words, add_special_tokens=False)["input_ids"]
    tokenizer.backend_tokenizer.enable_padding(pad_id=256, pad_token="<eos>")
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert words_ids(tokenizer, words) == [list(word.encode()) for word in words]  # byte i is token i here


def test_fr_spec_s_head_keeps_what_code_and_what_prose_use_most(tmp_path, monkeypatch):
    """A coder's drafter serves code and chat: the head ranks tokens by the larger of their shares of the code
    corpus and of English prose (wordfreq's words), so neither crowds the other out."""
    from speculant import corpus

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    code = tmp_path / "code.py"
    code.write_text("((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((")  # code of one token: "("
    monkeypatch.setattr(corpus, "default_corpus", lambda: [code])
    tokenizer = byte_tokenizer()
    prose = corpus.prose_counts(tokenizer, 257)
    assert prose[ord(" ")] > prose[ord("e")] > prose[ord("z")] > 0 and prose[ord("T")] > 0 and prose[ord("(")] == 0
    head = set(corpus.frequent_tokens(tokenizer, 257, 4).tolist())
    assert head == {256, ord("("), ord(" "), ord("e")}  # <eos>; code's first; prose's first two
