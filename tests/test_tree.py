"""TokenTree data and tree attention in the hf backend against running each path on its own."""

import pytest
import torch

from helpers import ARCHS, DEVICES, random_prompt, tiny_model
from speculant.trees.tree import TokenTree

#        0 (root)
#       / \
#      1   2
#     / \    \
#    3   4    5
TREE = TokenTree((7, 11, 12, 13, 14, 15), (-1, 0, 0, 1, 1, 2))


def test_depths_positions_paths_and_mask():
    assert TREE.depths == (0, 1, 1, 2, 2, 2)
    assert TREE.positions(10) == [10, 11, 11, 12, 12, 12]
    assert [TREE.path_to(leaf) for leaf in (3, 4, 5)] == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert TREE.children(1) == [3, 4]
    mask = TREE.ancestor_mask
    assert mask[3].tolist() == [True, True, False, True, False, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]


def test_malformed_trees_are_refused():
    for parents in ((-1, 1), (0, 0)):
        with pytest.raises(ValueError, match="parents must precede their children and node 0 must be the root"):
            TokenTree((1, 2), parents)
    with pytest.raises(TypeError, match="tuples of ints, not tensors"):  # (was torch's "Boolean value of Tensor")
        TokenTree(torch.tensor([1, 2]), (-1, 0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_equals_each_path_alone(arch, device):
    model = tiny_model(arch, 4, 64, device=device)
    prefix = random_prompt(4, 64, 9)
    model.prefill(prefix)
    cached = model.cache_len
    tree_logits = model.forward(list(TREE.tokens), tree=TREE)  # [6, vocab]
    for path in (TREE.path_to(leaf) for leaf in (3, 4, 5)):
        model.rollback(cached)
        path_logits = model.forward([TREE.tokens[i] for i in path])
        torch.testing.assert_close(tree_logits[path], path_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_growing_a_tree_step_by_step_equals_one_pass(arch):
    model = tiny_model(arch, 5, 64)
    prefix = random_prompt(5, 64, 9)
    model.prefill(prefix)
    whole = model.forward(list(TREE.tokens), tree=TREE)
    model.rollback(len(prefix))
    steps = [model.forward(list(TREE.tokens[:1]), tree=TokenTree(TREE.tokens[:1], TREE.parents[:1]))]
    steps.append(model.forward(list(TREE.tokens[1:3]), tree=TokenTree(TREE.tokens[:3], TREE.parents[:3])))
    steps.append(model.forward(list(TREE.tokens[3:]), tree=TREE))
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_keep_accepted_path_equals_fresh_prefill(arch, device):
    model = tiny_model(arch, 6, 64, device=device)
    prefix = random_prompt(6, 64, 9)
    model.prefill(prefix)
    model.forward(list(TREE.tokens), tree=TREE)
    path = TREE.path_to(4)  # root, 1, 4
    model.keep(len(prefix), [len(prefix) + i for i in path])
    after_keep = model.forward([33])
    model.rollback(0)
    fresh = model.forward(prefix + [TREE.tokens[i] for i in path] + [33])[-1:]
    torch.testing.assert_close(after_keep, fresh, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("depth", "width"), [(1, 1), (3, 1), (2, 3), (4, 4)])
def test_greedy_tree_speculation_matches_autoregressive(arch, depth, width, device):
    from helpers import perturbed
    from speculant import generate

    for seed in range(2):
        target = tiny_model(arch, seed, 64, device=device)
        prompt = random_prompt(seed + 50, 64)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
        for label, drafter in [("itself", target.share()), ("perturbed", perturbed(target, 0.3, seed)),
                               ("other", tiny_model(arch, seed + 7, 64, device=device))]:
            result = generate(target, prompt_ids=prompt, drafter=drafter, method="tree", depth=depth, width=width,
                              max_new_tokens=30)
            assert result.token_ids == expected, label
            stats = result.stats
            assert stats.drafted_nodes <= depth * width * len(stats.accepted_lengths)
            if label == "itself" and width == 1:  # a chain of the target's own argmaxes is accepted whole
                assert stats.accepted_lengths == stats.draft_lengths
            elif label == "itself":  # the root's argmax child is always in the tree
                assert all(a >= min(d, 1) for a, d in zip(stats.accepted_lengths, stats.draft_lengths))


def test_tree_verification_follows_the_target_argmax():
    from speculant.verify import verify_tree_greedy

    logits = torch.zeros(len(TREE), 20)
    for node, best in enumerate([12, 14, 0, 9, 3, 1]):  # the root wants 12 (node 2), node 2 wants 0 (absent)
        logits[node, best] = 1.0
    assert verify_tree_greedy(TREE, logits) == ([2], 0)
    logits[2] = 0
    logits[2, 15] = 1.0  # now node 2's argmax is its child 5's token
    assert verify_tree_greedy(TREE, logits) == ([2, 5], 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("depth", "width", "verify_width"), [(3, 3, 4), (4, 4, 1), (4, 2, 8)])
def test_pruned_tree_speculation_matches_autoregressive(arch, depth, width, verify_width):
    from helpers import perturbed
    from speculant import generate

    for seed in range(2):
        target = tiny_model(arch, seed, 64, init_std=0.1)
        prompt = random_prompt(seed + 60, 64)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
        result = generate(target, prompt_ids=prompt, drafter=perturbed(target, 0.3, seed), method="tree", depth=depth,
                          width=width, verify_width=verify_width, max_new_tokens=30)
        assert result.token_ids == expected
        stats = result.stats
        assert stats.verified_nodes <= min(verify_width * len(stats.accepted_lengths), stats.drafted_nodes)
        assert sum(stats.verified_sizes) == stats.verified_nodes and max(stats.verified_sizes) <= verify_width
        if verify_width < depth * width:
            assert stats.verified_nodes < stats.drafted_nodes


def test_subtree_renumbers_and_refuses_orphans():
    assert TREE.subtree([0, 2, 5, 1]) == TokenTree((7, 11, 12, 15), (-1, 0, 0, 2))
    with pytest.raises(ValueError, match="keeps the root and the parent of every node"):
        TREE.subtree([0, 3])


def brute_force_best(tree, values, size):
    """The best connected subtree with the root and `size` nodes, by trying every node set."""
    from itertools import combinations

    best = None
    for rest in combinations(range(1, len(tree)), size - 1):
        nodes = {0, *rest}
        if all(tree.parents[n] in nodes for n in rest):
            value = sum(values[n] for n in nodes)
            best = value if best is None else max(best, value)
    return best


def test_pruning_dp_finds_the_brute_force_optimum():
    from speculant.trees.prune import best_subtrees, prune

    rng = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 2 + trial % 9
        parents = (-1, *(int(torch.randint(0, i, (), generator=rng)) for i in range(1, n)))
        tree = TokenTree(tuple(range(n)), parents)
        values = [0.0, *torch.rand(n - 1, generator=rng).tolist()]  # not monotone along paths: greedy fails
        table = best_subtrees(tree, values, n)
        for size in range(1, n + 1):
            value, nodes = table[size]
            assert len(set(nodes)) == size and value == pytest.approx(brute_force_best(tree, values, size))
    # The latency-aware choice: with a steep T(n), fewer nodes win; with a flat one, all of them.
    tree = TokenTree((0, 1, 2, 3), (-1, 0, 1, 2))
    probs = [1.0, 0.9, 0.5, 0.1]
    assert prune(tree, probs, 3) == [0, 1, 2, 3]
    assert prune(tree, probs, 3, cost=lambda n: 1.0) == [0, 1, 2, 3]
    assert prune(tree, probs, 3, cost=lambda n: 1 + 0.5 * (n - 1)) == [0, 1]
    assert prune(tree, probs, 3, cost=lambda n: float(n)) == [0]  # cost linear in tokens: verify nothing
    assert prune(tree, probs, 1) == [0, 1]


def test_tree_sampling_verification_follows_the_target():
    """Children tried in turn with residual updates: the first emitted token follows p at the root,
    and, given the walk went to a child, the next one follows p at that child."""
    from helpers import total_variation
    from speculant.verify import verify_tree_sampling

    vocab = 20
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(len(TREE), vocab, generator=gen) * 2, -1)
    p[0, 11] = p[0, 12] = 0.3  # the root's children (tokens 11, 12) are likely but not certain
    p[0] /= p[0].sum()
    first = torch.zeros(vocab)
    after_node1 = torch.zeros(vocab)
    for _ in range(20_000):
        path, token = verify_tree_sampling(TREE, p, gen)
        emitted = [TREE.tokens[n] for n in path] + [token]
        first[emitted[0]] += 1
        if path[:1] == [1]:
            after_node1[emitted[1]] += 1
    assert total_variation(first / first.sum(), p[0]) < 0.02
    assert total_variation(after_node1 / after_node1.sum(), p[1]) < 0.03
    # Skipping the residual update (retrying a rejected token's mass) would over-weight the children:
    wrong = p[0].clone()
    wrong[[11, 12]] += 0.1
    assert total_variation(wrong / wrong.sum(), p[0]) > 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_tree_sampling_end_to_end_matches_target_distribution(device):
    from test_sampling import assert_follows_target, sampling_pair

    target, drafter, prompt = sampling_pair(device=device)
    assert_follows_target(target, prompt, method="tree", drafter=drafter, depth=2, width=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", [*ARCHS, "mistral"])
def test_stage_scheduling_keeps_the_output_and_uses_the_trees_it_drafted_ahead(arch, device):
    """`schedule="stage"`: each next tree is drafted during verification from the likeliest path; where the
    target commits that path and the drafter's next token, the step starts with it, else it is dropped and the
    drafter's cache rolled back. Greedy output equals `ar`'s whatever the drafter; Mistral with a window of 6 on
    the static backend."""
    from helpers import perturbed
    from test_static import static, transformer

    from speculant import generate

    if arch == "mistral":
        target, other, near = (static(transformer(arch, seed, device=device, noise=noise))
                               for seed, noise in ((3, 0.0), (10, 0.0), (3, 0.3)))
    else:
        target, other = tiny_model(arch, 3, 64, device=device), tiny_model(arch, 10, 64, device=device)
        near = perturbed(target, 0.3, 3)
    prompt = random_prompt(53, 64)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
    for label, drafter in [("itself", target.share()), ("perturbed", near), ("other", other)]:
        result = generate(target, prompt_ids=prompt, drafter=drafter, method="tree", depth=3, width=2,
                          max_new_tokens=40, schedule="stage")
        assert result.token_ids == expected, label
        stage = result.stats.stage
        assert stage.drafted >= len(result.stats.accepted_lengths) - 1 and 0 <= stage.overlap <= 1
        if label == "itself":  # the likeliest path is the target's own: nearly every tree drafted ahead is used
            assert stage.hits >= stage.drafted - 2, stage
        assert "stage:" in result.stats.summary()


def test_stage_scheduled_tree_sampling_matches_target_distribution():
    """With a drafter near the target, so that trees drafted ahead are taken (a far one's never are), of one level:
    the first tree's child and the target's token after it are tokens 2 and 3, so a tree taken ahead drafts the
    fourth at the earliest (three tokens checked never saw one), and five are checked."""
    from speculant import generate
    from test_sampling import TEMPERATURE, assert_follows_target, sampling_pair

    target, drafter, prompt = sampling_pair(near=True)
    options = dict(method="tree", drafter=drafter, depth=1, width=3, schedule="stage")
    assert sum(generate(target, prompt_ids=prompt, max_new_tokens=7, temperature=TEMPERATURE, seed=seed,
                        **options).stats.stage.hits for seed in range(30)) > 0
    assert_follows_target(target, prompt, n=5, **options)


def test_objective_decides_the_depth():
    from helpers import perturbed
    from speculant import generate
    from speculant.latency import LatencyProfile
    from speculant.trees.drafter import worth_another_step

    # Likely children and a flat target cost: one more step pays; with T(n) linear in n it does not.
    scores = [0.0, -0.1, -0.2]  # log path probabilities of the root and two nodes
    assert worth_another_step(scores, [], [1, 2], 2, lambda n: 1.0, spent=0.01, step_seconds=0.01)
    assert not worth_another_step(scores, [], [1, 2], 2, lambda n: float(n), spent=0.01, step_seconds=0.01)

    target = tiny_model("llama", 4, 64, init_std=0.1)
    prompt = random_prompt(70, 64)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    flat = LatencyProfile("t", "fp32", "cpu", 0, 1.0, 1.0, {1: 1.0, 64: 1.0})
    steep = LatencyProfile("t", "fp32", "cpu", 0, 1.0, 1.0, {1: 1.0, 64: 64.0})
    depths = {}
    for name, profile in [("flat", flat), ("steep", steep)]:
        result = generate(target, prompt_ids=prompt, drafter=perturbed(target, 0.2, 4), method="tree", depth=6,
                          width=2, target_profile=profile, max_new_tokens=30)
        assert result.token_ids == expected, name
        depths[name] = max(result.stats.draft_lengths)
    assert depths["steep"] < depths["flat"] <= 6


def test_a_target_profile_of_another_model_is_said_once(caplog):
    """A profile measured on another model (the drafter's, given as the target's) shaped the trees without a word;
    it is said once per session, not at every generation (a bench's every prompt)."""
    from helpers import perturbed
    from speculant import generate
    from speculant.latency import LatencyProfile

    target = tiny_model("llama", 4, 64, init_std=0.1)
    drafter = perturbed(target, 0.2, 4)
    for model, said in (("other", 1), ("other", 0), (target.name, 0)):
        caplog.clear()
        profile = LatencyProfile(model, "fp32", "cpu", 0, 1.0, 1.0, {1: 1.0, 64: 1.0})
        with caplog.at_level("WARNING", logger="speculant"):
            generate(target, prompt_ids=random_prompt(7, 64), drafter=drafter, method="tree",
                     depth=3, width=2, target_profile=profile, max_new_tokens=4)
        assert caplog.text.count("the target profile was measured on other") == said, caplog.text


def test_tree_shape_resolves_auto_from_a_profile_or_measured_costs():
    from speculant import Session
    from speculant.latency import LatencyProfile
    from speculant.trees.shape import AUTO_MAX_DEPTH, TARGET_WIDTHS, tree_shape

    target, drafter = tiny_model("llama", 1, 64), tiny_model("llama", 2, 64)
    prompt = random_prompt(1, 64)
    fixed = tree_shape(target, drafter, prompt, 3, 2, None, None, Session(target))
    assert (fixed.depth, fixed.width, fixed.verify_width, fixed.cost) == (3, 2, None, None)
    flat = LatencyProfile("t", "fp32", "cpu", 0, 1.0, 1.0, {1: 1.0, 64: 1.0})
    profiled = tree_shape(target, drafter, prompt, "auto", 2, None, flat, Session(target))
    assert (profiled.depth, profiled.width, profiled.verify_width) == (AUTO_MAX_DEPTH, 2, 2 * AUTO_MAX_DEPTH)
    assert profiled.cost(10) == 1.0
    measured = tree_shape(target, drafter, prompt, 3, 2, "auto", None, Session(target))
    assert measured.verify_width == 6 and measured.cost(1) > 0  # T(n) measured on the target
    deep = tree_shape(target, drafter, prompt, "auto", 4, "auto", None, Session(target))
    assert deep.verify_width == TARGET_WIDTHS[-1]  # the objective stays within the measured T(n)


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_tree_is_lossless_and_reports_its_shape(arch):
    from helpers import perturbed
    from speculant import generate
    from speculant.trees.plan import PLAN_WIDTHS
    from speculant.trees.shape import AUTO_MAX_DEPTH

    target = tiny_model(arch, 8, 64, init_std=0.1)
    prompt = random_prompt(80, 64)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    result = generate(target, prompt_ids=prompt, drafter=perturbed(target, 0.2, 8), method="tree", depth="auto",
                      width="auto", verify_width="auto", max_new_tokens=30)
    assert result.token_ids == expected
    depth, width, verify = result.stats.tree_shape
    assert depth == AUTO_MAX_DEPTH and width in PLAN_WIDTHS and max(result.stats.verified_sizes) <= verify
    assert "first level" in result.stats.summary()


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_auto_tree_sizes_on_a_model_of_fewer_positions_than_the_widest_measured_forward(backend, monkeypatch):
    """A target of 32 positions (TARGET_WIDTHS reach 32) and a drafter of 6 (PLAN_WIDTHS reach 8), the target's own
    weights: the widths that fit after a token of context are measured, the others extrapolated, and the output is
    ar's (the measurement had prefilled nothing, or run past the cache); after a short prompt the drafts are
    accepted, a long one leaves the drafter no room to draft. The forwards are measured as they run, their times
    reported as a slow target's and a fast drafter's: a self-drafting pair's objective is a toss-up on the times
    measured on a loaded machine (a tree whose drafting costs what it saves), and the drafts would be left out."""
    from helpers import tiny_transformer

    import speculant.trees.shape
    from speculant import Session, generate, load_model
    from speculant.models.backends.static import StaticCausalLM, StaticWeights

    def forward_costs(model, *args, measured=speculant.trees.shape.forward_costs, **kwargs):
        costs = measured(model, *args, **kwargs)  # (the drafter is the model of 6 positions)
        return {width: 1e-3 if model.max_positions == 6 else 1.0 for width in costs}

    monkeypatch.setattr(speculant.trees.shape, "forward_costs", forward_costs)

    def model(seed, positions):
        module = tiny_transformer("llama", seed, 64, init_std=0.1)
        module.config.max_position_embeddings = positions
        if backend == "static":
            return StaticCausalLM(StaticWeights(module), name=f"tiny-{seed}", span=positions, width=4)
        return load_model(module)

    target, drafter = model(1, 32), model(1, 6)
    for prompt in ([5, 9], random_prompt(3, 64, 24)):
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=6).token_ids
        for sizes in (dict(verify_width="auto"), dict(width="auto"), dict(depth="auto", width=2)):
            result = generate(target, prompt_ids=prompt, method="tree", drafter=drafter, max_new_tokens=6,
                              session=Session(target), **sizes)  # (measured after this prompt)
            assert result.token_ids == expected, (len(prompt), sizes)
            accepted, drafted = sum(result.stats.accepted_lengths), result.stats.drafted_nodes
            assert accepted > 0 if len(prompt) < 6 else drafted == 0, (len(prompt), sizes)


def test_summary_reports_the_tree_shape_when_the_objective_verifies_nothing():
    from speculant.decoding.stats import GenerationStats

    stats = GenerationStats(method="tree", new_tokens=2, target_forwards=3, tree_shape=(16, 1, 16),
                            draft_lengths=[0, 0], accepted_lengths=[0, 0], drafted_nodes=2, verified_sizes=[0, 0])
    assert "0.0 of 1.0 drafted nodes verified (depth <= 16, first level 1, verify <= 16)" in stats.summary()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_length_objective_drafts_every_level_and_stays_lossless(arch):
    """objective=length (the paper's Fig. 14 baseline): each tree is drafted to its full depth and verified within
    the same verify width, costs left out; the speedup objective, on a steep T(n), stops earlier. Both equal `ar`.
    What only costs decide (an auto depth or width, a profile, a depth predictor) is refused beside length, not
    dropped."""
    from helpers import perturbed
    from speculant import generate
    from speculant.errors import OptionError
    from speculant.latency import LatencyProfile
    from speculant.trees.depth import FEATURES, DepthPredictor

    target = tiny_model(arch, 8, 64, init_std=0.1)
    drafter = perturbed(target, 0.2, 8)
    prompt = random_prompt(81, 64)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    profile = LatencyProfile("t", "fp32", "cpu", 0, 1.0, 1.0, {1: 1.0, 64: 64.0})
    depths = {}  # drafting levels per tree
    for objective, costs in (("speedup", dict(target_profile=profile)), ("length", {})):
        result = generate(target, prompt_ids=prompt, drafter=drafter, method="tree", depth=4, width=2,
                          verify_width="auto", objective=objective, max_new_tokens=30, **costs)
        assert result.token_ids == expected, objective
        depths[objective] = sum(result.stats.drafter_forwards.values()) / len(result.stats.draft_lengths)
    assert depths["length"] > 3  # all 4 levels, but where a tree meets max_new_tokens
    assert depths["speedup"] < depths["length"]  # the profile's steep T(n): deeper levels do not pay
    predictor = DepthPredictor(3, "features", FEATURES)
    for name, value in (("depth", "auto"), ("width", "auto"), ("target_profile", profile),
                        ("depth_predictor", predictor)):
        refused = f"objective length .*: {name.replace('_', '-')} .*does not apply"
        with pytest.raises(OptionError, match=refused) as error:
            generate(target, prompt_ids=prompt, drafter=drafter, method="tree", objective="length",
                     **{"depth": 4, "width": 2, name: value})
        assert error.value.option == "objective"


def test_trees_grown_in_one_call_keep_the_target_distribution_when_sampling():
    """The static backend's trees grown in one call (`draft_graph`) verified by multi-draft sampling: the emitted
    tokens follow the target's distribution. The drafter reads only its last token (its layers' outputs zeroed) and
    the Markov target takes its logits after each token with noise: whole paths are often accepted, yet q is far
    enough from p that a verifier emitting the drafts as drawn would fail."""
    from helpers import MarkovLM, tiny_transformer, total_variation
    from test_sampling import TEMPERATURE, VOCAB, assert_follows_target, exact_marginals

    from speculant import generate
    from speculant.config import SamplingConfig
    from speculant.models.backends.static import StaticCausalLM, StaticWeights
    from speculant.sampling import logits_to_probs

    model = tiny_transformer("qwen2", 5, vocab=VOCAB, init_std=0.15)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    drafter = StaticCausalLM(StaticWeights(model), span=64)
    after = torch.stack([drafter.prefill([t]).float() for t in range(VOCAB)])  # [token, vocab]: the drafter's q
    noise = torch.randn(VOCAB + 1, VOCAB, VOCAB, generator=torch.Generator().manual_seed(5))
    target = MarkovLM(VOCAB, 5, table=after + 0.5 * noise)  # [parent, token, vocab]
    prompt = random_prompt(5, VOCAB, 6)
    config = SamplingConfig(TEMPERATURE)
    q1 = logits_to_probs(drafter.prefill(prompt), config)
    assert total_variation(exact_marginals(target, prompt, n=1)[0], q1) > 0.15  # (q is not p)
    grown, draft_tree = [], drafter.draft_tree
    drafter.draft_tree = lambda *args: grown.append(args[1:]) or draft_tree(*args)
    result = generate(target, prompt_ids=prompt, method="tree", drafter=drafter, depth=3, width=2,
                      objective="length", temperature=TEMPERATURE, seed=0, max_new_tokens=60)
    assert sum(result.stats.accepted_lengths) / len(result.stats.accepted_lengths) > 0.5  # (paths accepted)
    assert (3, 2) in grown  # (the trees were grown in one call)
    assert_follows_target(target, prompt, method="tree", drafter=drafter, depth=3, width=2, objective="length")


@pytest.mark.parametrize("shape", ["egt", "nway"])
def test_a_width_beyond_the_drafter_s_vocabulary_is_refused_by_name(shape):
    from speculant import generate
    from speculant.errors import OptionError

    target = tiny_model("llama", 0)
    with pytest.raises(OptionError, match=f"width 300 exceeds the drafter's vocabulary of {target.vocab_size}") as refused:
        generate(target, prompt_ids=[1, 2, 3], method="tree", drafter=target, depth=2, width=300, shape=shape,
                 max_new_tokens=4)
    assert refused.value.option == "width"


def test_a_tree_width_of_auto_beyond_the_drafter_s_vocabulary_is_refused_by_name():
    """auto took tree_widths wider than the vocabulary and never drafted those trees, without a word."""
    from speculant import generate
    from speculant.errors import OptionError

    target = tiny_model("llama", 0)
    with pytest.raises(OptionError, match=f"tree_widths 300 exceeds the drafter's vocabulary of {target.vocab_size}") \
            as refused:
        generate(target, prompt_ids=[1, 2, 3], method="auto", drafters=[target.share()], tree_widths=(2, 300),
                 max_new_tokens=4)
    assert refused.value.option == "tree_widths"


def test_a_tree_drafter_says_how_many_levels_its_positions_hold():
    """`most`, what auto weighs a tree candidate at: the levels of its width that fit the drafter's positions left
    after the context (one narrower level where no whole one does, none where no slot is left), as its trees are cut."""
    from helpers import tiny_transformer

    from speculant import load_model
    from speculant.trees.drafter import TreeDrafter

    module = tiny_transformer("llama", 1, 64, init_std=0.1)
    module.config.max_position_embeddings = 6
    drafter = TreeDrafter(load_model(module), 2, verifier=load_model(tiny_transformer("llama", 1, 64, init_std=0.1)))
    assert [drafter.most([5] * length) for length in range(1, 8)] == [2, 2, 1, 1, 1, 0, 0]
    for length in range(1, 8):
        assert max(drafter.propose([5] * length, 8).tree.depths) == drafter.most([5] * length), length
