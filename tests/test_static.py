"""The static backend (models/backends/static.py): each row of a call is bit for bit what decoding its token alone
gives (chains and token trees, across chunks, with a sliding window, in fp32 and bf16, on the CPU and on CUDA
where there is one), so greedy ar, sd, tree and cascade on it give the same tokens, compiled or not; a tree's
accepted path is compacted in the cache's own storage."""

import pytest
import torch

from helpers import BYTE_VOCAB, DEVICES, assert_trees_fit_the_last_positions, byte_tokenizer, tiny_transformer
from speculant import cli, generate
from speculant.errors import ConfigError
from speculant.models import load_model
from speculant.models.base import Interrupted
from speculant.models.backends.static import GRAPHS, StaticCausalLM, StaticWeights, compile_takes_limit
from speculant.trees.tree import TokenTree

ARCHS = ("llama", "qwen2", "mistral")  # mistral with a sliding window shorter than the generations
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformer(arch: str, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu", noise: float = 0.0):
    """A tiny seeded transformers model; with `noise`, its weights perturbed (a drafter that agrees often)."""
    model = tiny_transformer(arch, seed, vocab=64, init_std=0.1)
    if arch == "mistral":
        model.config.sliding_window = 6
    if noise:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    return model.to(device=device, dtype=dtype)


def static(model, width: int = 4, compiled: bool = False) -> StaticCausalLM:
    return StaticCausalLM(StaticWeights(model), name="tiny", span=96, width=width, compiled=compiled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_row_is_its_token_decoded_alone(arch, dtype, device):
    model = static(transformer(arch, 0, DTYPES[dtype], device))
    prompt = [1, 2, 3, 4, 5, 6, 7]
    alone, verify, tree_model = model, model.share(), model.share()
    rows, token = [alone.prefill(prompt)], None
    tokens = []
    for _ in range(10):
        token = int(rows[-1].argmax())
        tokens.append(token)
        rows.append(alone.forward([token])[0])
    verify.prefill(prompt)
    together = verify.forward(tokens)  # three chunks of width 4
    assert all(torch.equal(together[i], rows[i + 1]) for i in range(10))
    # a tree of 7 nodes (two chunks) whose path 0-2-4-5-6 is the decoded chain, with side branches
    tree = TokenTree((tokens[0], 9, tokens[1], 11, tokens[2], tokens[3], tokens[4]), (-1, 0, 0, 1, 2, 4, 5))
    tree_model.prefill(prompt)
    out = tree_model.forward(list(tree.tokens), tree=tree)
    assert all(torch.equal(out[node], rows[i + 1]) for i, node in enumerate((0, 2, 4, 5, 6)))
    storage = tree_model._keys.data_ptr(), tree_model._values.data_ptr()
    tree_model.keep(len(prompt), [len(prompt) + node for node in (0, 2, 4, 5, 6)])
    assert (tree_model._keys.data_ptr(), tree_model._values.data_ptr()) == storage  # compacted in place
    assert torch.equal(tree_model.forward([tokens[5]])[0], rows[6])


def test_it_computes_what_transformers_computes():
    for arch in ARCHS:
        reference = transformer(arch, 3)
        ids = list(range(3, 23))  # longer than mistral's window
        expected = reference(torch.tensor([ids])).logits[0].float()
        model = static(reference)
        got = torch.cat([model.prefill(ids[:5])[None], model.forward(ids[5:])])
        assert torch.allclose(got, expected[4:], atol=1e-5), arch


def _methods(target, drafter, prompt: list[int], tokens: int = 24, depth: int = 4) -> dict[str, list[int]]:
    """Greedy tokens of ar, sd, tree (its levels in one call: `draft_graph`) and cascade on the static target."""
    return {"ar": generate(target, prompt_ids=prompt, method="ar", max_new_tokens=tokens).token_ids,
            "sd": generate(target, prompt_ids=prompt, method="sd", drafter=drafter, k=5,
                           max_new_tokens=tokens).token_ids,
            "tree": generate(target, prompt_ids=prompt, method="tree", drafter=drafter, depth=depth, width=2,
                             max_new_tokens=tokens).token_ids,
            "cascade": generate(target, prompt_ids=prompt, method="cascade", drafters=[drafter, "maxgram"],
                                max_new_tokens=tokens).token_ids}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_prefilled_in_parts_gives_one_prefill_s_bits(arch, monkeypatch):
    """A server runs a long prompt's `prefill_parts` apart (`continue_prefill`): the logits and the cache after them
    are one prefill's, bit for bit, whatever the parts' lengths."""
    from speculant.models import base

    monkeypatch.setattr(base, "PREFILL_PART", 5)  # not a multiple of the width
    whole, parted = static(transformer(arch, 2)), None
    prompt = [(3 * i + 1) % 60 for i in range(23)]
    expected = whole.prefill(prompt)
    parted = whole.share()
    parts = parted.prefill_parts(prompt)
    assert [len(part) for part in parts] == [5, 5, 5, 5, 3]
    logits = parted.prefill(parts[0])
    for part in parts[1:]:
        logits = parted.continue_prefill(part)
    assert torch.equal(logits, expected) and torch.equal(parted.forward([7]), whole.forward([7]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_methods_equal_ar(arch, dtype, device):
    for seed in range(3):
        target = static(transformer(arch, seed, DTYPES[dtype], device))
        drafter = static(transformer(arch, seed, DTYPES[dtype], device, noise=0.05))
        prompt = [seed + 1, 7, 3, 9, 4]
        eager_hf = generate(load_model(transformer(arch, seed, DTYPES[dtype], device)), prompt_ids=prompt,
                            method="ar", max_new_tokens=24).token_ids
        out = _methods(target, drafter, prompt)
        assert len(set(map(tuple, out.values()))) == 1, (seed, out)
        if dtype == "fp32":  # the same function as transformers' (bf16 rounds elsewhere: another numerics)
            assert out["ar"] == eager_hf


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_steps_give_the_eager_tokens(device, monkeypatch):
    """One compiled step per width (inductor on the CPU; a CUDA graph replayed on a GPU): compiled ar, sd, tree and
    cascade give eager ar's tokens, and compiled rows are their tokens decoded alone (compiled) bit for bit. Every
    pool's step is a graph of one function (`StaticWeights.forward`), so torch.compile's limit of recompilations per
    function (8; here 1) counts them all: the steps have a limit of their own (`compile_graphs`)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    arch = "llama"
    eager = static(transformer(arch, 0, device=device))
    target = static(transformer(arch, 0, device=device), compiled=True)
    drafter = static(transformer(arch, 0, device=device, noise=0.05), compiled=True)
    prompt = [3, 1, 4, 1, 5]
    expected = generate(eager, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
    assert all(tokens == expected for tokens in _methods(target, drafter, prompt, depth=2).values())  # (one graph)
    assert target.compile_seconds() > 0
    one, many = target.share(), target.share()
    first = one.prefill(prompt)
    many.prefill(prompt)
    chain = [int(first.argmax()), 5, 9]
    rows = [one.forward([t])[0] for t in chain]
    assert all(torch.equal(a, b) for a, b in zip(many.forward(chain), rows))


def test_an_older_torch_compiles_the_steps_under_the_process_s_raised_limit(monkeypatch):
    """Where torch.compile takes no `recompile_limit` (the GPU image's torch 2.11), `compile_graphs` raises the
    process's limit to GRAPHS (never lowers it) and compiles as before."""
    from speculant.models.backends import static as backend

    made = []

    def old_compile(fn, *, fullgraph=False, dynamic=None):  # (torch.compile's signature without the limit)
        made.append((fn, fullgraph, dynamic))
        return fn

    monkeypatch.setattr(torch, "compile", old_compile)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    assert backend.compile_graphs(len) is len and made == [(len, True, False)]
    assert torch._dynamo.config.recompile_limit == backend.GRAPHS
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 100)
    backend.compile_graphs(len)
    assert torch._dynamo.config.recompile_limit == 100


def test_load_model_and_cli_take_the_static_backend(tmp_path, capsys):
    transformer("qwen2", 0).save_pretrained(tmp_path / "tiny")
    model = load_model(str(tmp_path / "tiny"), backend="static", dtype="fp32")
    assert isinstance(model, StaticCausalLM) and model.identity.endswith("fp32 static")
    with pytest.raises(ConfigError, match="static backend runs bf16 or fp32"):
        load_model(str(tmp_path / "tiny"), backend="static", quant="int8")
    with pytest.raises(ConfigError, match="static backend runs llama, qwen2, mistral, not gpt2"):
        StaticWeights(tiny_transformer("gpt2", 0))
    gelu = tiny_transformer("llama", 0)
    gelu.config.hidden_act = "gelu"  # (its MLP computed SiLU all the same: another model's logits, without a word)
    with pytest.raises(ConfigError, match="static backend runs SiLU-gated MLPs, not gelu's"):
        StaticWeights(gelu)
    with pytest.raises(ConfigError, match="width is one of"):
        StaticCausalLM(model.weights, width=3)
    assert cli.main(["generate", "def f():", "--target", str(tmp_path / "tiny"), "--backend", "hf", "--compile"]) == 2
    assert "--compile compiles the static backend's step: add --backend static" in capsys.readouterr().err
    tiny_transformer("llama", 0, vocab=BYTE_VOCAB).save_pretrained(tmp_path / "bytes")  # with a tokenizer: text
    byte_tokenizer().save_pretrained(tmp_path / "bytes")
    assert cli.main(["generate", "ab", "--target", str(tmp_path / "bytes"), "--backend", "static", "--compile",
                     "--dtype", "fp32", "--method", "ar", "--max-new-tokens", "4"]) == 0
    assert "compiled the step in" in capsys.readouterr().err


def test_an_interrupted_forward_leaves_the_cache_as_it_was():
    model = static(transformer("llama", 0))
    model.prefill([1, 2, 3])
    checks = iter([False, True])
    model.interrupt = lambda: next(checks)
    with pytest.raises(Interrupted):
        model.forward(list(range(4, 14)))  # three chunks: the second is stopped
    assert model.cache_len == 3


def test_an_empty_forward_and_a_tree_at_other_positions():
    """No tokens: no rows, the cache unchanged (as on the other backends); a tree's nodes run at their root's
    position plus their depth, and other positions are refused (they were ignored) before the cache changes."""
    model, reference = static(transformer("llama", 0)), static(transformer("llama", 0))
    for handle in (model, reference):
        handle.prefill([1, 2, 3, 4, 5])
        handle.forward([7])
    assert model.forward([]).shape == (0, 64) and model.cache_len == 6
    tree = TokenTree((7, 11, 12), (-1, 0, 0))
    with pytest.raises(ValueError, match="root's position plus their depth"):
        model.forward([11, 12], positions=[0, 0], tree=tree)
    assert model.cache_len == 6
    assert torch.equal(model.forward([11, 12], positions=[6, 6], tree=tree), reference.forward([11, 12], tree=tree))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_of_several_sequences_in_one_forward_equal_their_own_forwards(arch, dtype, device):
    """`static.forward_rows`: prefills, chains, a tree and a continued prefill of different sequences packed into
    steps of `width` rows; each gets bit for bit the logits, hidden states and cache length of its own calls, and the
    pool grows under handles already running (their caches kept)."""
    from speculant.models.backends.static import forward_rows
    from speculant.models.base import Call

    base = static(transformer(arch, 0, DTYPES[dtype], device))
    batched, alone = [base.share() for _ in range(3)], [base.share() for _ in range(3)]
    tree = TokenTree((5, 9, 7, 11, 3, 8, 2), (-1, 0, 0, 1, 2, 4, 5))
    rounds = [[Call([1, 2, 3, 4, 5], prefill=True), Call(list(range(3, 14)), prefill=True), Call([7, 8], prefill=True)],
              [Call([1, 2, 3]), Call([4]), Call(tree.tokens, tree=tree)],
              [Call([5, 6]), Call([9, 10, 12], prefill=True), Call([11])],
              [Call(list(range(20, 29)), rows=2), Call([12, 13, 14, 15]), Call([16])],  # a catch-up's last 2 rows
              [Call([17, 18, 19], prefill=True, continues=True), Call([20]), Call([21, 22], prefill=True, continues=True)]]
    for i, calls in enumerate(rounds):
        if i == 2:  # more handles than the pool has free regions: it grows, the running caches copied over
            before, n = base.pool.capacity, batched[0].cache_len
            cached = batched[0]._keys[:, :, :n].clone()
            grown = [base.share() for _ in range(len(base.pool.free) + 1)]
            assert base.pool.capacity > before and torch.equal(batched[0]._keys[:, :, :n], cached)
        got = forward_rows(list(zip(batched, calls)))
        for row, together, call, logits in zip(alone, batched, calls, got):
            assert torch.equal(call.run(row), logits)
            assert torch.equal(row.last_hidden, together.last_hidden)  # (what a depth predictor reads)
        assert [r.cache_len for r in batched] == [r.cache_len for r in alone]
    del grown


@pytest.mark.parametrize("device", DEVICES)
def test_served_static_requests_batch_and_equal_their_solo_runs(device, monkeypatch):
    """A server on the static backend runs concurrent requests' calls as one forward per model (the pool's
    steps); each greedy output equals the request alone and the model's `ar`, for sd and auto."""
    from helpers import assert_served_rows_batch_and_equal_solo
    from speculant.models.backends import static as static_module

    def served(noise: float) -> StaticCausalLM:
        model = tiny_transformer("qwen2", 0, vocab=BYTE_VOCAB, init_std=0.1)
        if noise:  # a drafter that agrees often, not always
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * noise *
                                   parameter.std())
        return StaticCausalLM(StaticWeights(model.to(device)), byte_tokenizer(), name="tiny", span=96, width=4)

    prompts = [list(f"prompt {i}: {'ab' * i}".encode()) for i in range(5)]
    assert_served_rows_batch_and_equal_solo(static_module, served(0.0), served(0.3), prompts, monkeypatch)
    if device == "cpu":  # a request's rows draft a tree level by level: draft_graph off, refused at the start
        from speculant.errors import OptionError
        from speculant.methods import get_method
        from speculant.serve.engine import Engine

        with pytest.raises(OptionError, match="draft_graph off applies where"):
            Engine(served(0.0), "tree", get_method("tree").make_options({"drafter": "self", "draft_graph": False}))


def test_draft_graph_off_with_a_shape_drafted_level_by_level_is_refused():
    """Sequoia-style and N-way trees draft their levels one by one on any backend: draft_graph off changed nothing
    there, without a word."""
    from speculant.errors import OptionError

    model = static(transformer("qwen2", 0))
    for shape in ("sequoia", "nway"):
        with pytest.raises(OptionError, match=f"applies to equal-growth trees .shape egt.; shape {shape} drafts"):
            generate(model, prompt_ids=[1, 2, 3], method="tree", drafter=model.share(), shape=shape, draft_graph=False,
                     max_new_tokens=2)
    assert generate(model, prompt_ids=[1, 2, 3], method="tree", drafter=model.share(), draft_graph=False,
                    max_new_tokens=2).token_ids


def test_a_server_on_a_compiled_pool_takes_a_full_batch_s_regions_at_its_start():
    """Each size of a compiled pool is a step compiled (and on a GPU captured) again: a pool that grew under load
    (1, 4, 16, 64 regions) compiled on the server's worker while every request waited. The server reserves a full
    batch's handles at its start (the target's twice where it drafts for itself); an eager pool grows as before."""
    from speculant.methods import get_method
    from speculant.serve.engine import Engine

    self_drafting = {"drafter": "self", "k": 2}
    for compiled, method, options, regions in ((True, "sd", self_drafting, 16), (True, "ar", {}, 4),
                                               (False, "sd", self_drafting, 1)):
        model = StaticCausalLM(StaticWeights(transformer("qwen2", 0)), span=32, compiled=compiled)  # (no step runs)
        engine = Engine(model, method, get_method(method).make_options(options), max_batch=4 if method == "sd" else 3)
        assert model.pool.capacity == regions, (compiled, method)
        if compiled:  # a full batch's handles, opened: no growth
            handles = [model.share() for _ in range(8 if method == "sd" else 3)]
            assert model.pool.capacity == regions and len(handles) < regions
        engine.close()
    model.pool.reserve(20)
    assert model.pool.capacity == 64  # (fourfold steps, as `take` grows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_grown_in_one_call_is_the_level_by_level_tree(arch, device):
    """`draft_tree` (a tree's levels in one call, `trees.levels`) grows the tree the Python loop grows, eager: the same
    tokens, parents and path probabilities, bit for bit, and the same keys cached for its levels; levels wider than
    the step's rows (6 > 4) run in several steps; Mistral's window shorter than the context."""
    from speculant.trees.drafter import TreeDrafter

    weights = StaticWeights(transformer(arch, 1, device=device))
    context = [(7 * i) % 64 for i in range(20)]
    for width, depth in ((1, 5), (2, 4), (6, 3)):
        loop, graph = (TreeDrafter(StaticCausalLM(weights, span=96), width, graph=g) for g in (False, True))
        assert graph.graph and not loop.graph
        a, b = loop.propose_tree(context, depth, width), graph.propose_tree(context, depth, width)
        assert a.tree == b.tree and a.path_probs == b.path_probs and len(a.tree) == 1 + depth * width
        assert loop.model.cache_len == graph.model.cache_len == len(context) + (depth - 1) * width
        assert graph.model.usage.steps == loop.model.usage.steps  # (one forward per level but the last, counted)
        n = len(context) + (depth - 1) * width
        assert torch.equal(loop.model.model._keys[:, :, :n], graph.model.model._keys[:, :, :n])


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_tree_is_one_graph_of_the_same_tree(device):
    """Compiled, the levels are one inductor graph, grown to a power of two of levels and cut: the same tree as the
    compiled steps grow level by level, counted as the levels it ran. Only the backend and `Metered` draft trees on
    the device: any other wrapper's forwards (a server's batched rows, DSI's padded time) would be bypassed."""
    from speculant.models.base import Delegating
    from speculant.trees.drafter import TreeDrafter

    limit = torch._dynamo.config.recompile_limit
    weights = StaticWeights(transformer("qwen2", 2, device=device))
    loop, graph = (TreeDrafter(StaticCausalLM(weights, span=96, compiled=True), 2, graph=g) for g in (False, True))
    graph.model.model.pool.levels_in_steps = False  # (a GPU's default is the next test's)
    context = [(5 * i) % 64 for i in range(12)]
    a, b = loop.propose_tree(context, 3, 2), graph.propose_tree(context, 3, 2)
    assert a.tree == b.tree and len(b.tree) == 7
    assert graph.model.cache_len == len(context) + 3 * 2 and graph.model.usage.steps == 3  # (4 levels grown: 3 run)
    assert graph.model.capabilities.drafts_trees and not Delegating(graph.model.model).capabilities.drafts_trees
    raised = limit if compile_takes_limit() else max(limit, GRAPHS)  # (an older torch's: the process's is raised)
    assert torch._dynamo.config.recompile_limit == raised  # (the compiled functions' own limit, not the process's)


@pytest.mark.parametrize("rows", (1, 4))
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_tree_s_levels_run_by_the_compiled_step_are_the_same_tree(device, rows):
    """`levels_in_steps` (a GPU's default: the levels and the choices between them captured as one CUDA graph, each
    level the compiled step, where one inductor graph of every level compiles for minutes at a real drafter's size):
    the same tree as the compiled steps grow level by level, grown to the depth asked (nothing to round up to), with
    nothing compiled beyond the steps' graph, at one row a step as at four."""
    from speculant.trees.drafter import TreeDrafter

    weights = StaticWeights(transformer("llama", 2, device=device))
    loop, steps = (TreeDrafter(StaticCausalLM(weights, span=96, width=rows, compiled=True), 2, graph=g)
                   for g in (False, True))
    steps.model.model.pool.levels_in_steps = True
    context = [(3 * i) % 64 for i in range(12)]
    loop.propose_tree(context, 2, 2)  # (the step compiled)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for depth in (3, 5):
        a, b = loop.propose_tree(context, depth, 2), steps.propose_tree(context, depth, 2)
        assert a.tree == b.tree and a.path_probs == b.path_probs and len(b.tree) == 1 + 2 * depth
        assert steps.model.cache_len == len(context) + (depth - 1) * 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled  # the steps' graph: nothing compiled


def test_a_handle_s_work_on_its_region_waits_for_the_pool():
    """`keep`, `export_kv` and `import_kv` take the pool's lock: a pool growing on another thread (a new handle
    taking a region) moves every region's storage, and a compaction meanwhile would write into the old one."""
    import threading

    handle = static(transformer("llama", 0))
    handle.prefill([1, 2, 3, 4])
    done = threading.Event()
    with handle.pool.lock:
        worker = threading.Thread(target=lambda: (handle.keep(2, []), done.set()))
        worker.start()
        assert not done.wait(0.2)  # it waits while another thread holds the pool
    worker.join(5)
    assert done.is_set() and handle.cache_len == 2


def test_a_handle_s_work_on_its_region_is_queued_after_the_pool_s_last(monkeypatch):
    """`keep`, `export_kv` and `import_kv` queue after the pool's last work and mark theirs (`KVPool.ordered`, on a GPU
    an event), as steps do: a stage drafter's thread queues the pool's work on a stream of its own."""
    handle = static(transformer("llama", 0))
    handle.prefill([1, 2, 3, 4])
    log = []
    monkeypatch.setattr(handle.pool, "_follow", lambda: log.append("follow"))
    monkeypatch.setattr(handle.pool, "_mark", lambda: log.append("mark"))
    handle.import_kv([handle.export_kv(0, 3)])
    handle.keep(2, [])
    assert log == ["follow", "mark"] * 3 and handle.cache_len == 2


def test_a_dropped_handle_gives_its_region_back_without_waiting_for_the_pool():
    """A handle's finalizer hands its region back without the pool's lock: it may run on any thread (the garbage
    collection a CUDA graph capture starts, holding the process's `CAPTURING`) while another thread holds the lock
    and waits for that capture. The next handle takes the region."""
    import threading

    handle = static(transformer("llama", 0))
    handles = [handle.share()]
    region, returned = handles[0]._region, threading.Event()
    with handle.pool.lock:
        worker = threading.Thread(target=lambda: (handles.clear(), returned.set()))
        worker.start()
        assert returned.wait(5)  # (before: it waited for the lock)
    worker.join(5)
    assert handle.share()._region == region


def test_trees_near_the_end_of_the_cache_fit_the_slots_left(monkeypatch):
    assert_trees_fit_the_last_positions(static(transformer("llama", 0)), 64, monkeypatch)


def test_the_compiled_step_writes_the_caches_in_place():
    """Functionalized, as torch.compile runs it (the test reads that graph; inductor then writes in place), the step
    writes the pool's caches by `index_put` on the whole tensors: written through a view (`keys[i, :, slots] = ...`),
    each layer's write became a `select_scatter` of every region's cache, a compiled step's cost growing with the
    handles on its weights."""
    from torch.fx.experimental.proxy_tensor import make_fx

    handle = static(transformer("qwen2", 0))
    handle.prefill([1, 2, 3])
    pool = handle.pool

    def step(keys, values, ids, positions, slots, index, offsets):
        return pool.weights(keys, values, ids, positions, slots, index, offsets)

    graph = make_fx(torch.func.functionalize(step))(pool.keys, pool.values, *pool._inputs)
    ops = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert sum("index_put" in op for op in ops) == 2 * len(pool.weights.layers)
    assert not [op for op in ops if "scatter" in op]


def test_a_tree_s_levels_read_no_tensor_made_on_the_host():
    """A CUDA graph (a tree's levels captured as one, `KVPool.draft`) cannot copy from the host's pageable memory:
    every tensor an operation of the levels reads (`StaticWeights.draft`: `trees.levels.grow` and the step) is an
    input, a weight or an earlier operation's output, none made on the host on the way (`frontier[best] = -inf` made
    its scalar there)."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class Provenance(TorchDispatchMode):
        def __init__(self, inputs):
            super().__init__()
            self.known, self.foreign = {id(t): t for t in inputs}, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.foreign += [str(func) for a in pytree.tree_leaves((args, kwargs))
                             if isinstance(a, torch.Tensor) and id(a) not in self.known]
            out = func(*args, **(kwargs or {}))
            self.known.update((id(t), t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    handle = static(transformer("mistral", 0))  # (its window: the masks of both kinds of layer)
    handle.prefill(list(range(10)))
    pool = handle.pool
    root, offset = pool._root  # (as `KVPool.draft` passes them)
    inputs = (pool.keys, pool.values, pool._root_logits, root, offset)
    with torch.inference_mode(), Provenance([*inputs, *pool.weights.buffers()]) as mode:
        tokens, parents, _ = pool.weights.draft(*inputs, 3, 2, pool.width, pool.span)
    assert len(tokens) == 7 and parents[0] == -1
    assert mode.foreign == []
