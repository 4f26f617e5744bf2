"""Drafters with another tokenizer: the vocabularies side by side, string-level greedy drafts, exact sampling on the
shared tokens, padded logits rows."""

import random

import pytest
import torch

from helpers import (ARCHS, MORE_ARCHS, MarkovLM, bpe_tokenizer, byte_tokenizer, costs, invent, piece_tokenizer,
                     tiny_model, tiny_transformer)
from speculant import generate
from speculant.config import SamplingConfig
from speculant.decoding.dsi.twin import OracleLM
from speculant.drafters.cross_vocab import CrossVocabDrafter, model_drafter
from speculant.drafters.model import ModelDrafter
from speculant.drafters.vocab import GrowingEncoding, byte_of_char, build_pair, incomplete_tail, token_bytes
from speculant.errors import ConfigError, OptionError
from speculant.models import HFCausalLM
from speculant.models.base import owner_of
from speculant.sampling import logits_to_probs
from test_sampling import TEMPERATURE, VOCAB, assert_follows_target, exact_marginals

WORDS = ["def", "return", "value", "quick", "sort", "élan", "naïve", "中文", "递归", "🐍", "x", "(", ")", ":", "\n"]


def corpus(seed: int, extra: tuple[str, ...] = (), lines: int = 300) -> list[str]:
    rng = random.Random(seed)
    words = WORDS + list(extra)
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 12))) for _ in range(lines)]


@pytest.fixture(scope="module")
def tokenizers():
    """Two byte-level BPE vocabularies that share the bytes, some merges and the end token, not the rest."""
    return (bpe_tokenizer(corpus(0, ("alphabet", "sorted", "mañana")), 330),
            bpe_tokenizer(corpus(1, ("betamax", "quicksort", "über", "中间")), 300))


def test_tokens_spell_their_bytes_and_padded_rows_spell_nothing(tokenizers):
    target, _ = tokenizers
    spelled, specials = token_bytes(target, len(target) + 5)
    text = "naïve 中文 🐍 return"
    ids = target.encode(text)
    assert b"".join(spelled[i] for i in ids) == text.encode()
    assert spelled[-5:] == [None] * 5  # rows past the tokenizer
    assert specials == {target.eos_token_id} and spelled[target.eos_token_id] == b"<|end|>"
    pieces = piece_tokenizer(["a", "é", "[PAD2]"])
    assert token_bytes(pieces, 3)[0] == [b"a", "é".encode(), None]  # a GGUF conversion's padding placeholder


def test_sentencepiece_pieces_spell_spaces_and_fallback_bytes():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁he": 1, "llo": 2, "<0xE4>": 3, "▁": 4}, merges=[],
                                  unk_token="<unk>", byte_fallback=True))
    pieces.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    spelled, _ = token_bytes(PreTrainedTokenizerFast(tokenizer_object=pieces, unk_token="<unk>"), 5)
    assert spelled[1:] == [b" he", b"llo", b"\xe4", b" "]


def test_incomplete_tail_finds_a_cut_character():
    data = "a中🐍".encode()
    assert incomplete_tail(data) == 0 and incomplete_tail(b"") == 0
    assert [incomplete_tail(data[:-i]) for i in (1, 2, 3)] == [3, 2, 1]
    assert incomplete_tail("中".encode()[:2]) == 2 and incomplete_tail(b"\x80") == 0  # a stray byte is no start


def test_shared_tokens_map_by_bytes_and_specials_by_content(tokenizers):
    target, drafter = tokenizers
    pair = build_pair(target, drafter, len(target) + 3, len(drafter) + 2)
    to_target = pair.to_target.tolist()
    assert len(to_target) == len(drafter) + 2 and to_target[-2:] == [-1, -1]  # padded rows are never shared
    assert to_target[drafter.eos_token_id] == target.eos_token_id
    shared = [i for i, t in enumerate(to_target) if t >= 0]
    assert 256 < len(shared) < len(drafter)  # every byte and some merges, not all
    for i in shared:
        assert pair.target_bytes[to_target[i]] == pair.drafter_bytes[i]
    assert pair.text(target.encode("naïve 中文")) == "naïve 中文"
    assert pair.text(target.encode("中")[:1] if len(target.encode("中")) > 1 else [len(target) + 1]) is None


@pytest.mark.parametrize("kind", ["bpe", "pieces"])
def test_a_growing_text_encodes_as_a_whole_re_encoding_only_its_tail(tokenizers, kind, monkeypatch):
    target, drafter = tokenizers if kind == "bpe" else (tokenizers[0], piece_tokenizer(sorted(set("".join(corpus(1))))))
    pair = build_pair(target, drafter, len(target), len(drafter))
    encoded: list[int] = []
    whole = pair.drafter_ids
    monkeypatch.setattr(pair, "drafter_ids", lambda text: encoded.append(len(text)) or whole(text))
    growing, rng, text = GrowingEncoding(pair), random.Random(5), ""
    for step in range(300):
        if step % 7 == 6:  # a rejected draft: the end of the text changes
            text = text[:max(0, len(text) - rng.randrange(1, 12))]
        text += rng.choice([" ", "", "  ", "\n"]) + rng.choice(WORDS + ["'s", "42", "3.14"])
        assert growing.encode(text) == whole(text), (step, text[-40:])
    if kind == "bpe":  # byte-level BPE splices: it re-encoded a few words at a time, never the whole text again
        assert max(encoded[100:]) < 0.2 * len(text)
    else:  # pieces that cannot spell the text ('42' is not among them): nothing is spliced, each text encoded whole
        assert encoded[-1] == len(text)


def test_safe_boundaries_keep_what_more_text_cannot_change():
    tokenizer = bpe_tokenizer(corpus(2), 400)
    pair = build_pair(tokenizer, tokenizer, len(tokenizer), len(tokenizer))
    for text, safe_text in [("def quick sort(x):\n    return x", "def quick sort(x):\n    return"),
                            ("return valu", "return"), ("x = 递归递归递归递归递归", None)]:
        whole = tokenizer.encode(text)
        safe = pair.safe_target_ids(text, ended=False)
        assert safe == whole[: len(safe)]
        if safe_text is not None:  # the last word may go on: all its tokens wait
            assert tokenizer.decode(safe) == safe_text
        else:  # a long last pre-token (a clause of Chinese): all but its last three tokens
            assert len(safe) == len(whole) - 3 and len(safe) > 2
        assert pair.safe_target_ids(text, ended=True) == whole


def test_draft_text_stops_before_a_cut_character_and_at_a_special_token(tokenizers):
    target, drafter = tokenizers
    pair = build_pair(target, drafter, len(target), len(drafter))
    char_of = {b: c for c, b in byte_of_char().items()}
    cut = drafter.convert_tokens_to_ids([char_of[b] for b in "中".encode()[:2]])
    assert pair.draft_text(drafter.encode("return ") + cut) == ("return ", None, False)
    assert pair.draft_text(drafter.encode("x") + [drafter.eos_token_id, *drafter.encode("y")]) == \
        ("x", target.eos_token_id, True)
    padded = build_pair(target, drafter, len(target), len(drafter) + 2)
    assert padded.draft_text(drafter.encode("x") + [len(drafter)]) == ("x", None, True)


def greedy_pair(arch: str, seed: int, tokenizers):
    target_tokenizer, drafter_tokenizer = tokenizers
    target = tiny_model(arch, seed, len(target_tokenizer), init_std=0.3, tokenizer=target_tokenizer)
    drafter = tiny_model(ARCHS[seed % 2], seed + 100, len(drafter_tokenizer), init_std=0.3, tokenizer=drafter_tokenizer)
    return target, drafter


PROMPTS = ["def quick", "naïve élan 中", "递归 🐍 return value"]


@pytest.mark.parametrize("arch", ARCHS + MORE_ARCHS)
def test_greedy_drafts_across_vocabularies_match_autoregressive(arch, tokenizers):
    """A random drafter of another vocabulary (its drafts rejected), and one that knows the text in its own tokens
    (its drafts accepted, as far as they spell the target's text)."""
    accepted = 0
    for seed in range(3):
        target, drafter = greedy_pair(arch, seed, tokenizers)
        for prompt in PROMPTS:
            ar = generate(target, prompt, method="ar", max_new_tokens=20)
            for k in (1, 3, 5):
                sd = generate(target, prompt, drafter=drafter, k=k, max_new_tokens=20)
                assert sd.token_ids == ar.token_ids, (arch, seed, prompt, k)
            oracle = TextOracle(drafter.tokenizer, prompt + ar.text)
            sd = generate(target, prompt, drafter=oracle, k=4, max_new_tokens=20)
            assert sd.token_ids == ar.token_ids, (arch, seed, prompt, "oracle")
            accepted += sum(sd.stats.accepted_lengths)
    assert accepted > 30, arch  # (of 180 tokens: the oracle is lost where the text splits a character)


class TextOracle(OracleLM):
    """A drafter that knows the text to come: its next token is its longest token continuing `reference` after
    what its context spells."""

    def __init__(self, tokenizer, reference: str):
        super().__init__(len(tokenizer))
        self.name, self.tokenizer, self.reference = "text-oracle", tokenizer, reference.encode()
        self.spelled = token_bytes(tokenizer, len(tokenizer))[0]

    def next_token(self, prefix):
        done = b"".join(self.spelled[i] or b"?" for i in prefix)
        rest = self.reference[len(done):] if self.reference.startswith(done) else b""
        return max((i for i, b in enumerate(self.spelled) if b and rest.startswith(b)),
                   key=lambda i: len(self.spelled[i]), default=0)


CHARS = ["a", "b", " ", "é", "中", "🐍", "(", ")", "\n", "x"]


@pytest.fixture(scope="module")
def char_target():
    """A target whose every output is whole characters (one token each), two of them multi-byte: its greedy text
    is the oracle's reference; the drafter's byte-level tokens split those characters."""
    return tiny_model("llama", 5, len(CHARS), init_std=0.6, tokenizer=piece_tokenizer(CHARS))


@pytest.mark.parametrize("method, options", [("sd", {"k": 4}), ("sd", {"k": 1}), ("cascade", {}), ("auto", {}),
                                              ("dsi", {"servers": 2, "lookahead": 3})])
def test_a_drafter_that_knows_the_text_is_accepted_across_vocabularies(char_target, method, options):
    drafter_tokenizer = bpe_tokenizer(["".join(random.Random(i).choices(CHARS, k=40)) for i in range(200)], 300,
                                      eos=None)
    prompt = "ab 中("
    ar = generate(char_target, prompt, method="ar", max_new_tokens=40)
    oracle = TextOracle(drafter_tokenizer, prompt + ar.text)
    assert len(drafter_tokenizer.encode(prompt + ar.text)) != len(char_target.tokenizer.encode(prompt + ar.text))
    if method == "cascade":
        options = {"drafters": [oracle, "maxgram"]}
    elif method == "auto":
        options = {"drafters": [oracle], "tree_widths": ()}
    else:
        options = {**options, "drafter": oracle}
    out = generate(char_target, prompt, method=method, max_new_tokens=40, **options)
    assert out.token_ids == ar.token_ids
    if method != "dsi":  # (the cascade's Max-Gram tail is often wrong)
        assert out.stats.acceptance_rate > 0.6 and out.stats.target_forwards <= 22, out.stats


class CanonicalOracle(OracleLM):
    """A drafter that knows the text to come only as its own tokenizer splits it: after any other split of the
    same text it is lost (its next token is 0)."""

    def __init__(self, tokenizer, reference: str):
        super().__init__(len(tokenizer))
        self.name, self.tokenizer, self.reference = "canonical-oracle", tokenizer, tokenizer.encode(reference)

    def next_token(self, prefix):
        n = len(prefix)
        return self.reference[n] if list(prefix) == self.reference[:n] and n < len(self.reference) else 0


def test_token_healing_drafts_from_where_the_drafter_would_split(char_target):
    """The target's one-character tokens end the context inside the drafter's multi-character tokens: the drafter
    drafts from its context without its last token, first a token that starts with that token's text."""
    prompt = "ab 中("
    ar = generate(char_target, prompt, method="ar", max_new_tokens=40)
    reference = prompt + "".join(CHARS[i] for i in ar.token_ids)
    drafter_tokenizer = bpe_tokenizer([reference] * 20, 400, eos=None)  # long tokens: pieces of the reference
    assert len(drafter_tokenizer.encode(reference)) < len(reference) / 2
    out = generate(char_target, prompt, drafter=CanonicalOracle(drafter_tokenizer, reference), k=4, max_new_tokens=40)
    assert out.token_ids == ar.token_ids
    assert out.stats.target_forwards <= 16, out.stats  # 20 without healing, 40 for ar


def test_dsi_plans_its_lookahead_on_the_drafters_own_tokens(tokenizers, char_target, monkeypatch):
    """Without a lookahead DSI times one drafter forward on the prompt: in the drafter's tokens, not the target's
    (whose ids here lie past the drafter's 10 rows). The forwards timed run; the times planned with are fixed (the
    target's ten times the drafter's), so that a loaded machine's timings cannot refuse the plan."""
    from speculant.decoding.dsi import plan

    target = tiny_model("llama", 7, len(tokenizers[0]), init_std=0.3, tokenizer=tokenizers[0])
    timed = []

    def measure_step(model, prompt, repeats=3):
        plan_measure(model, prompt, repeats)  # (the target's ids past the drafter's rows failed here)
        timed.append((owner_of(model), list(prompt)))
        return 0.01 if owner_of(model) is target else 0.001

    plan_measure = plan.measure_step
    monkeypatch.setattr(plan, "measure_step", measure_step)
    prompt = "ab 中( é"
    assert max(target.tokenizer.encode(prompt)) >= len(CHARS)
    ar = generate(target, prompt, method="ar", max_new_tokens=12)
    assert generate(target, prompt, method="dsi", drafter=char_target, servers=1, max_new_tokens=12).token_ids == \
        ar.token_ids
    assert [(model, ids) for model, ids in timed if model is char_target] == \
        [(char_target, char_target.tokenizer.encode(prompt))]


def test_greedy_drafts_are_reused_until_spent(char_target):
    drafter_tokenizer = bpe_tokenizer(["".join(random.Random(i).choices(CHARS, k=40)) for i in range(200)], 300,
                                      eos=None)
    prompt = "ab 中("
    ar = generate(char_target, prompt, method="ar", max_new_tokens=30)
    oracle = TextOracle(drafter_tokenizer, prompt + ar.text)
    drafter = CrossVocabDrafter(oracle, char_target, SamplingConfig(), None)
    context = char_target.tokenizer.encode(prompt)
    first = drafter.propose(context, 6)
    assert first.tokens == ar.token_ids[:6] and first.usage["text-oracle"].forwards > 0
    again = drafter.propose(context + ar.token_ids[:2], 1)  # within what was drafted: no forward
    assert again.tokens == ar.token_ids[2:3] and not again.usage


# Sampling: a 12-row target over 10 pieces (2 padded rows) and a drafter over other pieces; they share 6.
TARGET_PIECES = ["a", "b", "c", "d", " ", "ab", "cd", "é", "ba", "dd"]
DRAFTER_PIECES = ["a", "b", "c", "d", " ", "é", "bc", "a ", "bcd"]


def sampling_cross_pair(seed: int = 21):
    """Markov models with tokenizers, so that thousands of generations take seconds."""
    target, drafter = MarkovLM(VOCAB, seed, scale=1.0), MarkovLM(len(DRAFTER_PIECES) + 1, seed + 1, scale=1.0)
    target.tokenizer = piece_tokenizer(TARGET_PIECES, [("a", "b"), ("c", "d"), ("b", "a"), ("d", "d")])
    drafter.tokenizer = piece_tokenizer(DRAFTER_PIECES, [("b", "c"), ("a", " "), ("bc", "d")])
    return target, drafter, target.tokenizer.encode("ab cd é")


def test_sampled_drafts_use_shared_tokens_with_q_on_the_targets_ids():
    target, drafter, prompt = sampling_cross_pair()
    sampling = SamplingConfig(TEMPERATURE)
    cross = model_drafter(drafter, target, sampling, torch.Generator().manual_seed(0))
    assert isinstance(cross, CrossVocabDrafter)
    shared = {i for i, piece in enumerate(TARGET_PIECES) if piece in DRAFTER_PIECES}
    for _ in range(20):
        draft = cross.propose(prompt, 3)
        assert len(draft.tokens) == 3 and set(draft.tokens) <= shared
        assert draft.probs.shape == (3, VOCAB)  # the target's row width, padded rows included
        assert torch.allclose(draft.probs.sum(-1), torch.ones(3))
        assert float(draft.probs[:, sorted(set(range(VOCAB)) - shared)].sum()) == 0
    q = logits_to_probs(drafter.prefill(drafter.tokenizer.encode("ab cd é")), sampling)
    off = [i for i, piece in enumerate(DRAFTER_PIECES) if piece not in TARGET_PIECES] + [len(DRAFTER_PIECES)]
    outside = float(q[off].sum())
    first = cross.propose(prompt, 1).probs[0]
    for i, piece in enumerate(DRAFTER_PIECES):  # renormalised over the shared tokens
        if piece in TARGET_PIECES:
            assert float(first[TARGET_PIECES.index(piece)]) == pytest.approx(float(q[i]) / (1 - outside), rel=1e-4)


def test_sampling_across_vocabularies_follows_the_target_distribution():
    target, drafter, prompt = sampling_cross_pair()
    q_mapped = torch.zeros(VOCAB)
    q = logits_to_probs(drafter.prefill(drafter.tokenizer.encode("ab cd é")), SamplingConfig(TEMPERATURE))
    for i, piece in enumerate(DRAFTER_PIECES):
        if piece in TARGET_PIECES:
            q_mapped[TARGET_PIECES.index(piece)] = q[i]
    assert 0.5 * float((exact_marginals(target, prompt, n=1)[0] - q_mapped / q_mapped.sum()).abs().sum()) > 0.2
    accepted = [generate(target, prompt_ids=prompt, drafter=drafter, k=3, max_new_tokens=6, temperature=TEMPERATURE,
                         seed=seed).stats for seed in range(30)]
    assert sum(sum(s.accepted_lengths) for s in accepted) >= 5  # the shared-token drafts do get accepted
    assert_follows_target(target, prompt, drafter=drafter, k=3)


def test_padded_target_rows_give_empty_drafts_not_errors():
    target, drafter, prompt = sampling_cross_pair()
    cross = model_drafter(drafter, target, SamplingConfig(), None)
    assert cross.propose(prompt + [VOCAB - 1], 3).tokens == []  # the context holds a padded row: no text to draft on
    assert cross.propose(prompt, 3).tokens  # and without it drafts go on


def test_a_drafter_with_the_same_tokenizer_and_fewer_rows_is_padded_to_the_target(tokenizers):
    tokenizer = tokenizers[0]
    target = tiny_model("llama", 3, len(tokenizer) + 7, init_std=0.5, tokenizer=tokenizer)
    drafter = tiny_model("qwen2", 4, len(tokenizer) + 2, init_std=0.5, tokenizer=tokenizer)
    made = model_drafter(drafter, target, SamplingConfig(TEMPERATURE), torch.Generator().manual_seed(0))
    assert isinstance(made, ModelDrafter)
    draft = made.propose(tokenizer.encode("def quick"), 3)
    assert draft.probs.shape == (3, len(tokenizer) + 7) and float(draft.probs[:, -5:].sum()) == 0
    wider = model_drafter(target, drafter, SamplingConfig(TEMPERATURE), torch.Generator().manual_seed(0))
    draft = wider.propose(tokenizer.encode("def quick"), 4)  # rows the narrower target lacks are never drafted
    assert max(draft.tokens) < len(tokenizer) + 2 and draft.probs.shape[-1] == len(tokenizer) + 2
    for prompt in PROMPTS:
        ar = generate(target, prompt, method="ar", max_new_tokens=12)
        assert generate(target, prompt, drafter=drafter, k=3, max_new_tokens=12).token_ids == ar.token_ids
    # A cascade's review reads the reviewer's rows as the target's, narrower or wider (Max-Gram always matches here).
    for big, small in ((target, drafter), (drafter, target)):
        prompt = "abc abc abc abc abc abc"
        ar = generate(big, prompt, method="ar", max_new_tokens=12)
        for temperature in (0.0, 1.0):
            cascade = generate(big, prompt, method="cascade", drafters=[small, "maxgram"], max_new_tokens=12,
                               temperature=temperature, seed=0)
            assert cascade.stats.drafter_forwards and (temperature or cascade.token_ids == ar.token_ids)
    # An id the narrower drafter has no row for, in the context (a client's logit_bias or prompt puts it there): it
    # drafts nothing from there on (its embedding would fail), and the output is still ar's.
    lacked = {len(tokenizer) + 5: 100.0}
    ar = generate(target, prompt_ids=[1, 2, 3], method="ar", max_new_tokens=6, logit_bias=lacked).token_ids
    assert ar == [len(tokenizer) + 5] * 6
    for options in (dict(drafter=drafter), dict(method="cascade", drafters=[drafter, "maxgram"]),
                    dict(method="auto", drafters=[drafter])):
        assert generate(target, prompt_ids=[1, 2, 3], max_new_tokens=6, logit_bias=lacked, **options).token_ids == ar
    prompt = [1, 2, len(tokenizer) + 5, 3]
    ar = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=6).token_ids
    for options in (dict(drafter=drafter), dict(method="dsi", drafter=drafter, lookahead=2)):
        assert generate(target, prompt_ids=prompt, max_new_tokens=6, **options).token_ids == ar
    slow = HFCausalLM(tiny_transformer("llama", 3, len(tokenizer) + 7, 0.5, layers=8, hidden=128), tokenizer)
    ar = generate(slow, prompt_ids=prompt, method="ar", max_new_tokens=6).token_ids  # (DSI's lookahead planned on
    assert generate(slow, prompt_ids=prompt, method="dsi", drafter=drafter, max_new_tokens=6).token_ids == ar  # the
    # drafter's time over the prompt's ids it has rows for: timed on the whole prompt, its embedding failed)
    # Trees need the target's rows (method tree refuses another width): auto drafts chains with a wider drafter.
    wide = generate(drafter, prompt_ids=[1, 2, 3], method="ar", max_new_tokens=12).token_ids
    assert generate(drafter, prompt_ids=[1, 2, 3], drafters=[target], max_new_tokens=12).token_ids == wide
    with pytest.raises(OptionError, match="tree_widths"):
        generate(drafter, prompt_ids=[1, 2, 3], drafters=[target], tree_widths=[4], max_new_tokens=12)


def test_a_drafter_whose_positions_the_context_outgrows_drafts_nothing(tokenizers, monkeypatch):
    """A byte-level drafter of 32 positions under a prompt of more bytes: no draft (as a drafter of the target's
    vocabulary stops at its positions), greedy and sampled, and the output is ar's; `auto`, which finds it full at
    its first draft, chooses it no more (it had chosen it on, cheap as it is, for plain steps under its name)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from speculant.models import HFCausalLM

    target = tiny_model("llama", 0, len(tokenizers[0]), init_std=0.2, tokenizer=tokenizers[0])
    torch.manual_seed(1)
    short = HFCausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=257, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                  eos_token_id=None, bos_token_id=None)).eval(), byte_tokenizer(),
                       name="bytes-32")
    prompt = "def quicksort(values): return sorted(values)  # naïve"
    ar = generate(target, prompt, method="ar", max_new_tokens=8).token_ids
    for temperature in (0.0, 0.8):
        result = generate(target, prompt, method="sd", drafter=short, k=3, max_new_tokens=8, temperature=temperature,
                          seed=0)
        assert not sum(result.stats.drafter_forwards.values()) and (temperature or result.token_ids == ar)
    invent(monkeypatch, costs(target, drafter_step=0.02))
    result = generate(target, prompt, method="auto", drafters=[short], max_new_tokens=8)
    assert result.token_ids == ar and result.stats.choices.count("bytes-32") == 1, result.stats.choices


def test_tree_refuses_a_drafter_with_another_vocabulary(tokenizers):
    target, drafter = greedy_pair("llama", 0, tokenizers)
    with pytest.raises(ConfigError, match="another"):
        generate(target, "def", method="tree", drafter=drafter, max_new_tokens=4)


def test_a_byte_tokenizer_and_a_bpe_tokenizer_share_every_byte(tokenizers):
    pair = build_pair(tokenizers[0], byte_tokenizer(), len(tokenizers[0]), 257)
    assert (pair.to_target[:256] >= 0).all() and int(pair.to_target[256]) == -1  # <eos> is not <|end|>


def test_a_target_token_several_drafter_tokens_spell_gets_their_summed_probability():
    """SentencePiece's byte fallback (Llama 2, Mistral, Gemma): `<0x61>` spells what `a` spells, so both map to the
    target's `a`, and a drafted row on the target's ids keeps all of its mass (one of the two overwrote the other)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "b": 2, " ": 3, "<0x61>": 4, "<0x62>": 5}
    fallback = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    target = piece_tokenizer(["a", "b", " ", "ab"], [("a", "b")])
    pair = build_pair(target, PreTrainedTokenizerFast(tokenizer_object=fallback, unk_token="<unk>"), len(target),
                      len(vocab))
    assert int(pair.to_target[4]) == int(pair.to_target[1]) >= 0 and int(pair.to_target[5]) == int(pair.to_target[2])
    q = pair.shared.float()[None]
    q = q / q.sum()
    mapped = pair.on_target(q, len(target))
    assert float(mapped.sum()) == pytest.approx(1) and float(mapped[0, pair.to_target[1]]) == pytest.approx(2 * q[0, 1])


def test_acceptance_estimates_for_a_drafter_of_another_vocabulary(char_target):
    from speculant.analysis.acceptance import estimate

    drafter_tokenizer = bpe_tokenizer(["".join(random.Random(i).choices(CHARS, k=40)) for i in range(200)], 300,
                                      eos=None)
    prompt = char_target.tokenizer.encode("ab 中(")
    ar = generate(char_target, prompt_ids=prompt, method="ar", max_new_tokens=20)
    oracle = TextOracle(drafter_tokenizer, "ab 中(" + "".join(CHARS[i] for i in ar.token_ids))
    (report,) = estimate(char_target, [oracle], [prompt], 20, SamplingConfig())
    assert report.agreement > 0.9 and report.outside_mass is None
    target, drafter, prompt = sampling_cross_pair()
    (report,) = estimate(target, [drafter], [prompt], 6, SamplingConfig(TEMPERATURE))
    assert 0 < report.expected_sampling_acceptance < 1 and 0 < report.outside_mass < 1


def test_a_session_keeps_a_cross_vocabulary_drafter_s_cache_across_turns(tokenizers, tmp_path):
    """A drafter of another tokenizer drafts from the session's DraftCache, as one of the target's does: the next
    turn of a conversation catches up on its new text instead of prefilling the drafter again, and `auto` prices that
    catch-up on the drafter's own tokens (`lag`)."""
    from speculant import Session
    from speculant.methods.auto import catch_up_cost

    target, drafter = greedy_pair("llama", 0, tokenizers)
    drafter.model.save_pretrained(tmp_path / "drafter")
    tokenizers[1].save_pretrained(tmp_path / "drafter")
    session, name = Session(target), str(tmp_path / "drafter")
    ids = target.tokenizer.encode("def quick sort(x):\n    return")
    for turn in range(3):
        result = generate(target, prompt_ids=ids, method="sd", drafter=name, k=4, max_new_tokens=12, session=session)
        assert result.token_ids == generate(target, prompt_ids=ids, method="ar", max_new_tokens=12).token_ids
        (model,) = result.stats.drafter_forwards
        prefills = result.stats.drafter_forwards[model] - result.stats.drafter_steps[model]
        assert prefills == (turn == 0), turn
        ids = ids + result.token_ids + target.tokenizer.encode(" return x")
    cache = session.cache(session.drafter(name))
    made = model_drafter(cache, target, SamplingConfig(), None)
    assert isinstance(made, CrossVocabDrafter) and made.cache is cache
    own = made.own_ids(ids)
    assert len(own) != len(ids) and 0 < made.lag(ids) < len(own) / 4  # (the last turn's new text)

    class Profile:  # a prefill and a forward cost a millisecond a token
        long_ttft_s = 1.0

        @staticmethod
        def prefill_s(tokens):
            return tokens / 1000

        cost = prefill_s

    cache.forget()  # (a prefill of its whole context: priced on its own tokens, not the target's)
    assert catch_up_cost(made, Profile)(ids) == pytest.approx(len(own) / 1000)
