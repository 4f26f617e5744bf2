"""Execution-plan search and per-context width (Yggdrasil section 5.2): the acceptance model's expected tree against
simulation, the search against costs that should decide it, and `tree` with `width=auto` lossless."""

import random

import pytest
import torch

from helpers import ARCHS, costs, invent, perturbed, random_prompt, tiny_model
from speculant.analysis.online import run
from speculant.trees.plan import PLAN_WIDTHS, choose_width, expected_accepted, expected_tree, rank_coverage, search


def simulated_accepted(coverage, depth, width, trials=20000, seed=0):
    """Accepted length of the expected tree when each position's accepted token is the drafter's rank r with
    probability coverage[r] (any other rank: a miss), drawn independently."""
    tree, _ = expected_tree(coverage, depth, width)
    rng, total = random.Random(seed), 0
    ranks, weights = list(range(len(coverage) + 1)), [*coverage, 1 - sum(coverage)]
    for _ in range(trials):
        node = 0
        while True:
            rank = rng.choices(ranks, weights)[0]
            child = next((c for c in tree.child_lists[node] if tree.tokens[c] == rank), None)
            if child is None:
                break
            total, node = total + 1, child
    return total / trials


@pytest.mark.parametrize("depth,width", [(1, 1), (4, 1), (3, 2), (5, 3)])
def test_the_expected_trees_accepted_length_is_what_simulation_accepts(depth, width):
    coverage = [0.55, 0.2, 0.1, 0.05]
    length = expected_accepted(coverage, depth, width)
    assert max(length) == depth * width  # every drafted node verified
    assert length[depth * width] == pytest.approx(simulated_accepted(coverage, depth, width), abs=0.03)
    if width == 1:
        assert length[depth] == pytest.approx(sum(0.55 ** j for j in range(1, depth + 1)))


def test_the_search_follows_the_costs():
    coverage = [0.6, 0.2, 0.1, 0.05, 0.02, 0.01, 0.01, 0.01]
    flat = search(coverage, lambda n: 1.0, lambda w: 0.01)  # verification free in width, drafting nearly free
    assert flat.width > 1 and flat.depth >= 4 and flat.speedup > 2
    steep = search(coverage, lambda n: float(n), lambda w: 0.01 * w)  # each verified token costs a forward
    assert steep.depth == 0 and steep.speedup == 1.0  # nothing pays: plain decoding
    dear_nodes = search(coverage, lambda n: 1.0 + 0.2 * n, lambda w: 0.1 * w)  # each verified node costs a fifth
    assert dear_nodes.width == 1 and dear_nodes.speedup > 1  # a short chain
    assert search([0.9, 0.05], lambda n: 1.0 + 0.3 * n, lambda w: 0.1 * w).depth > dear_nodes.depth  # surer: longer
    # Drafting as dear as verifying, mostly right: overlapping them pays where the device can (a GPU's streams).
    both = search([0.95, 0.03], lambda n: 1.0, lambda w: 0.25, schedule="stage")
    assert both.speedup > search([0.95, 0.03], lambda n: 1.0, lambda w: 0.25).speedup
    # A stage run's drafting is hidden where its guess holds: shallower, wider trees than a serial run's.
    coverage, dear_drafts = [0.9, 0.05, 0.03, 0.01, 0.01, 0.01], (lambda w: 0.2 * (1 + 0.1 * w))  # noqa: E731
    serial, stage = (search(coverage, lambda n: 1.0, dear_drafts, schedule=s) for s in ("serial", "stage"))
    assert (serial.depth, serial.width) == (6, 2) and (stage.depth, stage.width) == (4, 3)


def test_a_stage_run_guesses_after_its_first_rank_path():
    """The tree drafted ahead follows each node's first child (the drafter's likeliest token), a path as long as
    the levels equal growth reached, fewer than its steps where later steps widen shallow levels: its hit is c_1 to
    that path's length + 1, not to the steps' + 1."""
    from speculant.trees.plan import first_ranks

    tree = expected_tree([0.5, 0.4], 3, 2)[0]  # steps: 0.5, 0.4 | 0.25, 0.2 (rank 0's) | 0.2, 0.16 (rank 1's)
    assert first_ranks(tree) == len(tree.first_child_path()) == max(tree.depths) == 2
    # A coverage whose rank 1 is likelier puts rank 1 first among each node's children (the first-child path is 2
    # long): the drafter's own first child, rank 0, is still the path it guesses after, the root's rank-0 child alone.
    assert first_ranks(expected_tree([0.3, 0.6], 2, 2)[0]) == 1


def test_rank_coverage_counts_where_the_targets_token_ranks_for_the_drafter():
    target = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 2.0]])  # wants 1, 0, 2
    drafter = torch.tensor([[0.0, 3.0, 1.0], [0.0, 2.0, 1.0], [2.0, 0.0, 1.0]])  # ranks them 1st, 3rd, 2nd
    assert rank_coverage(target, drafter, 3) == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert rank_coverage(target, target, 2) == [1.0, 0.0]


def test_each_context_gets_its_width():
    flat_cost = lambda n: 1.0  # noqa: E731
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01])
    spread = torch.tensor([0.4, 0.3, 0.2, 0.1])
    assert choose_width(peaked, (1, 2, 4), flat_cost, lambda w: 0.02 * w, 15, 16) == 1
    assert choose_width(spread, (1, 2, 4), flat_cost, lambda w: 0.02 * w, 15, 16) == 4
    assert choose_width(spread, (1, 2, 4), lambda n: float(n), lambda w: 0.02 * w, 15, 16) == 1  # nodes cost forwards
    assert choose_width(peaked, (1, 2, 4), flat_cost, lambda w: 0.02 * w, 15, 1, exact=True) == 4  # one level: free


def test_a_width_is_weighed_by_the_trees_of_its_own_steps():
    """A tree of d steps is valued by what its d x width nodes are expected to accept, not by every node at depth <= d
    of a deeper tree (a later step adds shallow nodes too): that had width 2 win below, where a chain of 2 steps is
    worth more, and differed from the brute force in about 1% of random contexts."""
    from speculant.trees.plan import drafting

    target_cost, draft_cost = (lambda n: 1.0 + 0.095 * n), (lambda w: 0.016 * (1 + 0.2 * w))  # noqa: E731
    assert choose_width(torch.tensor([0.481, 0.156, 0.146, 0.108]), (1, 2, 4), target_cost, draft_cost, 31, 4) == 1
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        probs = torch.rand(8, generator=generator).pow(3).softmax(0).sort(descending=True).values
        coverage = probs.tolist()
        goodput = {(w, d): (1 + sum(expected_tree(coverage, d, w)[1][1:])) /  # (a tree of d steps, grown alone)
                   (drafting(d, w, draft_cost) + target_cost(1 + d * w))
                   for w in (1, 2, 4) for d in range(1, max(min(4, 31 // w), 1) + 1)}
        best = max(goodput.values())
        assert choose_width(probs, (1, 2, 4), target_cost, draft_cost, 31, 4) == min(
            w for (w, _), value in goodput.items() if value == best)


@pytest.mark.parametrize("arch", [*ARCHS, "mistral"])
def test_tree_with_auto_width_is_lossless(arch):
    from speculant import generate

    target = tiny_model(arch, 8, 64, init_std=0.1)
    prompt = random_prompt(80, 64, 24)  # Mistral's window is 8: the generation crosses it
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
    for schedule in ("serial", "stage"):  # (a stage run's plan prices drafting behind verification)
        result = generate(target, prompt_ids=prompt, drafter=perturbed(target, 0.2, 8), method="tree", depth="auto",
                          width="auto", max_new_tokens=40, schedule=schedule)
        assert result.token_ids == expected
        assert result.stats.tree_widths and set(result.stats.tree_widths) <= set(PLAN_WIDTHS)


def test_the_summary_names_the_widths_drafted():
    """`width=auto` chooses each tree's width: the summary says the width the trees were drafted at, not the shape's
    (the execution plan's), where every tree took one other width."""
    from speculant.config import SamplingConfig
    from speculant.decoding.autoregressive import autoregressive
    from speculant.trees.decoder import tree_speculative
    from speculant.trees.drafter import TreeDrafter

    target = tiny_model("llama", 8, 64, init_std=0.1)
    prompt = random_prompt(81, 64, 12)
    drafter = TreeDrafter(perturbed(target, 0.2, 8), 2, chooser=lambda probs, depth, exact: 3)
    tokens, stats = run(tree_speculative(target, drafter, prompt, 3, 2, 20))
    assert tokens == list(autoregressive(target, prompt, 20, SamplingConfig(), None))
    assert set(stats.tree_widths) == {3} and stats.tree_shape[1] == 2 and "first level 3, " in stats.summary()


@pytest.mark.parametrize("arch", [*ARCHS, "mistral"])
def test_trees_of_changing_widths_stay_lossless(arch):
    """Each tree drafted at the width its chooser gives after its context (here: in turn 1, 3, 2, 8), verified
    and compacted exactly as trees of one width are."""
    from speculant.decoding.autoregressive import autoregressive
    from speculant.trees.decoder import tree_speculative
    from speculant.trees.drafter import TreeDrafter
    from speculant.config import SamplingConfig

    target = tiny_model(arch, 8, 64, init_std=0.1)
    prompt = random_prompt(81, 64, 12)
    expected = list(autoregressive(target, prompt, 40, SamplingConfig(), None))
    turns = iter([1, 3, 2, 8] * 40)
    drafter = TreeDrafter(perturbed(target, 0.2, 8), 2, chooser=lambda probs, depth, exact: next(turns))
    tokens, stats = run(tree_speculative(target, drafter, prompt, 3, 2, 40))
    assert tokens == expected
    assert set(stats.tree_widths) == {1, 3, 2, 8} and "(1-8)" in stats.summary()


def test_trees_of_per_context_width_keep_the_sampling_distribution():
    from test_sampling import assert_follows_target, sampling_pair

    target, drafter, prompt = sampling_pair()
    assert_follows_target(target, prompt, method="tree", drafter=drafter, depth=2, width="auto")


def test_sequoia_shape_is_the_best_tree_of_its_size_and_nway_is_chains():
    from speculant.trees.baselines import nway_shape, sequoia_shape
    from speculant.trees.prune import best_subtrees
    from speculant.trees.tree import TokenTree

    coverage = [0.5, 0.25, 0.1]
    ranks, parents, values = [0], [-1], [1.0]  # the complete tree of depth 4 over the three ranks
    level = [0]
    for _ in range(4):
        nxt = []
        for parent in level:
            for r, c in enumerate(coverage):
                ranks.append(r), parents.append(parent), values.append(values[parent] * c)
                nxt.append(len(ranks) - 1)
        level = nxt
    full = TokenTree(tuple(ranks), tuple(parents))
    for nodes in (1, 4, 7):
        shape = sequoia_shape(coverage, nodes, 4)
        value = [1.0]
        for i in range(1, len(shape)):
            value.append(value[shape.parents[i]] * coverage[shape.tokens[i]])
        assert len(shape) == nodes + 1 and list(shape.depths) == sorted(shape.depths)  # drafted level by level
        best = best_subtrees(full, [0.0, *values[1:]], nodes + 1)[nodes + 1][0]
        assert sum(value[1:]) == pytest.approx(best)
    assert max(sequoia_shape([0.9, 0.05], 8, 3).depths) == 3  # (within its depth: 8 nodes, not a chain of 8)
    two = nway_shape(2, 3)
    assert sorted(two.depths) == list(two.depths) == [0, 1, 1, 2, 2, 3, 3]
    assert [two.tokens[c] for c in two.child_lists[0]] == [0, 1]
    assert len(set(range(len(two))) - set(two.parents)) == 2  # (two leaves)


@pytest.mark.parametrize("arch", [*ARCHS, "mistral"])
@pytest.mark.parametrize("shape", ["sequoia", "nway"])
def test_sequoia_and_nway_trees_are_lossless(arch, shape):
    from speculant import generate

    target = tiny_model(arch, 8, 64, init_std=0.1)
    prompt = random_prompt(82, 64, 24)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=40).token_ids
    result = generate(target, prompt_ids=prompt, drafter=perturbed(target, 0.2, 8), method="tree", depth=3,
                      width=2, shape=shape, max_new_tokens=40)
    assert result.token_ids == expected
    widths = result.stats.tree_widths  # the root's children: 2 for N-way, what the coverage favours for Sequoia
    assert (set(widths) == {2} and max(result.stats.draft_lengths) == 3) if shape == "nway" else widths


def test_nway_trees_keep_the_sampling_distribution():
    from test_sampling import assert_follows_target, sampling_pair

    target, drafter, prompt = sampling_pair()
    assert_follows_target(target, prompt, method="tree", drafter=drafter, depth=2, width=2, shape="nway")


def test_a_static_shape_needs_its_size():
    from speculant import generate
    from speculant.errors import ConfigError

    target = tiny_model("llama", 8, 64)
    with pytest.raises(ConfigError, match="shape sequoia needs a depth and a width"):
        generate(target, prompt_ids=[1, 2], drafter=target, method="tree", depth="auto", shape="sequoia")


def test_auto_drafts_its_trees_at_the_plan_s_width(monkeypatch):
    """`auto:tree_widths=auto`: auto's tree candidate for a model drafter takes the execution plan's width for the
    pair (none where the plan drafts chains); the output stays `ar`'s either way."""
    from speculant import Session, generate
    from speculant.trees import shape

    target = tiny_model("llama", 8, 64, init_std=0.1)
    invent(monkeypatch, costs(target))  # a flat T(W) and a cheap drafter: trees can pay
    drafter = perturbed(target, 0.2, 8)
    drafter.name = "near"
    prompt = random_prompt(81, 64, 24)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
    session = Session(target)
    result = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter, "maxgram"], tree_widths="auto",
                      max_new_tokens=30, session=session)  # the plan of the measured coverage and costs
    assert result.token_ids == expected
    for width, trees in ((1, set()), (3, {"near tree3"})):
        monkeypatch.setattr(shape, "plan_width", lambda *args, width=width, schedule="serial": width)
        session = Session(target)
        result = generate(target, prompt_ids=prompt, method="auto", drafters=[drafter, "maxgram"], tree_widths="auto",
                          max_new_tokens=30, session=session)
        assert result.token_ids == expected
        assert {name for name in session.acceptance if "tree" in name} == trees


@pytest.mark.parametrize("options", [dict(depth="auto", width=2), dict(depth=3, width="auto")])
def test_auto_sizes_after_a_prompt_near_the_end_of_the_cache(options):
    """Measuring T(W) for `auto` sizes runs forwards of up to 32 tokens after the prompt: it measures after the prompt's
    last positions where those would run past the target's cache (a 90-token prompt in 96 positions crashed), and
    beyond the widest measured width the cost grows along the last segment (held flat, nodes past 32 were free)."""
    from speculant import Session, generate
    from speculant.models.backends.static import StaticCausalLM, StaticWeights
    from speculant.trees.shape import tree_shape
    from test_static import transformer

    def static(seed, noise=0.0):
        return StaticCausalLM(StaticWeights(transformer("llama", seed, noise=noise)), name=f"s{seed}{noise}", span=96)

    target, drafter = static(0), static(0, 0.05)
    prompt = random_prompt(3, 64, 90)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=5).token_ids
    assert generate(target, prompt_ids=prompt, method="tree", drafter=drafter, max_new_tokens=5,
                    **options).token_ids == expected
    cost = tree_shape(target, drafter, prompt, "auto", 2, None, None, Session(target)).cost
    assert cost(64) > cost(32)
