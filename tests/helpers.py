"""Tiny randomly initialised models, a byte tokenizer and scripted drafters for exact, fast tests."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from speculant.drafters.base import Draft, Drafter
from speculant.drafters.vocab import byte_of_char
from speculant.models import HFCausalLM
from speculant.models.base import Backend, Capabilities

ARCHS = ("llama", "qwen2")
MORE_ARCHS = ("gpt2", "gpt_neox", "mistral")  # every method's exactness is checked on these too
BYTE_VOCAB = 257  # 256 bytes + <eos>
# Every device the engine must run on; CUDA cases run where a GPU is (never in CI) and skip elsewhere.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")))
# Tests that start Ray clusters run on one xdist worker, one after another (`--dist loadgroup`): two local clusters
# started at once would contend for Ray's fixed default ports.
RAY = pytest.mark.xdist_group("ray")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: token i is byte i (as GPT-2 maps it), 256 is <eos>."""
    vocab = byte_of_char() | {"<eos>": 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def bpe_tokenizer(corpus: list[str], vocab_size: int, eos: str | None = "<|end|>") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer) trained on `corpus`: another corpus or size, another
    vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=[eos] if eos else []))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


def piece_tokenizer(pieces: list[str], merges: list[tuple[str, str]] = ()) -> PreTrainedTokenizerFast:
    """A tokenizer over the given strings (single characters, and the merges of two of them), no bytes, no
    pre-tokenizer, no end-of-sequence token: every text over its characters has one tokenization."""
    tokenizer = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=list(merges)))
    tokenizer.decoder = decoders.Fuse()  # decoding joins the pieces as they are
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def tiny_transformer(arch: str, seed: int, vocab: int = 64, init_std: float = 0.02, layers: int = 2,
                     hidden: int = 32, window: int | None = 8):
    """A seeded fp32 model of one of ARCHS + MORE_ARCHS, small enough to run hundreds of generations; Mistral's
    attention slides over a `window` shorter than most tests' generations."""
    tokens = dict(vocab_size=vocab, initializer_range=init_std, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common = dict(tokens, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=512)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False))
    elif arch == "llama3":  # Llama 3's rope scaling, its original context short enough to matter here
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64, rope_theta=10000.0)
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2, rope_parameters=scaling))
    elif arch == "qwen3":  # heads of 2 * hidden / heads dimensions, as Qwen3-0.6B's 128 of 1024 / 16
        model = Qwen3ForCausalLM(Qwen3Config(**common, num_key_value_heads=2, head_dim=2 * hidden // 4,
                                             tie_word_embeddings=False))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**common, num_key_value_heads=2, sliding_window=None))
    elif arch in ("gemma2", "gemma3"):  # windowed layers between global ones (Gemma 3: 5 to 1), heads of 64; Gemma 3's
        # head its own (the tied head, its scaled embeddings dominant in a model this small, repeats the last token)
        gemma = dict(common, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=window)
        if arch == "gemma2":
            model = Gemma2ForCausalLM(Gemma2Config(**gemma))
        else:  # its global layers' rope scaled linearly, as Gemma 3 4B's
            rope = {"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                    "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
            model = Gemma3ForCausalLM(Gemma3TextConfig(**gemma, rope_parameters=rope, tie_word_embeddings=False))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, num_key_value_heads=2, sliding_window=window))
    elif arch == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**common, rotary_pct=0.5))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**tokens, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512))
    else:
        raise ValueError(arch)
    return model.float().eval()


def tiny_model(arch: str, seed: int, vocab: int = 64, init_std: float = 0.02, tokenizer=None,
               device: str = "cpu") -> HFCausalLM:
    model = tiny_transformer(arch, seed, vocab, init_std).to(device)
    return HFCausalLM(model, tokenizer, name=f"tiny-{arch}-{seed}")


def perturbed(model: HFCausalLM, scale: float, seed: int) -> HFCausalLM:
    """A copy of `model` with noise on every weight: a drafter that agrees often, not always."""
    torch.manual_seed(seed)
    copy = type(model.model)(model.model.config).to(model.device)
    copy.load_state_dict(model.model.state_dict())
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(torch.randn_like(parameter) * scale * parameter.std().clamp_min(1e-3))
    return HFCausalLM(copy.eval(), model.tokenizer, name=model.name + "-perturbed")


class MarkovLM(Backend):
    """A CausalLM without a transformer, for statistical tests that draw thousands of generations: the logits
    after a position are a seeded random function of its token and its parent's (the token before it, or its
    parent node in a token tree), [vocab]. Its cache holds token ids; it keeps the CausalLM contract (prefill,
    chain and tree forwards, rollback, keep, share) at ~30 us a forward, where a tiny transformer takes ~1 ms."""

    tokenizer = None
    capabilities = Capabilities(shares_weights=True)
    eos_token_ids: frozenset[int] = frozenset()
    max_positions = None
    dtype = torch.float32
    numerics = "fp32"

    def __init__(self, vocab: int, seed: int, scale: float = 3.0, device: str = "cpu", table=None):
        self.vocab_size, self.name, self.device = vocab, f"markov-{seed}", torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        self.table = table if table is not None else (torch.randn(vocab + 1, vocab, vocab, generator=generator)
                                                      * scale).to(device)  # [parent token or none, token, vocab]
        self._ids: list[int] = []
        self._parents: list[int] = []  # cache position of each position's parent (-1: none)

    def share(self) -> "MarkovLM":
        twin = MarkovLM(self.vocab_size, 0, device=str(self.device), table=self.table)
        twin.name = self.name
        return twin

    @property
    def cache_len(self) -> int:
        return len(self._ids)

    def _rows(self, start: int) -> torch.Tensor:
        ids = self._ids + [self.vocab_size]  # index -1: no parent
        parents = torch.tensor([ids[p] for p in self._parents[start:]], device=self.device)
        return self.table[parents, torch.tensor(self._ids[start:], device=self.device)]

    def prefill(self, ids) -> torch.Tensor:
        self._ids, self._parents = list(ids), list(range(-1, len(ids) - 1))
        return self._rows(len(ids) - 1)[0]

    def forward(self, ids, positions=None, tree=None) -> torch.Tensor:
        start = len(self._ids)
        if tree is None:
            parents = list(range(start - 1, start + len(ids) - 1))
        else:
            first = len(tree) - len(ids)
            root = start - first  # cache position of the tree's root
            parents = [root + tree.parents[node] for node in range(first, len(tree))]
        self._ids += list(ids)
        self._parents += parents
        return self._rows(start)

    def rollback(self, n: int) -> None:
        del self._ids[n:], self._parents[n:]

    def keep(self, kept, path) -> None:  # an accepted path: a chain again
        self._ids = self._ids[:kept] + [self._ids[i] for i in path]
        self._parents = list(range(-1, len(self._ids) - 1))


class ScriptedDrafter(Drafter):
    """Proposes the known reference continuation, replacing each token by a wrong one with
    probability `error_rate`: 0 always agrees, 1 never agrees, in between agrees at random."""

    name = "scripted"

    def __init__(self, prompt: list[int], reference: list[int], error_rate: float, vocab: int, seed: int):
        self.prompt, self.reference, self.error_rate, self.vocab = prompt, reference, error_rate, vocab
        self.rng = random.Random(seed)

    def propose(self, context: list[int], k: int) -> Draft:
        done = len(context) - len(self.prompt)
        assert context == self.prompt + self.reference[:done], "the decoder left the reference path"
        truth = self.reference[done:done + k]
        truth += [self.rng.randrange(self.vocab) for _ in range(k - len(truth))]
        tokens = [t if self.rng.random() >= self.error_rate else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                  for t in truth]
        return Draft(tokens, None)

    def observe(self, n_accepted: int) -> None:
        pass


DRAFTS_ACCEPTED = ("sd itself", "sd other", "tree itself", "tree other", "cascade", "auto")  # `every_method`'s
# runs whose drafts a test asserts are accepted, where `other` agrees with the target often (a perturbed copy, other
# quants) and auto's costs are invented (`invent`: on the tiny models' measured ones it may decode plainly)


def every_method(other) -> dict[str, dict]:
    """The method runs a backend's exactness test compares with its greedy `ar`; `other` is a second model
    on the same backend."""
    return {
        "sd maxgram": dict(method="sd", drafter="maxgram", k=4),
        "sd suffix": dict(method="sd", drafter="suffix", k=4),
        "sd itself": dict(method="sd", drafter="self", k=3),
        "sd other": dict(method="sd", drafter=other, k=5),
        "tree itself": dict(method="tree", drafter="self", depth=3, width=3),
        "tree other": dict(method="tree", drafter=other, depth=4, width=2),
        "cascade": dict(method="cascade", drafters=[other, "maxgram"]),
        "auto": dict(method="auto", drafters=[other, "maxgram", "suffix"]),
    }


def assert_trees_fit_the_last_positions(model, vocab: int, patch) -> None:
    """A prompt 12 positions short of the model's cache, trees of 16 nodes: each tree is cut to the slots left, and
    every tree path (equal growth, a fixed shape, drafted ahead, auto's tree candidates) gives `ar`'s tokens to the
    last position, its drafts accepted (auto's costs invented so that it drafts a tree there: `patch`, pytest's
    monkeypatch)."""
    from speculant import generate

    prompt = random_prompt(3, vocab, model.max_positions - 12)
    expected = generate(model, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids
    tree = dict(method="tree", drafter="self", depth=4, width=4)
    invent(patch, costs(model))  # (the tiny model's measured costs: auto would decode plainly)
    for options in (tree, {**tree, "shape": "nway"}, {**tree, "schedule": "stage"},
                    dict(method="auto", drafters="self", tree_widths="4")):
        result = generate(model, prompt_ids=prompt, max_new_tokens=12, **options)
        assert result.token_ids == expected, options
        assert sum(result.stats.accepted_lengths) > 0, options
    assert any("tree" in choice for choice in result.stats.choices), result.stats.choices  # (auto's)


def greedy(model, prompt: list[int], n: int = 16, vocab: int = BYTE_VOCAB) -> list[int]:
    """transformers' own greedy decoding of `model`, the whole sequence recomputed at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1, :vocab].argmax()))
    return ids[len(prompt):]


def best_of(tries: int, measure, good):
    """`measure()` again, up to `tries` times, until `good` holds of what it returned; the last result. For timings
    of the latency twin (padded forwards, real threads): a loaded machine only wakes threads late, which makes a
    run slower and never faster, so one good try shows the engine's own time, and a real bug fails every try."""
    for _ in range(tries):
        result = measure()
        if good(result):
            break
    return result


def random_prompt(seed: int, vocab: int, length: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def costs(target, drafter_step=0.05, target_step=1.0):
    """Machine profiles in which the target's forward is flat in W and model drafters are cheap."""
    from speculant.latency import LatencyProfile

    def profile(model, *args, **kwargs):
        step = target_step if model is target else drafter_step
        return LatencyProfile(model.name, "", "cpu", 256, step, step, {1: step, 16: step * 1.1})
    return profile


def invent(patch, profile):
    """Make auto decide from the invented machine `profile`s alone: not rescaled by what the tiny models'
    forwards really take (a thousandth of them), and with every metered forward taking its profile's time, so
    that what auto measures as it drafts (a cascade's cost) does not depend on the machine's speed either."""
    from speculant import latency
    from speculant.decoding import adaptive
    from speculant.models.wrappers.metered import Metered, Usage

    def timed(self, logits, ids):
        u = self.usage
        self.usage = Usage(u.forwards + 1, u.steps + 1, u.seconds + profile(self.model).cost(len(ids)))
        return logits
    patch.setattr(latency, "machine_profile", profile)
    patch.setattr(adaptive, "SCALE_RANGE", (1.0, 1.0))
    patch.setattr(Metered, "forward", lambda self, ids, positions=None, tree=None:
                  timed(self, self.model.forward(ids, positions, tree=tree), ids))
    patch.setattr(Metered, "catch_up", lambda self, ids, rows=1: timed(self, self.model.catch_up(ids, rows), ids))


def run_job(engine, ids, max_tokens=24, sampling=None, seed=None, stops=(), method=None, options=None):
    """One request through a serving engine (`speculant.serve.engine`), waited for: its Outcome."""
    import threading

    from speculant.config import SamplingConfig
    from speculant.serve.engine import ServeJob

    done, out = threading.Event(), []
    job = ServeJob(ids, max_tokens, sampling or SamplingConfig(), seed, stops, method, options or {})
    engine.submit(job, lambda piece, logprobs: None, lambda outcome: (out.append(outcome), done.set()))
    assert done.wait(120)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def assert_served_rows_batch_and_equal_solo(backend_module, target, drafter, prompts, monkeypatch):
    """A server on `target`'s backend (`backend_module`, whose `forward_rows` runs its batches) runs concurrent
    requests' calls as one forward per model; each greedy output equals the model's `ar` alone, for sd and auto (on a
    machine where the model drafter pays, so that auto's batched rows draft with it too)."""
    from concurrent.futures import ThreadPoolExecutor

    from speculant import generate
    from speculant.methods import get_method
    from speculant.serve.engine import Engine

    batched = []  # rows per batched forward
    forward_rows = backend_module.forward_rows
    monkeypatch.setattr(backend_module, "forward_rows", lambda rows: batched.append(len(rows)) or forward_rows(rows))
    expected = [generate(target, prompt_ids=p, method="ar", max_new_tokens=16).text for p in prompts]
    invent(monkeypatch, costs(target))
    for method, options in [("sd", {"drafter": drafter, "k": 3}), ("auto", {"drafters": (drafter, "maxgram")})]:
        batched.clear()
        engine = Engine(target, method, get_method(method).make_options(options), 8, 16)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outcomes = list(pool.map(lambda p: run_job(engine, p, max_tokens=16), prompts))
        engine.close()
        assert [outcome.text for outcome in outcomes] == expected, method
        assert max(batched, default=0) > 1, method
        assert any(o.speculative["drafter_forwards"] for o in outcomes), method  # (the model drafted)
