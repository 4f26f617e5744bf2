"""The core's contracts: a Session owns what generations load and learn, drafters plug in by one registration,
backends declare their capabilities, and no algorithm keeps state or asks a backend's name."""

import ast
import gc
import re
import types
import weakref
from pathlib import Path

import pytest
import torch

from helpers import costs, invent, random_prompt, tiny_model, tiny_transformer
from speculant import Draft, Drafter, Session, generate, load_model, register_drafter
from speculant.drafters import registry
from speculant.errors import ConfigError
from speculant.models.base import Backend, Capabilities, CausalLM
from speculant.models.wrappers.metered import Metered
from speculant.trees.tree import TokenTree

VOCAB = 64
PACKAGE = Path(__file__).resolve().parent.parent / "speculant"


class Echo(Drafter):
    """Proposes the context's last k tokens again: a drafter defined outside the package."""

    name = "echo"

    def __init__(self, vocab_size: int):
        self.vocab_size, self.began, self.observed = vocab_size, 0, []

    def begin(self, prompt_ids):
        self.began += 1
        return self

    def propose(self, context, k):  # as the README's: k >= 1
        return Draft(list(context[-k:]))

    def observe(self, n_accepted):
        self.observed.append(n_accepted)


made: list[Echo] = []


@register_drafter("echo")
def echo(target):
    made.append(Echo(target.vocab_size))
    return made[-1]


def test_a_drafter_registered_outside_the_package_drives_sd_and_auto_by_name():
    target = tiny_model("llama", 11, VOCAB)
    prompt = random_prompt(3, VOCAB, 8) * 2
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
    sd = generate(target, prompt_ids=prompt, drafter="echo", k=4, max_new_tokens=24)
    assert sd.token_ids == expected and made[-1].began == 1 and made[-1].observed  # its lifecycle ran

    class Wrong(Drafter):  # every proposal rejected: one token a step, the last step with no room to draft
        name = "wrong"

        def __init__(self):
            self.proposed, self.observed = 0, []

        def propose(self, context, k):
            self.proposed += 1
            return Draft([(expected[len(context) - len(prompt)] + 1) % VOCAB])

        def observe(self, n_accepted):
            self.observed.append(n_accepted)

    wrong = Wrong()
    assert generate(target, prompt_ids=prompt, drafter=wrong, k=2, max_new_tokens=6).token_ids == expected[:6]
    assert wrong.proposed == 4 and wrong.observed == [0] * 4  # (not told of the last step, which proposed nothing)
    assert sd.stats.draft_lengths and max(sd.stats.draft_lengths) == 4
    auto = generate(target, prompt_ids=prompt, method="auto", drafters=["echo", "maxgram"], max_new_tokens=24)
    assert auto.token_ids == expected
    assert "echo" in auto.stats.choices  # auto weighed it and chose it, as a drafter of unknown cost
    for n in (1, 2, 3, 5):  # replies that end where one token is left: a drafter is never asked for 0 (`[-0:]`: all)
        assert generate(target, prompt_ids=prompt, drafter="echo", k=4, max_new_tokens=n).token_ids == expected[:n]
        assert generate(target, prompt_ids=prompt, method="cascade", drafters=["echo", "maxgram"],
                        max_new_tokens=n).token_ids == expected[:n]


def test_a_drafter_registered_again_under_its_name_drafts_from_its_new_factory(monkeypatch):
    """A notebook's cell run again registers its factory again (the same name, module and qualname: allowed); the
    target's session had kept the drafter the first factory made, so the new one never ran."""
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))  # what it registers goes with the test
    target, prompt, made_by = tiny_model("llama", 11, VOCAB), random_prompt(3, VOCAB, 8), []

    def cell(mark):
        @register_drafter("echo-cell")
        def factory(target):
            made_by.append(mark)
            return Echo(target.vocab_size)

    for mark in ("first", "first", "second"):  # (the second generation reuses the first's drafter)
        if mark not in made_by:
            cell(mark)
        generate(target, prompt_ids=prompt, drafter="echo-cell", k=2, max_new_tokens=4)
    assert made_by == ["first", "second"]


def test_a_registered_name_is_a_drafter_spec_and_a_taken_one_is_refused(monkeypatch):
    from speculant.drafters.spec import DrafterSpec

    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))  # what it registers goes with the test

    assert DrafterSpec.parse("echo").kind == "echo" and DrafterSpec.parse("maxgram").kind == "maxgram"
    assert DrafterSpec.parse("qwen2.5-coder-0.5b@lean").backend == "lean"
    with pytest.raises(ConfigError, match="takes no quantization"):
        DrafterSpec.parse("echo@int8")
    registry.DRAFTERS.pop("suffix", None)  # as before the built-in module registers itself
    with pytest.raises(ConfigError, match="built in"):
        register_drafter("suffix")(echo)
    registry.kind("maxgram")
    with pytest.raises(ConfigError, match="already registered"):
        register_drafter("maxgram")(echo)  # after
    with pytest.raises(ConfigError, match="cannot name a drafter"):
        register_drafter("self")(echo)
    with pytest.raises(ConfigError, match="cannot name a drafter"):
        register_drafter("qwen2.5-coder-0.5b")(echo)  # a catalog model's name would stand in for the model
    for name in ("org/model", "mine.gguf", "tab\tname", "two\nlines", "", "-flag"):  # a model's id or path; unreadable
        with pytest.raises(ConfigError, match="cannot name a drafter"):
            register_drafter(name)(echo)
    with pytest.raises(ConfigError, match="takes the drafter's name"):
        register_drafter(echo)  # (the decorator without its name)
    with pytest.raises(ConfigError, match=r"must be called with \(target, session\)"):
        register_drafter("one-argument", with_session=True)(echo)
    class Bare(Drafter):  # a Drafter class whose constructor takes no target
        name = "bare"

    with pytest.raises(ConfigError, match=r"must be called with \(target\)"):
        register_drafter("a-class")(Bare)

    class NotADrafter:
        name = "plain"

    register_drafter("not-a-drafter")(lambda target: NotADrafter())
    with pytest.raises(ConfigError, match="not a speculant.Drafter"):
        generate(tiny_model("llama", 1, VOCAB), prompt_ids=[1, 2], drafter="not-a-drafter", max_new_tokens=2)


def test_an_installed_plugin_registers_through_the_entry_point_group(monkeypatch):
    class EntryPoint:
        name = "plugged"

        def load(self):
            return lambda target: Echo(target.vocab_size)

    monkeypatch.setattr(registry, "_plugins", lambda: {"plugged": EntryPoint()})
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))  # what it registers goes with the test
    assert registry.is_registered("plugged") and "plugged" in registry.names() and "plugged" not in registry.DRAFTERS
    target = tiny_model("llama", 2, VOCAB)
    prompt = random_prompt(4, VOCAB, 6) * 2
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids
    assert generate(target, prompt_ids=prompt, drafter="plugged", k=3, max_new_tokens=12).token_ids == expected
    assert "plugged" in registry.DRAFTERS  # loaded on first use

    class Misnamed:  # an entry point whose module registers another name than the entry point's
        name, value = "echo2", "my_plugin"

        def load(self):
            register_drafter("my-echo")(lambda target: Echo(target.vocab_size))
            return types.ModuleType("my_plugin")

    monkeypatch.setattr(registry, "_plugins", lambda: {"echo2": Misnamed()})
    with pytest.raises(ConfigError, match="^plugin 'echo2' \\(my_plugin\\) registered no drafter named 'echo2'"):
        registry.kind("echo2")  # (it said "unknown drafter 'echo2'" and listed echo2 among the registered)

    class Broken:  # an entry point naming what its package lacks: importlib's raw error named no plugin
        name, value = "broken", "their_plugin:nonexistent"

        def load(self):
            raise AttributeError("module 'their_plugin' has no attribute 'nonexistent'")

    monkeypatch.setattr(registry, "_plugins", lambda: {"broken": Broken()})
    with pytest.raises(ConfigError, match="^plugin 'broken' \\(their_plugin:nonexistent\\) failed to load: Attr"):
        registry.kind("broken")


def test_a_stream_closed_from_another_thread_or_ended_at_exit_ends_quietly():
    """`close` while another thread takes a token (it raised "generator already executing", and the stream went on):
    the stream ends once that token is taken. A generation ended between its steps, as the interpreter's exit ends
    the paused ones (`api.LIVE`): its reader's next call ends the stream (it raised AttributeError in a timer)."""
    import threading
    import time

    from speculant import api

    ended = []

    class Slow(Drafter):
        name = "slow"

        def propose(self, context, k):
            time.sleep(0.05)
            return Draft([], None)

        def end(self, prompt_ids, output_ids):
            ended.append(len(output_ids))

    target = tiny_model("llama", 2, VOCAB)
    stream = generate(target, prompt_ids=[1, 2, 3], drafter=Slow(), max_new_tokens=64, stream=True)
    read, failed = [], []

    def take() -> None:
        try:
            read.extend(stream)
        except Exception as error:  # noqa: BLE001
            failed.append(error)

    reader = threading.Thread(target=take)
    reader.start()
    deadline = time.monotonic() + 30
    while not read and time.monotonic() < deadline:  # (a token read, then closed while the next is being taken)
        time.sleep(0.01)
    stream.close()  # (it returns once the generation has ended: its drafter told)
    assert ended
    reader.join(10)
    assert not failed and 0 < len(read) < 64 and stream.result is None
    stream = generate(target, prompt_ids=[1, 2, 3], method="ar", max_new_tokens=8, stream=True)
    first = next(stream)
    for hold in list(api.LIVE):
        hold.end()
    assert first is not None and list(stream) == [] and stream.result is None


def test_a_plugin_whose_name_cannot_name_a_drafter_is_left_out_with_a_warning(monkeypatch, caplog):
    class EntryPoint:
        value = "theirs:factory"

        def __init__(self, name):
            self.name = name

    names = ("plugged", "qwen2.5-coder-0.5b", "org/model", "self")
    monkeypatch.setattr(registry, "entry_points", lambda group: [EntryPoint(n) for n in names])
    with caplog.at_level("WARNING", logger=registry.__name__):
        plugins = registry._plugins.__wrapped__()
    assert list(plugins) == ["plugged"]  # (the others had stood for a catalog model, a Hugging Face id, the target)
    assert sum("left out" in r.message for r in caplog.records) == 3


def test_a_session_s_drafter_checks_the_dtype_it_is_given():
    """`Session.drafter(spec, dtype)` took any dtype for a drafter that loads no model ("fp16" for maxgram,
    "nonsense" for self); the dtype a method gives all its drafters still passes those that load none."""
    target = tiny_model("llama", 1, 64)
    session = Session(target)
    for spec, dtype in (("maxgram", "fp16"), ("self", "nonsense")):
        with pytest.raises(ConfigError, match=f"drafter dtype must be one of bf16, fp32, got '{dtype}'"):
            session.drafter(spec, dtype)
    with pytest.raises(ConfigError, match="runs its GGUF's own types"):
        session.drafter("model.gguf", "fp32")
    assert session.drafter("maxgram", "fp32").name == "maxgram"


def test_two_sessions_on_one_target_keep_separate_learned_state():
    target = tiny_model("llama", 7, VOCAB)
    prompt = random_prompt(5, VOCAB, 6) * 3
    first, second = Session(target), Session(target)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    result = generate(target, prompt_ids=prompt, method="auto", drafters=["maxgram"], max_new_tokens=30,
                      session=first)
    assert result.token_ids == expected
    assert first.acceptance and len(first.lengths) == 1 and first.drafters
    assert not second.acceptance and not second.lengths and not second.drafters  # nothing leaked into it
    assert not Session.of(target).acceptance  # nor into the target's default session
    generate(target, prompt_ids=prompt, method="auto", drafters=["maxgram"], max_new_tokens=10, session=second)
    assert len(second.lengths) == 1 and len(first.lengths) == 1
    with pytest.raises(ConfigError, match="the session is for"):
        generate(tiny_model("llama", 8, VOCAB), prompt_ids=prompt, max_new_tokens=2, session=first)


def test_methods_sharing_a_session_draft_through_one_cache_per_drafter_model(monkeypatch, tmp_path):
    """auto keeps a drafter's cache across generations; sd on the same model in between must not leave auto
    believing its cache holds what it held (a stale belief rolls back past the cache's end, or drafts from
    another text's keys)."""
    from helpers import perturbed
    target = load_model(tiny_transformer("llama", 12, VOCAB))
    perturbed(target, 0.05, 12).model.save_pretrained(tmp_path / "drafter")
    drafter = str(tmp_path / "drafter")  # named: the session loads it and keeps its cache
    invent(monkeypatch, costs(target))  # a machine where the drafter pays: auto drafts with it
    session = Session(target)
    long, short = random_prompt(1, VOCAB, 40), random_prompt(2, VOCAB, 5)

    def same_as_ar(prompt, **options):
        result = generate(target, prompt_ids=prompt, max_new_tokens=16, session=session, **options)
        assert result.token_ids == generate(target, prompt_ids=prompt, method="ar", max_new_tokens=16).token_ids
        return result.token_ids

    first = same_as_ar(long, method="auto", drafters=[drafter])
    same_as_ar(short, method="sd", drafter=drafter, k=3)
    again = generate(target, prompt_ids=long + first + [3, 4], method="auto", drafters=[drafter], max_new_tokens=16,
                     session=session)
    assert any(choice != "plain" for choice in again.stats.choices)  # it drafted from the kept cache
    assert again.token_ids == generate(target, prompt_ids=long + first + [3, 4], method="ar",
                                       max_new_tokens=16).token_ids
    assert len(session.caches) == 1


def test_a_profile_measured_on_a_drafter_s_model_tells_the_session_s_cache_over_it(monkeypatch, tmp_path):
    """A machine profile is measured on the model's own cache: the session's DraftCache over it must not go on
    believing what it held (a belief longer than the measurement's text rolls back past the cache's end; a shorter
    one drafts from the measurement's keys)."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))  # (nothing measured before)
    target = load_model(tiny_transformer("llama", 12, VOCAB))
    tiny_transformer("llama", 13, VOCAB).save_pretrained(tmp_path / "drafter")
    session, name = Session(target), str(tmp_path / "drafter")
    generate(target, prompt_ids=random_prompt(1, VOCAB, 20), method="sd", drafter=name, k=3, max_new_tokens=8,
             session=session)
    model = session.drafter(name, None)
    assert len(session.cache(model).ids) >= 20
    session.profile(model)
    assert session.cache(model).ids == []


def test_wrappers_forward_the_contract_whatever_they_wrap():
    from speculant.models.wrappers.biased import Biased
    from speculant.models.wrappers.metered import metered

    target = tiny_model("llama", 13, VOCAB)
    wrapped = Biased(metered(target), {1: 2.0})
    assert wrapped.capabilities == target.capabilities and wrapped.default_drafters() == target.default_drafters()
    assert wrapped.batch_load is None and wrapped.beside(2) is wrapped and wrapped.owner is target
    assert wrapped.vocab_size == VOCAB and wrapped.cache_len == 0


def test_a_target_s_default_session_goes_with_it():
    from helpers import MarkovLM

    model = MarkovLM(VOCAB, 0)
    session, gone = Session.of(model), weakref.ref(model)
    assert Session.of(model) is session and session.target is model
    del model
    assert gone() is None  # freed at once: the session does not hold its target
    with pytest.raises(ConfigError, match="the session's target was dropped"):
        session.target
    with pytest.raises(ConfigError, match="the session's target was dropped"):
        session.drafter("maxgram")


def test_dropping_a_session_frees_what_it_loaded(tmp_path):
    target = load_model(tiny_transformer("llama", 9, VOCAB))
    tiny_transformer("llama", 10, VOCAB).save_pretrained(tmp_path / "drafter")
    session = Session(target)
    prompt = random_prompt(9, VOCAB, 12)
    generate(target, prompt_ids=prompt, method="auto", drafters=[str(tmp_path / "drafter"), "maxgram"],
             max_new_tokens=8, session=session)
    loaded = [weakref.ref(d) for d in session.drafters.values()]
    assert len(loaded) == 2 and session.acceptance
    del session
    gc.collect()
    assert [d() for d in loaded] == [None, None]  # the model drafter and Max-Gram went with it


def test_every_backend_declares_its_capabilities():
    """Each backend's capabilities, read by its name before anything loads (`capabilities_of`), are its class's; a
    capability declared is a method the class has, and `replicates` one it makes, not Backend's refusal."""
    import importlib

    from speculant.config import BACKENDS
    from speculant.models.backends import capabilities_of

    classes = {name: getattr(importlib.import_module(f"speculant.models.backends.{name}"), cls)
               for name, cls in BACKENDS.items()}  # (a backend of a newcomer's is checked here too, unnamed)
    assert set(BACKENDS) >= {"hf", "llamacpp", "lean", "static"}
    for name, backend in classes.items():
        assert issubclass(backend, Backend) and isinstance(backend.capabilities, Capabilities)
        assert backend.capabilities != Capabilities(), backend  # declared, not the default
        declared = backend.capabilities
        assert capabilities_of(name) is declared
        assert declared.replicates == (backend.replicas is not Backend.replicas), backend
        for capability, members in (("shares_weights", ["share"]), ("batches_rows", ["rows_forward", "weights_key"]),
                                    ("prefills_in_parts", ["prefill_parts", "continue_prefill"]),
                                    ("skips_layers", ["skipping"]),
                                    ("reuses_prefixes", ["prefix_block", "export_kv", "import_kv"]),
                                    ("drafts_trees", ["draft_tree"])):  # (the others' members are set per instance)
            if getattr(declared, capability):
                assert all(hasattr(backend, m) for m in members), (backend, capability)


REGISTRIES = {"METHODS", "DRAFTERS"}  # names -> what registered itself under them
PURE_MEMOS = {"byte_of_char", "_same_tokens", "_plugins"}  # caches of what does not change in a process: a byte
# table, whether two vocabularies are equal, the installed plugins' names


def module_state(path: Path) -> list[str]:
    """Module-level mutable state in a file: containers (dicts, lists, sets, weak maps, deques) assigned at module
    level but for the registries and constant tables written out literally in UPPER_CASE, and functions cached
    at module level (`functools.cache`, `lru_cache`) but for memos of pure functions."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
            value = ast.unparse(node.value)
            made = re.match(r"(weakref\.)?(WeakKeyDictionary|WeakValueDictionary|dict|list|set|deque|defaultdict)\(",
                            value)
            literal = isinstance(node.value, (ast.Dict, ast.List, ast.Set))
            constant = literal and all(n.isupper() and n.lstrip("_") == n for n in names) and len(value) > 2
            if (made or literal) and not (constant or set(names) <= REGISTRIES | {"__all__"}):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)[:80]}")
        if isinstance(node, ast.FunctionDef) and node.name not in PURE_MEMOS and any(
                "cache" in ast.unparse(d) for d in node.decorator_list):
            found.append(f"{path.name}:{node.lineno} cached {node.name}")
    return found


def test_no_algorithm_keeps_module_level_state(tmp_path):
    folders = ("methods", "decoding", "drafters", "trees")
    files = [PACKAGE / "latency.py", *[p for d in folders for p in (PACKAGE / d).rglob("*.py")]]
    assert [f for p in files for f in module_state(p)] == []
    planted = tmp_path / "planted.py"  # (what the scan finds)
    planted.write_text("from functools import lru_cache\nTABLE = {1: 2}\n_CACHE = {}\nseen = WeakKeyDictionary()\n"
                       "@lru_cache\ndef memo(x):\n    return x\n")
    assert module_state(planted) == ["planted.py:3 _CACHE = {}", "planted.py:4 seen = WeakKeyDictionary()",
                                     "planted.py:6 cached memo"]


def test_no_backend_is_told_apart_by_its_name_outside_models():
    probed = "share|rows_forward|weights_key|prefill_parts|interrupt|batch_load|lag"
    pattern = re.compile(r"""getattr\([^)]*["']backend["']|(?<!config)(?<!self)\.backend\s*[!=]=|"""
                         rf"""hasattr\([^)]*["']({probed})["']""")
    found = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py") if "models" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
    assert pattern.search('if getattr(target, "backend", "hf") == "lean":')  # (the pattern finds them)
    assert pattern.search('if model.backend == "lean":') and not pattern.search('if config.backend != "auto":')


def test_a_wrapper_forwards_every_backend_member():
    """`Delegating` forwards each member `Backend` declares (a new one left out answered the base's default for any
    wrapped model: a static target's compile time was None under a wrapper), but for the two that run through the
    wrapper's own forwards."""
    from speculant.models.base import Backend, Delegating

    through_own_forwards = {"catch_up", "prefill_by_parts"}
    members = {name for name in vars(Backend) if not name.startswith("_")}
    assert members - set(vars(Delegating)) == through_own_forwards and "compile_seconds" in members


def test_a_drafter_whose_tokenizer_files_are_the_target_s_reads_with_the_target_s_tokenizer(tmp_path):
    """A drafter loaded from a folder whose tokenizer files are the target's, byte for byte, takes the target's
    tokenizer instead of parsing its own (`loading.drafter_tokenizer`); one with other files keeps its own."""
    from helpers import bpe_tokenizer, byte_tokenizer

    vocab = 257
    for folder, seed, tokenizer in (("target", 1, byte_tokenizer()), ("same", 2, byte_tokenizer()),
                                    ("other", 3, bpe_tokenizer(["abc abd"] * 4, vocab, eos="<eos>"))):
        tiny_transformer("llama", seed, vocab).save_pretrained(tmp_path / folder)
        tokenizer.save_pretrained(tmp_path / folder)
    target = load_model(str(tmp_path / "target"))
    session = Session(target)
    same, other = session.drafter(str(tmp_path / "same")), session.drafter(str(tmp_path / "other"))
    assert same.tokenizer is target.tokenizer
    assert other.tokenizer is not None and other.tokenizer is not target.tokenizer
    prompt = target.tokenizer.encode("abc abd abc")
    assert generate(target, prompt_ids=prompt, method="sd", drafter=str(tmp_path / "same"), k=3, max_new_tokens=12,
                    session=session).token_ids == \
        generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12).token_ids


def test_a_transformers_model_drafts_as_given():
    """A transformers model object passed as drafter is wrapped as `load_model` wraps it (it had reached the
    backend's loader of names and failed there)."""
    target = tiny_model("llama", 1, VOCAB)
    prompt = random_prompt(1, VOCAB, 8)
    drafted = generate(target, prompt_ids=prompt, method="sd", drafter=tiny_transformer("llama", 2, VOCAB), k=2,
                       max_new_tokens=10)
    assert drafted.token_ids == generate(target, prompt_ids=prompt, method="ar", max_new_tokens=10).token_ids
    assert drafted.stats.drafter_forwards  # the model drafted


@pytest.mark.parametrize("method", ["ar", "sd", "auto"])
def test_generations_on_one_target_never_decode_from_each_other_s_cache(method, monkeypatch):
    """Every generation on a target shares its KV cache: a stream resumed after another generation's steps raises
    (it would have decoded from the other text), streams read one after another and threads taking turns give what
    each gives alone (`api.Hold`)."""
    import threading

    target = tiny_model("llama", 1, VOCAB)
    options = {"sd": {"drafter": "self", "k": 3}, "auto": {"drafters": ["self"]}}.get(method, {})
    invent(monkeypatch, costs(target))  # (auto speculates)
    prompts = [random_prompt(1, VOCAB, 8), random_prompt(2, VOCAB, 5)]

    def run(prompt, **more):
        return generate(target, prompt_ids=prompt, method=method, max_new_tokens=12, **options, **more)

    alone = [run(prompt) for prompt in prompts]
    assert method == "ar" or all(sum(result.stats.accepted_lengths) > 0 for result in alone)  # (its drafts kept)
    alone = [result.token_ids for result in alone]
    first, second = iter(run(prompts[0], stream=True)), run(prompts[1], stream=True)
    assert next(first) == alone[0][0]
    assert list(second) == alone[1]
    with pytest.raises(ConfigError, match="another generation was made or ran on"):
        next(first)
    streams = [run(prompt, stream=True) for prompt in prompts]
    assert [list(stream) for stream in streams] == alone  # a stream not yet started holds nothing
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, run(prompts[i]).token_ids)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [out[0], out[1]] == alone


@pytest.mark.parametrize("method", ["sd", "tree", "auto"])
def test_a_drafter_model_passed_in_is_held_as_a_target_is(method):
    """A loaded model passed in as a drafter is held with the target (`api.Hold`): a paused stream on it as a target
    raises after a generation drafted with it (it had decoded from the drafted text), a paused stream drafting with
    it raises after a generation on it, and threads whose targets share it take turns (they had rolled its cache
    back past its end)."""
    import threading

    targets, drafter = [tiny_model("llama", 1, VOCAB), tiny_model("llama", 3, VOCAB)], tiny_model("llama", 2, VOCAB)
    options = {"auto": {"drafters": [drafter]}}.get(method, {"drafter": drafter})
    prompt = random_prompt(1, VOCAB, 8)

    def run(target, **more):
        return generate(target, prompt_ids=prompt, max_new_tokens=12, **more)

    drafted, alone = [run(target, method=method, **options).token_ids for target in targets], run(drafter).token_ids
    assert drafted == [run(target).token_ids for target in targets]
    paused = iter(run(drafter, stream=True))
    assert next(paused) == alone[0] and run(targets[0], method=method, **options).token_ids == drafted[0]
    with pytest.raises(ConfigError, match=f"another generation was made or ran on {drafter.name}"):
        next(paused)
    paused = iter(run(targets[0], method=method, stream=True, **options))
    assert next(paused) == drafted[0][0] and run(drafter).token_ids == alone
    with pytest.raises(ConfigError, match=f"another generation was made or ran on {drafter.name}"):
        next(paused)
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, run(targets[i % 2], method=method,
                                                                            **options).token_ids)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [out[i] for i in range(4)] == drafted * 2


def test_a_user_drafter_s_q_rounded_off_one_is_verified_as_a_distribution():
    """A row within Q_SUM_TOLERANCE of 1 (a half-precision softmax) is divided by its sum before verification
    reads it: its residual max(p - q, 0) is the one of the distribution the drafter drew from."""
    from speculant.drafters.base import Checked

    class Rounded(Drafter):
        name = "rounded"

        def propose(self, context, k):
            return Draft([1, 2], torch.full((2, VOCAB), 1.008 / VOCAB))

    q = Checked(Rounded(), VOCAB).propose([3, 4], 2).probs
    assert torch.allclose(q.sum(-1), torch.ones(2), atol=1e-6) and torch.allclose(q, torch.full_like(q, 1 / VOCAB))


@pytest.mark.parametrize("proposal, message", [
    (lambda context, k: list(context[-k:]), "propose returned list, not a speculant.Draft"),
    (lambda context, k: Draft([VOCAB + 3]), "not token ids in"),
    (lambda context, k: Draft([-1]), "not token ids in"),
    (lambda context, k: Draft(list(context)), "tokens proposed where"),
    (lambda context, k: Draft([1], torch.ones(1, VOCAB + 1) / (VOCAB + 1)), "its q is"),
    (lambda context, k: Draft(None), "its draft holds None, not token ids"),
    (lambda context, k: Draft([1], [[1 / VOCAB] * VOCAB]), "its q is list, not a float tensor"),
    (lambda context, k: Draft([1], torch.ones(1, VOCAB, dtype=torch.long)), "its q is Tensor of torch.int64"),
    (lambda context, k: Draft([1], torch.ones(1, VOCAB, device="meta") / VOCAB), "its q is on the meta device"),
    (lambda context, k: Draft([1], torch.ones(1, VOCAB) * 5 / VOCAB), r"its q's rows are not distributions \(sums "
                                                                      r"\[5.0\]"),
    (lambda context, k: Draft([1], torch.eye(VOCAB)[[1]] * 2 - 1 / VOCAB), "least entry -0.0"),
    (lambda context, k: Draft([1, 2], torch.eye(VOCAB)[[1, 3]]), r"its q gives its own token 2 \(draft position 1\) "
                                                                 "probability 0.0"),
    (lambda context, k: Draft([], tree=TokenTree((context[-1] + 1, 7), (-1, 0))), "its tree's root is"),
    (lambda context, k: Draft([], tree=TokenTree((context[-1],) + (7,) * (k + 1), (-1, *range(k + 1)))),
     "deep proposed where"),
    (lambda context, k: Draft([VOCAB + 3, 0], tree=TokenTree((context[-1], 7), (-1, 0))),  # (tokens had reached the
     r"holds a tree of TokenTree and tokens \[67, 0\]"),  # embedding as a chain, unchecked, where an EOS came first)
    (lambda context, k: Draft([], tree=5), "holds a tree of int"),
    (lambda context, k: Draft([1], usage=None), "its draft's usage is None, not a dict of speculant Usage"),
    (lambda context, k: Draft([1], usage={"x": 5}), "its draft's usage is {'x': 5}")])
def test_a_user_drafter_s_bad_draft_is_named_before_verification_reads_it(proposal, message):
    """A user's drafter is checked (`drafters.base.Checked`): what it proposes must be a Draft of the target's token
    ids, at most k (a tree: rooted at the context's last token, at most k deep), with q a float tensor of one row per
    token as wide as the target's logits, each a distribution above 0 at its drafted token; speculant's own drafters
    are not wrapped."""
    from speculant.drafters.spec import load_drafter

    class Faulty(Drafter):
        name = "faulty"

        def propose(self, context, k):
            return proposal(context, k)

    target = tiny_model("llama", 1, VOCAB)
    with pytest.raises(ConfigError, match=f"drafter 'faulty': .*{message}"):
        generate(target, prompt_ids=random_prompt(1, VOCAB, 6), method="sd", drafter=Faulty(), k=2,
                 max_new_tokens=6, temperature=0.8 if "its q" in message else 0.0)
    assert type(load_drafter("maxgram", target)).__name__ == "MaxGramDrafter"
    given = Drafter()  # speculant's base class, given a propose of a user's, is a user's drafter: checked
    made = {"proposal": proposal}  # (one made by exec, as a notebook's tools may: a function of no module)
    exec("def propose(context, k):\n    return proposal(context, k)", made)
    given.propose, given.name = made["propose"], "faulty"
    with pytest.raises(ConfigError, match=f"drafter 'faulty': .*{message}"):
        generate(target, prompt_ids=random_prompt(1, VOCAB, 6), method="sd", drafter=given, k=2,
                 max_new_tokens=6, temperature=0.8 if "its q" in message else 0.0)


def test_a_user_drafter_s_empty_sampled_draft_and_an_attribute_named_owner_are_its_own():
    """An empty draft with its (empty) q, as a drafter that stops early slices it, failed the q check on an empty
    tensor's minimum; a user drafter with an attribute `owner` (a server's handle names its model so) was taken for
    a handle by auto's naming. Both run."""

    class Early(Drafter):
        name, owner = "early", "alice"

        def propose(self, context, k):
            return Draft([], torch.ones(1, VOCAB)[:0] / VOCAB)

    target = tiny_model("llama", 1, VOCAB)
    prompt = random_prompt(1, VOCAB, 6)
    for method, options in (("sd", {"drafter": Early()}), ("auto", {"drafters": [Early()]})):
        assert len(generate(target, prompt_ids=prompt, method=method, max_new_tokens=6, temperature=0.8, seed=0,
                            **options).token_ids) == 6


def test_a_drafter_cache_s_failed_catch_up_leaves_it_holding_nothing_known():
    """A catch-up cut short (a stage thread's error, an interrupt) after its rollback left `ids` describing the old
    cache: the next run rolled back past the cache's end. It now catches up from nothing known, to the same logits."""
    from speculant.models.base import DraftCache

    model, reference = tiny_model("llama", 3, 64, init_std=0.1), tiny_model("llama", 3, 64, init_std=0.1)
    cache = DraftCache(model)
    text = random_prompt(1, 64, 40)
    cache.run(text)
    catch_up = model.catch_up

    def failing(*args, **kwargs):
        raise RuntimeError("cut short")

    model.catch_up = failing
    with pytest.raises(RuntimeError, match="cut short"):
        cache.run(text[:10] + random_prompt(2, 64, 5))  # a miss after 10 shared tokens: rolled back, then failed
    model.catch_up = catch_up
    assert torch.allclose(cache.run(text + [5, 6])[-1], reference.prefill(text + [5, 6]), atol=1e-4)


def test_a_tree_s_next_turn_catches_up_from_the_drafter_s_kept_cache(tmp_path):
    """`tree` forgot the session drafter's cache at every generation (where measuring auto sizes had run it apart,
    and where nothing had): the next turn of a conversation prefilled the drafter on its whole history again."""
    from helpers import perturbed

    target = load_model(tiny_transformer("llama", 12, VOCAB))
    perturbed(target, 0.05, 12).model.save_pretrained(tmp_path / "drafter")
    session = Session(target)
    first_turn = random_prompt(1, VOCAB, 40)
    reply = generate(target, prompt_ids=first_turn, method="tree", drafter=str(tmp_path / "drafter"), depth=3,
                     width=2, max_new_tokens=8, session=session).token_ids
    (cache,) = session.caches.values()
    model = cache.model.model  # (under its meter)
    prefilled, prefill = [], model.prefill
    model.prefill = lambda ids: prefilled.append(len(ids)) or prefill(ids)
    caught_up, catch_up = [], model.catch_up
    model.catch_up = lambda ids, rows=1: caught_up.append(len(ids)) or catch_up(ids, rows)
    second_turn = first_turn + reply + [3, 4]
    result = generate(target, prompt_ids=second_turn, method="tree", drafter=str(tmp_path / "drafter"), depth=3,
                      width=2, max_new_tokens=8, session=session)
    assert result.token_ids == generate(target, prompt_ids=second_turn, method="ar", max_new_tokens=8).token_ids
    assert not prefilled and sum(result.stats.accepted_lengths) > 0
    assert 0 < caught_up[0] <= len(reply) + 2  # (the new turn, from what the drafter's cache kept)


def test_a_model_of_one_s_own_that_implements_the_protocol_alone_is_refused_in_one_line():
    """A CausalLM of a user's that does not derive from Backend ran `ar` and `sd`, then failed with an AttributeError
    where auto asked it for its default drafters (self drafting, DSI likewise): refused as it is given, target or
    drafter."""

    class Mine:  # (every member of the protocol, none of Backend's choices)
        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            if name in ("model", "default_drafters", "self_drafter", "replicas"):
                raise AttributeError(name)
            return getattr(self.model, name)

    target = tiny_model("llama", 5, VOCAB)
    assert isinstance(Mine(target), CausalLM)
    for method, options in (("auto", {}), ("ar", {}), ("sd", {"drafter": "self"})):
        with pytest.raises(ConfigError, match=r"a model of your own \(Mine\) must derive from speculant.models.base"):
            generate(Mine(target), prompt_ids=[1, 2], method=method, max_new_tokens=2, **options)
    with pytest.raises(ConfigError, match=r"\(Mine\) must derive from"):
        generate(target, prompt_ids=[1, 2], method="sd", drafter=Mine(tiny_model("llama", 6, VOCAB)), max_new_tokens=2)
    with pytest.raises(ConfigError, match=r"\(Mine\) must derive from"):
        Session(Mine(target))
    with pytest.raises(ConfigError, match=r"\(Mine\) must derive from"):  # (a wrapper asks the model it wraps)
        generate(Metered(Mine(target)), prompt_ids=[1, 2], method="auto", max_new_tokens=2)


def test_python_callers_get_one_clear_error_where_a_raw_one_came_from_deep_inside():
    """A text the tokenizer has no tokens for, a chat template that raises (it is the model's code), a None among a
    method's drafters (refused once the models before it had loaded, naming no option), DSI's target devices that are
    no list, and a stream read from two threads at once (the second's ValueError ended the first's stream early,
    as if complete): each a ConfigError naming the cause, the stream read on to its end by the first thread."""
    import threading

    from helpers import piece_tokenizer

    target = tiny_model("llama", 5, VOCAB, tokenizer=piece_tokenizer([chr(ord("a") + i) for i in range(VOCAB)]))
    with pytest.raises(ConfigError, match="the prompt encodes to no tokens"):
        generate(target, "???", method="ar", max_new_tokens=2)
    with pytest.raises(ConfigError, match="token ids go in prompt_ids"):  # (it said: no chat template)
        generate(target, [1, 2, 3], method="ar", max_new_tokens=2)
    for call in (Session(target).profile, Session(target).cache):  # (a raw TypeError; a cache of a string)
        with pytest.raises(ConfigError, match="takes a loaded model .* not NoneType"):
            call(None)
    target.tokenizer.chat_template = "{{ 1 / 0 }}"
    with pytest.raises(ConfigError, match=r"the chat template fails on these messages \(ZeroDivisionError"):
        generate(target, "abc", chat=True, method="ar", max_new_tokens=2)
    for method in ("auto", "cascade", "dsi"):
        with pytest.raises(ConfigError, match="drafters must be a drafter's name, a model or a Drafter, not NoneType"):
            generate(target, prompt_ids=[1, 2], method=method, drafters=[None, "maxgram"], max_new_tokens=2)
    with pytest.raises(ConfigError, match=r"drafter 'drafter' \(Drafter\) implements no propose"):
        generate(target, prompt_ids=[1, 2], method="sd", drafter=Drafter(), max_new_tokens=3)
    class Matching(Drafter):  # (auto buckets a lookup's acceptance by its match length)
        name = "matching"

        def propose(self, context, k):
            return Draft([1])

        def match_length(self, context):
            return "3"

    with pytest.raises(ConfigError, match="drafter 'matching': match_length returned '3', not a whole number >= 0"):
        generate(target, prompt_ids=[1, 2], method="auto", drafters=[Matching()], max_new_tokens=3)
    class Lagging(Drafter):  # (auto weighs a drafter's catch-up by its lag)
        name = "lagging"

        def propose(self, context, k):
            return Draft([1])

        def lag(self, context):
            return -1

    from speculant.drafters.spec import checked

    with pytest.raises(ConfigError, match="drafter 'lagging': lag returned -1, not a whole number >= 0"):
        checked(Lagging(), target).lag([1, 2])  # (what auto reads it through; auto asks only a drafter it chose, and
        # in three tokens timing decides whether it chooses one)
    with pytest.raises(ConfigError, match="target_devices is a list of devices"):
        generate(target, prompt_ids=[1, 2], method="dsi", drafter="maxgram", target_devices=5, max_new_tokens=2)
    prompt = random_prompt(5, VOCAB, 8) * 3
    alone = generate(target, prompt_ids=prompt, method="sd", drafter="maxgram", max_new_tokens=200).token_ids
    stream = generate(target, prompt_ids=prompt, method="sd", drafter="maxgram", max_new_tokens=200, stream=True)
    first, inside, asked = [], threading.Event(), threading.Event()
    real = stream._next

    def slow():  # the first thread holds the stream while the second asks
        inside.set()
        asked.wait(10)
        return real()

    def read():
        for token in stream:
            first.append(token)
            if len(first) == 1:
                stream._next = slow

    reader = threading.Thread(target=read)
    reader.start()
    inside.wait(10)
    with pytest.raises(ConfigError, match="a stream is read by one thread at a time"):
        next(stream)
    asked.set()
    reader.join(60)
    assert first == alone and stream.result is not None


def test_drafter_names_a_meta_model_and_a_generation_asked_for_inside_a_step_are_refused_in_one_line(monkeypatch):
    """A drafter named by no text (auto's estimates are kept by name: a TypeError deep inside), a transformers model
    built on the meta device (torch's RuntimeError at the first forward) and a drafter that calls generate() on the
    target it drafts for (the target's own decoder closed from inside its step: Python's ValueError): each a
    ConfigError naming the cause. What auto learns of a drafter is its own: a user's drafter named after a built-in,
    two drafters of one name and two registered drafters whose classes name them nothing each learn apart."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tiny_model("llama", 5, VOCAB)
    prompt = random_prompt(5, VOCAB, 8) * 3

    class Named(Drafter):
        def __init__(self, name):
            self.name = name

        def propose(self, context, k):
            return Draft([])

    for method, drafters in (("sd", {"drafter": Named(["x"])}), ("auto", {"drafters": [Named(["x"]), "maxgram"]})):
        with pytest.raises(ConfigError, match=r"a drafter's name is a non-empty text, got \['x'\] \(Named\)"):
            generate(target, prompt_ids=prompt, method=method, max_new_tokens=3, **drafters)
    one = Named("mine")
    session = Session(target)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
    # one drafter twice is one; two of one name (left unnamed) are numbered; registered, one goes by its registration
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))
    register_drafter("unnamed-a")(lambda target: Named("drafter"))
    register_drafter("unnamed-b")(lambda target: Named("drafter"))

    class Copying(Drafter):  # (a copy per generation keeps the registered name)
        def begin(self, prompt_ids):
            return Copying()

        def propose(self, context, k):
            return Draft([])

    register_drafter("copying")(lambda target: Copying())
    assert Session(target).drafter("copying").begin(prompt).name == "copying"
    for drafters in ([one, one, "maxgram", "maxgram"], [Named("maxgram")], [Named("drafter"), Named("drafter")],
                     ["unnamed-a", "unnamed-b"]):
        assert generate(target, prompt_ids=prompt, method="auto", drafters=drafters, max_new_tokens=20,
                        session=session).token_ids == expected
    learned = {name.split(" (")[0] for name in session.acceptance if name.endswith(".Named)")}
    assert "maxgram" in session.acceptance and learned == {"mine", "maxgram #2", "drafter", "drafter #2",
                                                           "unnamed-a", "unnamed-b"}, session.acceptance.keys()
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4))
    for run in (lambda: load_model(meta), lambda: generate(meta, prompt_ids=[1, 2], method="ar", max_new_tokens=2)):
        with pytest.raises(ConfigError, match="the model's weights are on the meta device"):
            run()

    class Reentrant(Drafter):
        name = "reentrant"

        def propose(self, context, k):
            generate(target, prompt_ids=list(context), method="ar", max_new_tokens=2)
            return Draft([])

    other = tiny_model("llama", 6, VOCAB)

    class Nested(Drafter):  # (a generation on another model, whose drafter asks for the target: two steps deep)
        name = "nested"

        def propose(self, context, k):
            generate(other, prompt_ids=list(context), method="sd", drafter=Reentrant(), max_new_tokens=4)
            return Draft([])

    for method, options, drafter in (("sd", {}, Reentrant()), ("dsi", {"lookahead": 2}, Reentrant()),
                                     ("sd", {}, Nested())):  # (DSI's drafter: on a thread of its own)
        with pytest.raises(ConfigError, match="asked for from inside a step of another on the same model"):
            generate(target, prompt_ids=prompt, method=method, drafter=drafter, max_new_tokens=4, **options)
    assert generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids == expected


def test_what_auto_learns_of_two_drafters_of_one_name_stays_each_one_s_whatever_order_they_come_in():
    """Two drafters of one name are told apart by number, and each keeps its number on the session: given in the
    other order, or one alone, in a later generation, neither takes what was learned of the other. A number whose
    drafter was dropped goes to the next new one of the name (a drafter made afresh per request learns on)."""
    target = tiny_model("llama", 5, VOCAB)
    prompt = random_prompt(5, VOCAB, 8) * 3
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids

    class Guess(Drafter):
        name = "guess"

        def __init__(self, right):
            self.right = right

        def propose(self, context, k):
            n = len(context) - len(prompt)
            return Draft(expected[n:n + k] if self.right else [(t + 1) % VOCAB for t in expected[n:n + k]])

    def learned(name):  # (a user's Drafter learns under its name and class)
        return next((v for k, v in session.acceptance.items() if k.startswith(f"{name} (")), {})

    def observed(name):
        return sum(sum(e.long_reached) for e in learned(name).values())

    session, right, wrong = Session(target), Guess(True), Guess(False)
    assert [session.own_name(d) for d in (right, wrong, right)] == ["guess", "guess #2", "guess"]
    for drafters in ([right, wrong], [wrong, right], [wrong]):
        before = observed("guess"), observed("guess #2")
        assert generate(target, prompt_ids=prompt, method="auto", drafters=drafters, max_new_tokens=20,
                        session=session).token_ids == expected
        if drafters == [wrong]:
            assert observed("guess") == before[0] and observed("guess #2") > before[1]
    rates = {name: next(iter(learned(name).values())).rate(0) for name in ("guess", "guess #2")}
    assert rates["guess"] > 0.5 > rates["guess #2"], rates
    del right
    gc.collect()
    assert session.own_name(Guess(True)) == "guess" and session.own_name(wrong) == "guess #2"

    from speculant.serve.batcher import Row

    handles = [Row(None, target), Row(None, target)]  # a server's per-request handles on a drafter model, two
    assert [session.own_name(h) for h in handles] == [target.name] * 2  # requests at once: the model's estimates


def test_a_method_s_default_drafter_is_the_target_s_catalog_drafter_else_maxgram(monkeypatch):
    """A drafter left unnamed is `default`: the catalog's drafter for a target loaded under its catalog name, else
    Max-Gram, which any target runs (it was the catalog's 0.5B for every target, loaded to draft across vocabularies
    for a model of the caller's own). Where only a model drafts, or a drafter dtype is given, a target the catalog
    pairs none with is refused, naming why; a server lists and names what `default` stands for."""
    from speculant.drafters.spec import DEFAULT, MAXGRAM, DrafterSpec, resolved
    from speculant.errors import OptionError
    from speculant.methods import get_method
    from speculant.methods.drafting import with_default_drafter

    assert str(resolved(DrafterSpec.parse(DEFAULT), "qwen2.5-coder-1.5b@lean")) == "qwen2.5-coder-0.5b"
    assert str(resolved(DrafterSpec.parse(DEFAULT), "./my-model")) == MAXGRAM
    with pytest.raises(ConfigError, match="takes no suffix"):
        DrafterSpec.parse("default@int8")
    target = tiny_model("llama", 5, VOCAB)
    prompt = random_prompt(5, VOCAB, 8) * 3
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
    for method in ("sd", "dsi"):
        result = generate(target, prompt_ids=prompt, method=method, max_new_tokens=20)
        assert result.token_ids == expected and not result.stats.drafter_forwards  # (Max-Gram runs no model)
    assert str(with_default_drafter(get_method("sd").make_options({}), target.name).drafter) == MAXGRAM
    for kwargs, refused in ((dict(method="tree"), "method 'tree' needs a model drafter, and the catalog pairs none "
                                                  "with tiny-llama-5: name one"),
                            (dict(method="sd", drafter_dtype="bf16"), "drafter dtype bf16 applies to a model drafter")):
        with pytest.raises(ConfigError, match=refused):
            generate(target, prompt_ids=prompt, max_new_tokens=4, **kwargs)
    session = Session(target)  # (loaded once, under what it stands for)
    assert session.drafter(DEFAULT) is session.drafter(MAXGRAM)
    for method, drafters in (("auto", "default,maxgram"), ("cascade", ["default", "maxgram"]), ("dsi", "default")):
        with pytest.raises(ConfigError, match="'default' stands for a method's one drafter; a list of drafters names"):
            generate(target, prompt_ids=prompt, method=method, drafters=drafters, max_new_tokens=4)
    with pytest.raises(ConfigError, match="reserved|'default'"):
        register_drafter("default")(lambda target: None)
    from test_serve import engine_for

    engine = engine_for("sd", drafter=DEFAULT)
    assert engine.models == [MAXGRAM] and str(engine.options_for("sd", {"drafter": DEFAULT})[1].drafter) == MAXGRAM
    for asked in ({"drafter": DEFAULT, "depth": 2}, {"depth": 2, "drafter": DEFAULT}):  # (refused as it is read, as
        with pytest.raises(OptionError, match="needs a model drafter, and the catalog pairs none with tiny-llama-0") \
                as refused:  # the drafter's, whatever the order)
            engine.options_for("tree", asked)
        assert refused.value.option == "drafter"
    engine.close()
    with pytest.raises(ConfigError, match="drafter dtype bf16 applies to a model drafter, and the catalog pairs none"):
        Session(target).drafter(DEFAULT, "bf16")

    class Named(Drafter):
        def __init__(self, name):
            self.name = name

        def propose(self, context, k):
            return Draft([])

    with pytest.raises(ConfigError, match="a drafter object is named 'default', as a built-in"):
        engine_for("sd", drafter=Named(DEFAULT))
    with pytest.raises(ConfigError, match="two of the server's drafters go by 'self@int8'"):  # (an object, then a spec)
        engine_for("auto", drafters=(Named("self@int8"), "self@int8"))


def test_a_drafter_path_has_one_spelling_and_stays_a_path():
    """`d/`, `./d` and `.//d` name one drafter (loaded once, a cascade's level given twice refused); `./maxgram`, a
    folder beside the caller, stays a path, not the registered drafter of that name."""
    from speculant.drafters.spec import MODEL, DrafterSpec

    assert {DrafterSpec.parse(text) for text in ("d/", "./d", "./d/", ".//d")} == {DrafterSpec.parse("./d")}
    assert DrafterSpec.parse("d").source == "d"  # (a catalog name or a Hugging Face id as much as a folder)
    assert DrafterSpec.parse("models//d@int8") == DrafterSpec.parse("./models/d/@int8")
    assert DrafterSpec.parse("../d").source == "../d" and DrafterSpec.parse("/m/./d/").source == "/m/d"
    spec = DrafterSpec.parse("./maxgram")
    assert spec.source == "./maxgram" and spec.kind == MODEL
