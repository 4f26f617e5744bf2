"""The method registry: one options dataclass per method drives generate(), the CLI and bench specs;
imports point downward only."""

import json
import re
import subprocess
import sys
from dataclasses import dataclass, fields

import pytest

from helpers import tiny_model
from speculant import cli, generate
from speculant.bench.methods import parse_method
from speculant.config import option, scalar_type
from speculant.drafters.spec import DrafterSpec
from speculant.errors import ConfigError, OptionError, RequestError
from speculant.methods import METHODS, all_options, get_method
from speculant.methods.registry import Method


def test_a_conversation_is_a_prompt_and_a_malformed_one_is_refused():
    """`generate(target, [messages])` answers the conversation as the chat template lays it out, as the text
    prompt with chat=True does; what is not a list of role/content messages gets one clear error."""
    from helpers import BYTE_VOCAB, byte_tokenizer

    target = tiny_model("llama", 0, vocab=BYTE_VOCAB, tokenizer=byte_tokenizer())
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}>"
    text = generate(target, "hi", method="ar", max_new_tokens=8, chat=True).token_ids
    assert generate(target, [{"role": "user", "content": "hi"}], method="ar", max_new_tokens=8).token_ids == text
    for bad in ([], ["hi"], [{"role": "user"}], [{"role": "user", "content": 3}], ""):
        with pytest.raises(ConfigError, match="empty|role"):
            generate(target, bad, method="ar", max_new_tokens=8)
    for spaces, chat in ((" \n", False), ("  ", True)):  # (tokens all the same, as the server takes them)
        assert generate(target, spaces, method="ar", max_new_tokens=2, chat=chat).stats.new_tokens == 2
    with pytest.raises(RequestError, match="has no place for this participant's name") as refused:
        generate(target, [{"role": "user", "content": "hi", "name": "ann"}], method="ar", max_new_tokens=2)
    assert refused.value.field == "messages.0.name"  # (this template writes no name: refused, not dropped)
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['name'] }}: {{ m['content'] }}\n{% endfor %}>"
    assert generate(target, [{"role": "user", "content": "hi", "name": "ann"}], method="ar", max_new_tokens=2)


def test_a_value_out_of_range_names_its_option():
    """A method option's value out of its range names the option (`OptionError.option`), as a value of the wrong
    type does: a server answers with that field."""
    target = tiny_model("llama", 0)
    for options, name in ((dict(method="sd", drafter="maxgram", k=0), "k"),
                          (dict(method="tree", drafter=target, depth=0), "depth"),
                          (dict(method="tree", drafter=target, shape="round"), "shape"),
                          (dict(method="auto", k_max=0), "k_max"),
                          (dict(method="cascade", drafters=[target, "maxgram"], leniency=0.5), "leniency"),
                          (dict(method="dsi", drafter="maxgram", lookahead=0), "lookahead")):
        with pytest.raises(OptionError) as refused:
            generate(target, prompt_ids=[1, 2], max_new_tokens=2, **options)
        assert refused.value.option == name, options


def test_every_method_is_registered_with_documented_options():
    """Each option has its help, and the README's table of methods lists each method's options, no more."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert list(METHODS)[:6] == ["auto", "ar", "sd", "tree", "cascade", "dsi"]
    for method in METHODS.values():
        assert method.help
        for f in fields(method.options):
            assert f.metadata.get("help"), f"{method.name}.{f.name} has no help"
        row = re.search(rf"^\| `{method.name}`( \(default\))? \|[^|]*\| (.*) \|$", readme, re.M)
        if method.name in list(METHODS)[:6]:
            assert row, f"the README's table of methods has no row for {method.name}"
            listed = set(re.findall(r"`(\w+)`", row[2]))
            assert listed == {f.name for f in fields(method.options)}, method.name


def test_a_method_registers_with_a_name_specs_can_hold_and_frozen_options_once():
    from speculant.methods.registry import register

    @dataclass(frozen=True)
    class Options:
        k: int = 4

    for name in ("sd:fast", "two words", "Tree", "", 3):  # (bench specs split `NAME:k=4`, flags take `--method NAME`)
        with pytest.raises(ConfigError, match="cannot name a method"):
            register(name, Options, "help")
    for options in (dict, dataclass(type("Loose", (), {"__annotations__": {"k": int}, "k": 4})), Options()):
        with pytest.raises(ConfigError, match="frozen dataclass"):
            register("mine", options, "help")
    with pytest.raises(ConfigError, match="already registered"):
        register("sd", Options, "help")(lambda request, options: None)
    for taken in ("seed", "temperature", "session", "stream", "dtype"):  # (generate() and the CLI take them first:
        clashing = dataclass(frozen=True)(type("Clash", (), {"__annotations__": {taken: int}, taken: 0}))  # --seed
        with pytest.raises(ConfigError, match=f"an option may not be called '{taken}'"):  # broke every command's
            register("mine", clashing, "help")  # parser, and generate()'s keyword never reached the method)
    assert "mine" not in METHODS
    import inspect

    from speculant.api import generate
    from speculant.methods.registry import RESERVED

    own = {p.name for p in inspect.signature(generate).parameters.values() if p.kind is not p.VAR_KEYWORD}
    assert own <= RESERVED, own - RESERVED  # (generate()'s keywords all taken, as it grows)


def test_an_option_name_means_one_thing_in_every_method():
    for name in all_options():
        kinds = {str(f.type) for m in METHODS.values() for f in fields(m.options) if f.name == name}
        assert len(kinds) == 1, f"{name} has types {kinds}"


def test_unknown_and_misplaced_options_name_the_method():
    target = tiny_model("llama", 0, 32)
    with pytest.raises(ConfigError, match=r"option 'depth' does not apply to method 'sd' \(it belongs to tree"):
        generate(target, prompt_ids=[1, 2], method="sd", drafter="maxgram", depth=3)
    with pytest.raises(ConfigError, match="unknown option 'kk' for method 'sd'.*takes: drafter, drafter_dtype, k"):
        generate(target, prompt_ids=[1, 2], method="sd", kk=3)
    with pytest.raises(ConfigError, match="unknown option 'stop' for method 'auto'"):  # no method named: the default's
        generate(target, prompt_ids=[1, 2], stop=["\n"])
    with pytest.raises(ConfigError, match="unknown method 'fast'"):
        generate(target, prompt_ids=[1, 2], method="fast")


def test_drafter_specs_parse_in_one_place():
    assert DrafterSpec.parse("qwen2.5-coder-0.5b@int4") == DrafterSpec("qwen2.5-coder-0.5b", "int4")
    assert DrafterSpec.parse("self@int8").kind == "self" and DrafterSpec.parse("maxgram").kind == "maxgram"
    assert DrafterSpec.parse("org/model").kind == "model" and str(DrafterSpec.parse("a@int8")) == "a@int8"
    for bad, message in [("a@int3", "unknown quantization"), ("maxgram@int8", "no model"), ("none", "autoregressive"),
                         ("@int8", "empty")]:
        with pytest.raises(ConfigError, match=message):
            DrafterSpec.parse(bad)
    assert get_method("sd").make_options({"drafter": "self@int4"}).drafter == DrafterSpec("self", "int4")


def test_a_new_option_is_one_field_in_one_dataclass(monkeypatch, capsys):
    """A method declared here, with one option, gets a CLI flag, a bench-spec key and a generate() keyword."""

    @dataclass(frozen=True)
    class EchoOptions:
        repeat_first: int = option(1, "emit the prompt's first token this many times")

    def build(request, options):
        from speculant.decoding.stats import GenerationStats

        def decoder():
            for _ in range(min(options.repeat_first, request.max_new_tokens)):
                yield request.prompt_ids[0]
            return GenerationStats(method="echo", new_tokens=options.repeat_first)

        return decoder()

    monkeypatch.setitem(METHODS, "echo", Method("echo", EchoOptions, build, "repeat the first prompt token"))
    assert generate(tiny_model("llama", 0, 32), prompt_ids=[5, 6], method="echo", repeat_first=3).token_ids == [5, 5, 5]
    assert parse_method("echo:repeat_first=4").options.repeat_first == 4
    assert "--repeat-first" in _generate_help()
    with pytest.raises(ConfigError, match="repeat_first"):
        parse_method("echo:repeat_first=many")


def _generate_help() -> str:
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["generate"].format_help()


def test_cli_flags_come_from_the_options_dataclasses():
    text = _generate_help()
    for name, f in all_options().items():
        assert "--" + name.replace("_", "-") in text
        assert scalar_type(f) in (int, float, str, bool)


def test_decoding_imports_nothing_from_analysis_or_cli():
    """Every module below the API (decoding, drafters, models, methods) imports only downward."""
    code = (
        "import importlib, pkgutil, sys, speculant\n"
        "for package in ('decoding', 'drafters', 'models', 'methods'):\n"
        "    path = [str(__import__('pathlib').Path(speculant.__file__).parent / package)]\n"
        "    for m in pkgutil.walk_packages(path, f'speculant.{package}.'):\n"
        "        importlib.import_module(m.name)\n"
        "above = sorted(m for m in sys.modules if m.split('.')[:2] in (['speculant', 'analysis'], ['speculant', 'cli'],"
        " ['speculant', 'bench'], ['speculant', 'api'], ['speculant', 'serve']))\n"
        "print(__import__('json').dumps([len([m for m in sys.modules if m.startswith('speculant.decoding.')]), above]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    imported, above = json.loads(done.stdout)
    assert imported >= 10 and above == []


def test_generate_refuses_what_it_cannot_take_in_one_line_and_takes_numpy_and_torch_integers():
    """generate()'s arguments from Python: a value of the wrong type or shape is a ConfigError naming it (it had
    hung, for a float seed, or failed deep in decoding), and so are settings that would be ignored; NumPy's and
    torch's integers and 1-D arrays are taken as Python's."""
    import numpy as np
    import torch

    from speculant import Session

    target = tiny_model("llama", 1, 64)
    prompt = [1, 2, 3, 4, 5]
    expected = generate(target, prompt_ids=prompt, max_new_tokens=4).token_ids
    for taken in (dict(prompt_ids=np.array(prompt)), dict(prompt_ids=torch.tensor(prompt)),
                  dict(max_new_tokens=np.int64(4)), dict(method="sd", drafter="maxgram", k=np.int32(2))):
        assert generate(target, **{"prompt_ids": prompt, "max_new_tokens": 4, **taken}).token_ids == expected
    seeded = dict(temperature=0.8, max_new_tokens=4)
    assert generate(target, prompt_ids=prompt, seed=np.int64(3), **seeded).token_ids == \
        generate(target, prompt_ids=prompt, seed=3, **seeded).token_ids
    for refused, message in [
            (dict(temperature=0.8, seed=1.5), "seed must be an integer"),
            (dict(temperature=0.8, seed=True), "seed must be an integer"),
            (dict(max_new_tokens="4"), "max_new_tokens must be an integer"),
            (dict(temperature="0.5"), "temperature must be a number"),
            (dict(method="sd", drafter="maxgram", k=2.5), "k must be an integer"),
            (dict(top_p=0.9), "top_p applies when sampling"),
            (dict(verifier="token"), "verifier applies when sampling"),
            (dict(method="ar", temperature=1.0, verifier="token"), "verify sampled draft chains .*not 'ar'"),
            (dict(method="tree", drafter=target, temperature=1.0, verifier="token"), "not 'tree'"),
            (dict(method="dsi", drafter="maxgram", temperature=1.0, verifier="token"), "not 'dsi'"),
            (dict(prompt_ids=torch.tensor([prompt])), r"not an array of shape \(1, 5\) \(a batch of one"),
            (dict(prompt_ids=[1.5, 2]), "must hold integer token ids"),
            (dict(prompt_ids="12"), "must be a sequence of token ids, not str"),
            (dict(prompt_ids={"input_ids": prompt}), r"pass its \['input_ids'\]"),
            (dict(prompt_ids={2, 1}), "in order, not a set"),
            (dict(chat=True), "chat templates a text prompt"),
            (dict(logit_bias=[(7, 5.0)]), "logit_bias must map token ids"),
            (dict(response_format="json_object"), "response_format must be a mapping"),
            (dict(session={}), "session must be a speculant Session"),
            (dict(method="dsi", drafter="self", drafters="maxgram"), "give 'drafter' or 'drafters', not both"),
            (dict(method="auto", drafters=["maxgram", target], tree_widths="3,"), "comma-separated integers"),
            (dict(method="dsi", drafter="maxgram", executor=None), "executor is one of"),
            (dict(method="dsi", drafter="maxgram", twin_latency=(3, "x")), "twin_latency is text"),
            (dict(method="tree", drafter=target, target_profile={}), "target_profile is"),
            (dict(method="tree", drafter=target, depth_predictor=5), "depth_predictor is auto, off"),
            (dict(method="tree", drafter=target, draft_graph="no"), "draft_graph must be True or False"),
            (dict(method="tree", drafter=target, draft_graph=False), "draft_graph off applies where the drafter's"),
            (dict(method="cascade", drafters=[target, target, "maxgram"]), "drafters: tiny-.* is given twice"),
            (dict(method="cascade", drafters="self,self,maxgram"), "drafters: self is given twice"),
            (dict(method="cascade", drafters=["models/d/", "./models//d", "maxgram"]), "models/d is given twice"),
            (dict(drafters=[target], k=3), "no method given, and option 'k' is sd's: option 'drafters' does not apply"),
            (dict(stream="no"), "stream must be True or False"),
            (dict(method="cascade", drafters=[target, "maxgram"], k_matrix=[[1.5, 2], [0, 3]]), "entries must be integ"),
            (dict(method="cascade", drafters=[target, "maxgram"], k_matrix=[["1", 2], [0, 3]]), "entries must be integ"),
            (dict(prompt_ids=None, prompt=123), "the prompt must be a text or a list of messages, not int"),
            (dict(method="sd", drafter=object()), "drafter must be a drafter's name, a model or a Drafter, not object"),
            (dict(method="cascade", drafters=5), "drafters must be a drafter.s name, a model or a Drafter, not int"),
            (dict(prompt_ids=None, prompt="a\udcffb"), "the prompt is not UTF-8 text"),
            (dict(prompt_ids=None, prompt=[{"role": "user", "content": "a\udcff"}]), "not UTF-8 text"),
            (dict(prompt_ids=None, prompt=[{"role": "us\udcffer", "content": "a"}]), "not UTF-8 text"),  # (was
            # the chat template's failure)
            (dict(method="sd", drafter="maxgrm"), "drafter: unknown model 'maxgrm'.* model: .*maxgram, suffix"),
            (dict(method="tree", drafter="maxgrm"), "drafter: unknown model 'maxgrm'(?!.*without a model)"),
            (dict(method="auto", drafters=["maxgram", "nosuch"]), "drafter: unknown model 'nosuch'")]:
        with pytest.raises(ConfigError, match=message):
            generate(target, **{"prompt_ids": prompt, "max_new_tokens": 4, **refused})
    for made in (Session, Session.of):
        with pytest.raises(ConfigError, match="a Session is for a loaded model"):
            made("qwen2.5-coder-1.5b")


def test_a_stream_is_its_own_iterator_and_ends_its_generation_when_dropped_or_taken_over():
    """A stream iterated again goes on where it left off; dropped part way, or paused while another generation on
    its target is made, its generation ends at once (its drafters told, `Drafter.end`)."""
    import gc

    from speculant import Draft, Drafter

    class Told(Drafter):
        name = "told"
        ended = 0

        def propose(self, context, k):
            return Draft([])

        def end(self, prompt_ids, output_ids):
            Told.ended += 1

    target = tiny_model("llama", 1, 64)
    expected = generate(target, prompt_ids=[1, 2, 3], max_new_tokens=5).token_ids
    stream = generate(target, prompt_ids=[1, 2, 3], max_new_tokens=5, stream=True)
    head = [next(stream), next(stream)]
    assert head + list(stream) == expected and list(stream) == [] and stream.result.token_ids == expected
    gc.disable()  # (ended by its count of references, not by the collector: nothing refers back to it)
    try:
        stream = generate(target, prompt_ids=[1, 2, 3], max_new_tokens=5, stream=True, method="sd", drafter=Told())
        next(stream)
        del stream
        assert Told.ended == 1
        paused = generate(target, prompt_ids=[1, 2, 3], max_new_tokens=5, stream=True, method="sd", drafter=Told())
        next(paused)
        generate(target, prompt_ids=[4, 5], max_new_tokens=2, stream=True)  # made, not read: the paused one ends
        assert Told.ended == 2
        closed = generate(target, prompt_ids=[1, 2, 3], max_new_tokens=5, stream=True, method="sd", drafter=Told())
        next(closed)
        closed.close()
        assert Told.ended == 3 and list(closed) == []
    finally:
        gc.enable()


def test_a_drafter_name_nothing_loads_is_refused_before_the_target_loads(monkeypatch):
    """generate() checks its drafters' names as the CLI does, before loading the target by its name."""
    from speculant import api

    monkeypatch.setattr(api, "load_model", lambda *args, **kwargs: pytest.fail("the target was loaded first"))
    with pytest.raises(ConfigError, match="drafter: unknown model 'maxgrm'"):
        generate("smollm2-135m", "x", method="sd", drafter="maxgrm")


def test_a_drafter_dtype_no_named_drafter_loads_in_is_refused_when_the_options_are_made():
    """A GGUF run as stored (`@gguf`, `@lean`, a .gguf file) keeps its own types, `self` the target's, and the drafters
    auto picks itself are the target's backend's to load: a drafter dtype for them is refused with the options, before
    anything loads, never dropped; a model named by its name (quantized or not) takes it."""
    for method, given, message in [
        ("sd", {"drafter": "qwen2.5-coder-0.5b@lean"}, "qwen2.5-coder-0.5b@lean runs its GGUF's own types"),
        ("tree", {"drafter": "/models/m.gguf"}, "/models/m.gguf runs its GGUF's own types"),
        ("cascade", {"drafters": "qwen2.5-coder-0.5b,smollm2-135m@gguf"}, "smollm2-135m@gguf runs its GGUF's"),
        ("auto", {"drafters": "qwen2.5-coder-0.5b@gguf,maxgram"}, "qwen2.5-coder-0.5b@gguf runs its GGUF's"),
        ("auto", {}, "applies to the model drafters named in auto's drafters"),
        ("sd", {"drafter": "self"}, "self loads none"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            get_method(method).parse_options({**given, "drafter_dtype": "bf16"})
    for method, given in [("sd", {"drafter": "qwen2.5-coder-0.5b@int8"}),
                          ("auto", {"drafters": "smollm2-135m,maxgram"}), ("cascade", {"drafters": "self,smollm2-135m"})]:
        assert get_method(method).parse_options({**given, "drafter_dtype": "bf16"}).drafter_dtype == "bf16"


def test_a_drafter_dtype_from_python_is_one_of_its_choices_for_every_method_that_loads_drafters():
    """`drafter_dtype="auto"` passed from Python was refused by sd and tree but taken by auto and cascade, and
    fp16 refused only when the drafter loaded, in the loader's words: every method refuses it with its options."""
    for method, given in [("sd", {"drafter": "smollm2-135m"}), ("tree", {"drafter": "smollm2-135m"}),
                          ("auto", {"drafters": "smollm2-135m,maxgram"}), ("cascade", {"drafters": "smollm2-135m"})]:
        for dtype in ("auto", "fp16"):
            with pytest.raises(OptionError, match=f"drafter dtype must be one of bf16, fp32, got '{dtype}'") as refused:
                get_method(method).make_options({**given, "drafter_dtype": dtype})
            assert refused.value.option == "drafter_dtype"
