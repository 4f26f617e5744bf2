"""The playground at / in a real headless browser (Chromium driven by Playwright): a chat round-trip renders the
reply's tokens with their provenance classes, which come only from the stream's `speculant` chunks; and the
stream carries them (the test fails without them). Skipped locally without Playwright or Chromium; required in
CI."""

import json
import os
import shutil

import pytest
from test_serve import engine_for, serving

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed")
    executable = next((path for path in map(shutil.which, CHROMIUM) if path), None)
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable)
        except Exception as error:  # noqa: BLE001 - no browser here
            if os.environ.get("CI"):
                raise
            pytest.skip(f"no Chromium: {error}")
        yield browser
        browser.close()


def test_a_chat_round_trip_renders_tokens_with_their_provenance(browser):
    """A tiny model served with `sd` (a perturbed copy drafting): the reply's tokens appear as spans of the three
    classes, at least one an accepted draft, spelling the same text the API returns; the stats show a rate and an
    acceptance, and the position plot has bars."""
    engine = engine_for("sd", k=3)
    with serving(engine) as url:
        import openai

        expected = openai.OpenAI(base_url=url, api_key="x").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=40, temperature=0)
        page = browser.new_page()
        page.goto(url.removesuffix("/v1") + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
        page.fill("#max-tokens", "40")
        page.fill("#message", "hello there")
        page.press("#message", "Enter")
        page.wait_for_function("!document.getElementById('send').disabled && "
                               "document.querySelectorAll('.turn.assistant .tok').length > 0")
        assert page.text_content("#error") == ""
        kinds = page.eval_on_selector_all(".turn.assistant .tok", "spans => spans.map(s => s.classList[1])")
        text = page.eval_on_selector_all(".turn.assistant .tok", "spans => spans.map(s => s.textContent).join('')")
        assert set(kinds) <= {"accepted", "corrected", "target"} and "accepted" in kinds, kinds
        assert text == expected.choices[0].message.content
        assert page.text_content("#acceptance").endswith("%") and page.text_content("#rate") != "-"
        assert page.locator("#positions rect").count() >= 1
    engine.close()


def test_the_stream_carries_provenance_only_when_asked():
    """The extension chunks (no choices, a `speculant` field) come with stream_options.include_provenance and
    account for every token of the reply; an ordinary stream has none."""
    import httpx

    engine = engine_for("sd", k=3)
    with serving(engine) as url:
        request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        plain = httpx.post(f"{url}/chat/completions", json=request, timeout=60).text
        asked = httpx.post(f"{url}/chat/completions", timeout=60, json={
            **request, "stream_options": {"include_usage": True, "include_provenance": True}}).text
    engine.close()
    events = lambda text: [json.loads(line[6:]) for line in text.splitlines()  # noqa: E731
                           if line.startswith("data: {")]
    assert not any("speculant" in event for event in events(plain))
    steps = [event["speculant"] for event in events(asked) if "speculant" in event]
    usage = next(event["usage"] for event in events(asked) if event.get("usage"))
    assert sum(len(step["tokens"]) for step in steps) == usage["completion_tokens"]
    assert sum(step["accepted"] for step in steps) == usage["speculative"]["accepted_tokens"] > 0
    assert all(step["drafter"] for step in steps if step["drafted"])


def test_the_texts_of_a_stream_s_provenance_tokens_join_to_its_reply_under_stop_strings():
    """Each provenance token's text is what it made final in the reply: cut at a stop string, and a tail held back
    as it might begin one given with the last token, so that the texts join to the reply's content."""
    import httpx

    engine = engine_for("sd", k=3)
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 0,
               "stream": True, "stream_options": {"include_provenance": True}}

    def streamed(stop):
        events = [json.loads(line[6:]) for line in httpx.post(f"{url}/chat/completions", timeout=60, json={
            **request, "stop": stop}).text.splitlines() if line.startswith("data: {")]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        return content, "".join(t["text"] for e in events if "speculant" in e for t in e["speculant"]["tokens"])

    with serving(engine) as url:
        whole, _ = streamed(None)
        assert len(whole) > 8
        cut, tail = streamed(whole[4:6]), streamed(whole[-1] + "\x01\x02")  # (a stop the reply begins at its end)
    engine.close()
    assert cut[0] == cut[1] == whole[:whole.index(whole[4:6])]
    assert tail[0] == tail[1] == whole


def test_provenance_follows_the_verified_draft_chains_and_trees():
    from speculant.models.base import Call
    from speculant.serve.engine import provenance
    from speculant.trees.tree import TokenTree

    chain = Call([5, 1, 2, 3])  # the last committed token, then three drafts
    assert provenance(chain, [1, 2, 3, 4]) == ["accepted"] * 3 + ["target"]
    assert provenance(chain, [1, 9]) == ["accepted", "corrected"]
    assert provenance(chain, [1, 2]) == ["accepted"] * 2  # a step cut short by the end of the reply
    assert provenance(None, [7]) == ["target"]
    tree = TokenTree((5, 1, 6, 2, 8), (-1, 0, 0, 1, 2))  # two branches: 1 -> 2 and 6 -> 8
    call = Call(list(tree.tokens), tree=tree)
    assert provenance(call, [6, 8, 4]) == ["accepted", "accepted", "target"]
    assert provenance(call, [1, 3]) == ["accepted", "corrected"]


def test_a_drafter_that_always_agrees_streams_accepted_drafts_then_the_targets_token():
    """`sd` drafting with the target's own weights: every step but a last one cut short is k accepted drafts and
    the target's token after them."""
    import httpx

    from test_serve import byte_model

    target = byte_model()
    engine = engine_for("sd", target=target, drafter=target, k=3)
    with serving(engine) as url:
        text = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0,
            "stream": True, "stream_options": {"include_provenance": True}}).text
    engine.close()
    steps = [json.loads(line[6:])["speculant"] for line in text.splitlines()
             if line.startswith("data: {") and '"speculant"' in line]
    kinds = [[token["kind"] for token in step["tokens"]] for step in steps]
    assert kinds[0] == ["target"] and len(steps) >= 3  # the prefill's token
    for step, kind in zip(steps[1:-1], kinds[1:-1]):
        assert kind == ["accepted"] * step["drafted"] + ["target"] and step["accepted"] == step["drafted"] > 0


def test_each_reply_s_panel_and_the_chat_show_only_what_the_model_sees(browser):
    """Each send empties "This reply": an `sd` reply names its drafter (the model's name), an `ar` reply after it
    shows no drafter and no acceptance, and a refused request no stats at all. The refused turn leaves the page
    (its text back in the box) and the next request sends only the turns shown."""
    engine = engine_for("sd", k=3)
    with serving(engine) as url:
        page = browser.new_page()
        page.goto(url.removesuffix("/v1") + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
        page.fill("#max-tokens", "20")

        def ask(text):
            page.fill("#message", text)
            with page.expect_request("**/v1/chat/completions") as sent:
                page.press("#message", "Enter")
            page.wait_for_function("!document.getElementById('send').disabled")
            shown = {name: page.text_content(f"#{name}") for name in ("rate", "acceptance", "mean", "drafter")}
            return json.loads(sent.value.post_data), shown

        _, shown = ask("hello")
        assert shown["drafter"] == engine.options.drafter.name and shown["acceptance"].endswith("%")
        page.select_option("#method", "ar")
        _, shown = ask("again")
        assert shown["drafter"] == "-" and shown["acceptance"] == "-"
        page.select_option("#method", "")
        page.fill("#max-tokens", "100000")  # more than the model's positions: refused
        _, shown = ask("too long")
        assert page.text_content("#error") and set(shown.values()) == {"-"}, shown
        assert page.eval_on_selector_all(".turn.user", "turns => turns.map(t => t.lastChild.textContent)") == [
            "hello", "again"] and page.locator(".turn.assistant").count() == 2
        assert page.input_value("#message") == "too long"
        page.fill("#max-tokens", "20")
        request, _ = ask("last")
        assert [m["content"] for m in request["messages"] if m["role"] == "user"] == ["hello", "again", "last"]
    engine.close()
