"""Structured output (`models.wrappers.constrained`): the target's rows masked to what a grammar allows after each row's
prefix; every method equals constrained `ar` (greedy) and follows the constrained distribution (sampling)."""

import json
import re
from collections import Counter

import pytest
import torch
from helpers import (ARCHS, DRAFTS_ACCEPTED, bpe_tokenizer, byte_tokenizer, costs, every_method, invent, perturbed,
                     tiny_model, tiny_transformer, total_variation)

from speculant import generate
from speculant.errors import ConfigError
from speculant.models.wrappers.constrained import Constraint

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}  # compact: a random model pads
FORMATS = {
    "regex": ({"type": "regex", "regex": "(ab|ba)[0-9]{2,5}"}, lambda text: re.fullmatch("(ab|ba)[0-9]{2,5}", text)),
    "schema": ({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
               lambda text: set(json.loads(text)) == {"name", "age"}),
    "grammar": ({"type": "grammar", "grammar": 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9]/'},
                lambda text: text in ("yes", "no") or re.fullmatch("maybe [1-9]", text)),
}


def byte_model(arch, seed):
    return tiny_model(arch, seed, vocab=257, init_std=0.2, tokenizer=byte_tokenizer())


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_equals_constrained_ar_and_the_text_matches(arch, name, monkeypatch):
    response_format, matches = FORMATS[name]
    target = byte_model(arch, 0)
    other = perturbed(target, 0.05, 1)
    prompt = list(b"Reply: ")
    free = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=60)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=60, response_format=response_format)
    assert expected.text != free.text and matches(expected.text), expected.text
    assert expected.token_ids[-1] in target.eos_token_ids  # it ended where the grammar was complete
    invent(monkeypatch, costs(target))  # (auto speculates)
    for label, options in every_method(other).items():
        result = generate(target, prompt_ids=prompt, max_new_tokens=60, response_format=response_format, **options)
        assert result.token_ids == expected.token_ids, label
        assert label not in DRAFTS_ACCEPTED or sum(result.stats.accepted_lengths) > 0, label  # (guided drafts)


def test_a_model_drafter_drafts_only_what_the_grammar_allows():
    from speculant.api import decoded_target
    from speculant.config import SamplingConfig
    from speculant.drafters.cross_vocab import model_drafter

    target = byte_model("llama", 0)
    other = byte_model("qwen2", 9)  # another random model: unguided, it drafts arbitrary bytes
    prompt = list(b"Reply: ")
    language = re.compile("(ab|ba)[0-9]{2,5}")
    constrained, _ = decoded_target(target, None, None, Constraint("regex", language.pattern))
    constrained.prefill(prompt)
    for guided, drafter_target in ((True, constrained), (False, target)):
        draft = model_drafter(other, drafter_target, SamplingConfig(), None).propose(prompt, 5).tokens
        text = bytes(draft).decode("latin-1")
        valid = bool(re.fullmatch("(ab|ba)[0-9]{0,3}|(a|b)", text))  # the first five characters of a sentence
        assert valid == guided, text


def test_a_drafter_that_gives_every_allowed_token_no_chance_passes_on_no_forbidden_token():
    """A drafter whose logits are -inf on every token the grammar allows (a head without them, as FR-Spec's): its
    chain ends there, and as a cascade's sampled reviewer its rows stay distributions (a row all -inf made a NaN q,
    which the verifiers read as accepting any token), so a forbidden token below it is never kept."""
    from speculant.config import SamplingConfig
    from speculant.drafters.base import Draft, Drafter
    from speculant.drafters.cascade import CascadeDrafter
    from speculant.drafters.model import ModelDrafter
    from speculant.verify import verify_block, verify_sampling

    class Forbidden(Drafter):
        name = "forbidden"

        def propose(self, context, k):
            return Draft([7] * k, None)

    model, prompt, sampling = byte_model("llama", 0), list(b"Reply: "), SamplingConfig(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    reviewer = ModelDrafter(model, sampling, generator, allowed=torch.arange(257) < 200, width=257,
                            guide=lambda prefix: torch.arange(257) == 250)  # the grammar allows 250 alone
    assert reviewer.propose(prompt, 3).tokens == []
    draft = CascadeDrafter([reviewer, Forbidden()], [[3, 0], [3]], 1.0, sampling, generator).propose(prompt, 3)
    assert draft.probs is not None and bool(torch.isfinite(draft.probs).all())
    p = torch.zeros(len(draft.tokens) + 1, 257)
    p[:, 250] = 1.0  # the constrained target
    for verify in (verify_sampling, verify_block):
        n, token = verify(torch.tensor(draft.tokens), p, draft.probs, torch.Generator().manual_seed(1))
        assert 7 not in draft.tokens[:n] and token == 250, verify


def test_a_draft_the_grammar_ends_leaves_its_drafter_s_cache_known_whole():
    """A draft the grammar ends after some tokens ran them all: the drafter's cache records every one (it recorded
    all but the last, which the next proposal ran again)."""
    from speculant.config import SamplingConfig
    from speculant.drafters.model import ModelDrafter

    model, prompt = byte_model("llama", 0), list(b"Reply: ")
    drafter = ModelDrafter(model, SamplingConfig(), None, guide=lambda prefix: None if len(prefix) < len(prompt) + 2
                           else torch.zeros(257, dtype=torch.bool))  # free for two tokens, then nothing allowed
    tokens = drafter.propose(prompt, 5).tokens
    assert len(tokens) == 2 and drafter.cache.ids == prompt + tokens and model.cache_len == len(prompt) + 2
    assert drafter.lag(prompt + tokens) == 0


def test_trees_drafted_ahead_under_a_grammar_start_from_a_token_it_allows():
    """Stage scheduling guesses the token after the likeliest path as the grammar allows it (the drafter's own
    likeliest, outside the grammar, was never committed: every tree drafted ahead was dropped)."""
    target, prompt = byte_model("llama", 0), list(b"Reply: ")
    hexadecimal = {"type": "regex", "regex": "[0-9a-f]{40}"}
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=48, response_format=hexadecimal)
    result = generate(target, prompt_ids=prompt, method="tree", drafter="self", depth=3, width=3, schedule="stage",
                      max_new_tokens=48, response_format=hexadecimal)
    assert result.token_ids == expected.token_ids and result.stats.stage.hits > result.stats.stage.drafted / 2


def test_a_tree_drafter_grows_only_paths_the_grammar_allows():
    from speculant.api import decoded_target
    from speculant.trees.baselines import nway_shape
    from speculant.trees.drafter import TreeDrafter

    target = byte_model("llama", 0)
    other = byte_model("qwen2", 9)  # another random model: unguided, it drafts arbitrary bytes
    prompt = list(b"Reply: ")
    prefix = re.compile("(ab|ba)[0-9]{0,3}|(a|b)")  # the first characters of a sentence of "(ab|ba)[0-9]{2,5}"
    constrained, _ = decoded_target(target, None, None, Constraint("regex", "(ab|ba)[0-9]{2,5}"))
    constrained.prefill(prompt)
    for guided, verifier in ((True, constrained), (False, target)):
        for shape in (None, nway_shape(2, 3)):  # equal growth; a fixed shape (two ways: the grammar allows two)
            drafter = TreeDrafter(other, 3, shape=shape, verifier=verifier)
            tree = drafter.propose_tree(prompt, 3, 3).tree
            paths = [bytes(tree.tokens[n] for n in tree.path_to(node)[1:]).decode("latin-1")
                     for node in range(1, len(tree))]
            assert len(paths) >= 6 and all(prefix.fullmatch(path) for path in paths) == guided, (shape, paths)


def test_sampling_follows_the_constrained_distribution():
    """600 seeded samples of "[a-d][0-3]" with speculative sampling follow the exact constrained distribution
    (the target's softmax masked at each position): TV < 0.1, where sampling noise is about 0.05."""
    target = byte_model("llama", 2)
    prompt, letters, digits = list(b"x"), list(b"abcd"), list(b"0123")
    with torch.no_grad():
        first = target.model(torch.tensor([prompt])).logits[0, -1, letters].softmax(-1)
        exact = {chr(a) + chr(d): float(first[i]) * float(target.model(torch.tensor([prompt + [a]])).logits[0, -1, digits]
                                                         .softmax(-1)[j])
                 for i, a in enumerate(letters) for j, d in enumerate(digits)}
    counts = Counter(generate(target, prompt_ids=prompt, method="sd", drafter=perturbed(target, 0.3, 3), k=2,
                              max_new_tokens=4, temperature=1.0, seed=seed,
                              response_format={"type": "regex", "regex": "[a-d][0-3]"}).text for seed in range(600))
    assert set(counts) <= set(exact), counts
    keys = sorted(exact)
    got = torch.tensor([counts[k] / 600 for k in keys])
    assert total_variation(got, torch.tensor([exact[k] for k in keys])) < 0.1


DEEP = {"type": "string"}
for _ in range(300):  # (nested past what llguidance follows; a server refuses it sooner, at MAX_FORMAT_DEPTH)
    DEEP = {"type": "array", "items": DEEP}
DEEPER = {"type": "integer"}
for _ in range(600):  # (strict: nested past Python's stack, where the strict check walks it)
    DEEPER = {"type": "object", "properties": {"a": DEEPER}, "required": ["a"], "additionalProperties": False}
CYCLE = {"type": "object", "required": ["a"], "additionalProperties": False}
CYCLE["properties"] = {"a": CYCLE}


@pytest.mark.parametrize("response_format,message", [
    ({"type": "xml"}, "response_format type must be one of"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
    ({"type": "regex", "regex": ""}, "non-empty"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "the grammar does not compile: .*undefined_rule"),
    ({"type": "regex", "regex": "("}, "the regex does not compile: .*unclosed group"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "Invalid type: strin"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a bool"),
    ({"type": "json_schema", "json_schema": {"schema": DEEP}}, "the json_schema does not compile: recursion limit"),
    ({"type": "json_schema", "json_schema": {"schema": DEEPER, "strict": True}}, "the json_schema does not compile"),
    ({"type": "json_schema", "json_schema": {"schema": CYCLE, "strict": True}}, "the json_schema does not compile"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "number", "maximum": float("nan")}}},
     "the json_schema does not compile: Out of range float"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": [b"x"]}}}, "the json_schema does not compile: .*bytes"),
])
def test_a_bad_response_format_is_refused_before_the_model_loads(response_format, message):
    with pytest.raises(ConfigError, match=message):
        generate("no-such/model", "hi", method="ar", response_format=response_format)


def test_a_grammar_llguidance_cannot_follow_fails_loudly_never_leaves_it():
    """A pattern that compiles but outgrows llguidance's lexer once text comes (a{1000000}) is an error where it
    fails, not a mask dropped and text outside the pattern."""
    with pytest.raises(ConfigError, match="llguidance could not follow the regex: ") as refused:
        generate(byte_model("llama", 0), prompt_ids=[1], method="ar", max_new_tokens=4,
                 response_format={"type": "regex", "regex": "a{1000000}"})
    assert refused.value.field == "response_format"  # (what a server's answer names)
    # a grammar past MAX_GRAMMAR_CHARS is refused before it compiles (a server's client's 700 KB of literals took 3 GB)
    from speculant.models.wrappers.constrained import MAX_GRAMMAR_CHARS

    words = " ".join(f'"w{i}x"' for i in range(MAX_GRAMMAR_CHARS // 6))
    with pytest.raises(ConfigError, match=f"characters; at most {MAX_GRAMMAR_CHARS} compile"):
        generate(byte_model("llama", 0), prompt_ids=[1], method="ar", max_new_tokens=4,
                 response_format={"type": "grammar", "grammar": f"start: {words}"})


def chain(rule, room):
    """The longest chain of rules `rule(i)` (each naming the next) that fits in `room` characters."""
    rules, i = [], 0
    while sum(map(len, rules)) + len(rule(i)) <= room:
        rules.append(rule(i))
        i += 1
    return rules, i


def test_the_deepest_chains_a_grammar_may_spell_compile_without_ending_the_process():
    """llguidance compiles by recursion: a chain of `$ref`s or of rules well within a request's body overflowed a
    thread's stack, and the process died with a segmentation fault (a server with it). Compiles run on a deep stack; the
    longest chains MAX_GRAMMAR_CHARS lets through compile and follow text, on a thread of the usual stack as a server's
    worker is; a longer schema is refused by its length before it compiles."""
    import threading

    from speculant.models.wrappers.constrained import MAX_GRAMMAR_CHARS, Matcher

    room = MAX_GRAMMAR_CHARS - 200
    lark, n = chain(lambda i: f'a{i}: "x" a{i + 1} | "y"\n', room)
    grammar = Constraint("grammar", "start: a0\n" + "".join(lark) + f'a{n}: "z"\n')

    def references(room):  # objects each holding the next, by reference
        defs, n = chain(lambda i: f'"d{i}": {{"type": "object", "properties": {{"a": {{"$ref": "#/$defs/d{i + 1}"}}}}, '
                        '"required": ["a"]}, ', room)
        return {"$defs": {**json.loads("{" + "".join(defs)[:-2] + "}"), f"d{n}": {"type": "integer"}},
                "$ref": "#/$defs/d0"}, n

    schema, n = references(room // 10 * 9)  # (as compiled, the schema's grammar is a tenth shorter than its JSON)
    assert n > 1000 and len(json.dumps(schema)) <= MAX_GRAMMAR_CHARS
    followed = []

    def follow():
        for constraint, text in ((grammar, "x" * 100 + "y"), (Constraint("json_schema", schema), '{"a": {"a": ')):
            matcher = Matcher(constraint, byte_tokenizer(), 257, [256])
            followed.append(matcher.follow(list(text.encode())))

    worker = threading.Thread(target=follow)  # (the process's default stack, as asyncio's and the batcher's threads)
    worker.start()
    worker.join()
    assert followed == [True, True]
    schema, _ = references(MAX_GRAMMAR_CHARS + 100)
    with pytest.raises(ConfigError, match=f"the json_schema is {len(json.dumps(schema))} characters; at most"):
        Constraint("json_schema", schema)


def test_structured_output_needs_an_end_of_sequence_token_and_a_tokenizer_llguidance_reads():
    """Without an end-of-sequence token, the text went on past the grammar's end unconstrained (llguidance ended it
    with an id of its own choosing, which ends nothing here); a decoder llguidance cannot read was its traceback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    endless = bpe_tokenizer(["abc abd xyz"] * 10, 300, eos=None)
    with pytest.raises(ConfigError, match="needs a model with an end-of-sequence token"):
        generate(tiny_model("llama", 1, len(endless), tokenizer=endless), "abc", method="ar", max_new_tokens=8,
                 response_format={"type": "regex", "regex": "ab"})
    words = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate("abcxyz")} | {"<eos>": 6}, unk_token="<eos>"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.Split("", "isolated"), decoders.Metaspace()
    unread = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>")
    with pytest.raises(ConfigError, match="llguidance cannot read this tokenizer"):
        generate(tiny_model("llama", 1, len(unread), tokenizer=unread), "abc", method="ar", max_new_tokens=4,
                 response_format={"type": "regex", "regex": "ab"})


def test_the_grammar_ends_the_text_with_the_model_s_end_of_sequence_tokens():
    """The text a grammar completes ends with any token that ends the model's generation: llguidance's end was the
    tokenizer's `eos_token_id` alone, so a model's other end tokens (a chat model's turn end beside the tokenizer's
    text end) were masked where the text was complete, and an id past the logits was its error."""
    from speculant.models import HFCausalLM

    target = HFCausalLM(tiny_transformer("llama", 0, vocab=257), byte_tokenizer(), name="t", extra_eos=frozenset({7}))
    regex = {"type": "regex", "regex": "ab"}
    for method, options in (("ar", {}), ("sd", {"drafter": "self"})):
        assert generate(target, prompt_ids=[1, 2], method=method, max_new_tokens=6, response_format=regex,
                        logit_bias={7: 50.0}, **options).token_ids == [97, 98, 7]  # (7 was masked: 256 ended it)
    past = HFCausalLM(tiny_transformer("llama", 0, vocab=257), byte_tokenizer(), name="t", extra_eos=frozenset({300}))
    assert generate(past, prompt_ids=[1, 2], method="ar", max_new_tokens=6, response_format=regex).text == "ab"


def test_dsi_refuses_structured_output():
    with pytest.raises(ConfigError, match="response_format not available with dsi"):
        generate("no-such/model", "hi", method="dsi", drafter="maxgram", response_format={"type": "json_object"})
