"""The playground page (GET /) in a real browser: headless Chromium (Debian's package; `.ci/run` installs it) driven
by Playwright, against a real `dllm-jax serve` on 127.0.0.1 with the bundled model."""

import json
import shutil
import time

import fixtures
import httpx
import numpy as np
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# --block-lengths 2: the bundled model's answers are 3 tokens, so blocks of 2 show an answer over several blocks (one
# block length: each one more is a set of programs to warm up)
# --audit-fraction 1: the page's request is audited, and the page shows the audit's figures
# --shallow-depths 2: BiCache is offered, at depth 2 or "auto"
FLAGS = ("--max-batch", "1", "--max-model-len", "128", "--block-lengths", "2", "--audit-fraction", "1")
FLAGS += ("--shallow-depths", "2")

# each block row: its index, whether its replay ended, and per token (commit step, shown yet)
READ_BLOCKS = """() => [...document.querySelectorAll('#answer .block-row')].map((row) => ({
    block: Number(row.dataset.block), revealed: row.dataset.revealed === 'true',
    tokens: [...row.querySelectorAll('.tok')].map((t) => [Number(t.dataset.step), !t.classList.contains('masked'),
                                                          t.dataset.text]),
}))"""


@pytest.fixture(scope="module")
def served():
    proc, url = fixtures.start_server(*FLAGS)
    lines = fixtures.drain_stderr(proc)
    try:
        deadline = time.time() + 300
        while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            assert proc.poll() is None and time.time() < deadline, "".join(lines)[-2000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_the_page_replays_each_block_in_commit_order_and_marks_the_anchors(served, tmp_path, request):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 820})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{served}/")
        assert page.text_content("#model") == "dllm-jax-demo"
        page.wait_for_function("document.getElementById('ready').textContent === 'ready'", timeout=10_000)
        # the bundled model's example is filled in, with ACache chosen; blocks of 2, 2 steps each, a slow replay
        assert "rule examples" in page.input_value("#affix") and page.input_value("#technique") == "anchors"
        # BiCache: its depth picker (the served depth, or auto) shows only for it and reaches the request
        assert page.is_hidden("#depth-box")
        page.select_option("#technique", "shallow")
        assert page.is_visible("#depth-box") and page.is_hidden("#ratio-box")
        assert page.eval_on_selector_all("#depth option", "os => os.map((o) => o.value)") == ["2", "auto"]
        page.select_option("#depth", "auto")
        shallow = json.loads(page.evaluate("JSON.stringify(body())"))
        assert (shallow["affix_technique"], shallow["shallow_depth"]) == ("shallow", "auto")
        assert "anchor_ratio" not in shallow
        page.select_option("#technique", "anchors")
        page.select_option("#block-length", "2")
        page.fill("#steps", "2")
        page.select_option("#replay", "150")
        sent = page.evaluate("JSON.stringify(body())")
        page.click("#go")
        seen, deadline = [], time.time() + 60
        while page.get_attribute("#status", "data-state") not in ("done", "error"):
            seen.append(page.evaluate(READ_BLOCKS))
            assert time.time() < deadline, "the page did not finish"
            time.sleep(0.02)
        assert page.get_attribute("#status", "data-state") == "done", page.text_content("#status")
        final = page.evaluate(READ_BLOCKS)
        # the audit's row for this request's affix and setting, once its exact twin ran (the page polls every 3 s)
        page.wait_for_function("document.querySelectorAll('#audit tr').length > 0", timeout=20_000)
        audit_row = page.text_content("#audit tr")
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        text = page.text_content("#text")
        anchors = page.locator("#prompt .tok.anchor").count()
        affix = page.locator("#prompt .tok.affix").count()
        counters = page.locator("#counters tr").count()
        browser.close()
    assert not errors, errors

    # what the server answers to the page's own request (greedy: the same blocks)
    reply = httpx.post(f"{served}/v1/chat/completions", json={**json.loads(sent), "stream": False}, timeout=60).json()
    trace = reply["dllm"]
    assert text == reply["choices"][0]["message"]["content"] and text.strip()
    assert len(final) == len(trace["blocks"]) >= 2
    for row, block in zip(final, trace["blocks"]):
        assert row["revealed"] and [t[2] for t in row["tokens"]] == block["tokens"]
        assert [t[0] for t in row["tokens"]] == block["commit_steps"] and all(t[1] for t in row["tokens"])
    # block by block: each block appeared while the later ones were not there yet, and each block's tokens
    # appeared in the order of their steps (a token shown only once every earlier-committed one is)
    assert {sum(r["revealed"] for r in rows) for rows in seen} >= set(range(len(final)))
    partial = 0
    for rows in seen:
        for r in rows:
            shown = [step for step, on, _ in r["tokens"] if on]
            hidden = [step for step, on, _ in r["tokens"] if not on]
            assert not shown or not hidden or max(shown) < min(hidden), r
            partial += bool(shown and hidden)
    assert partial, "no block was ever seen half written"
    # the shared affix is marked in the prompt, and ACache's anchors in it
    assert affix == trace["affix_span"][1] - trace["affix_span"][0] > 0
    assert anchors == len(trace["anchors"]) > 0
    assert counters >= 8  # the server's counters, read from /metrics
    audit = httpx.get(f"{served}/v1/audit", timeout=10).json()["groups"][0]
    assert audit["setting"] == "anchors:0.2" and audit_row.startswith("anchors:0.2")
    assert f"{audit['exact_matches']}/{audit['requests']}" in audit_row
    # the screenshot shows the page: far from one flat colour
    import matplotlib.image

    pixels = matplotlib.image.imread(tmp_path / "playground.png")[..., :3]
    background = np.median(pixels.reshape(-1, 3), axis=0)
    assert pixels.shape[0] >= 600 and (np.abs(pixels - background).max(-1) > 0.1).mean() > 0.05
    assert len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50
    keep = request.config.getoption("--playground-screenshot")
    if keep:  # the README's picture: `pytest tests/test_playground.py --playground-screenshot docs/playground.png`
        shutil.copy(tmp_path / "playground.png", keep)
