"""The README's examples run as written and print what the README says they print: the Python API and `forward`
under jit, the engine example, and the client examples against `dllm-jax serve` started as the README says."""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import fixtures
import httpx

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)


def block(marker: str, blocks=PYTHON_BLOCKS) -> str:
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"one README block with {marker!r}"
    return found[0]


def run(code: str, namespace: dict | None = None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace if namespace is not None else {})
    return out.getvalue()


def test_python_api_and_forward_examples():
    ns: dict = {}
    printed = run(block("out = generate(model, prompts, config)"), ns)
    assert printed.strip() == "['1 0 4', '8 7 6'] 8"  # the answers and NFE the comment promises
    run(block("from dllm_jax import KVCache, forward"), ns)
    logits = ns["logits"]
    assert logits.shape == (1, len(ns["prompts"][0]), ns["model"].config.vocab_size)
    assert ns["cache"].k[0].shape[:2] == (1, len(ns["prompts"][0]))


def test_engine_example_prints_what_the_readme_says():
    printed = run(block("engine = Engine(model, EngineConfig(max_batch=6, max_model_len=128))")).strip().splitlines()
    said = re.search(r"It prints `(none: [^`]+)` and `(anchors: [^`]+)`", README)
    assert printed == [said.group(1), said.group(2)]


def test_server_examples_against_dllm_jax_serve():
    command = block("the bundled model; --model DIR", BASH_BLOCKS).split("#")[0].split()
    assert command == [".venv/bin/dllm-jax", "serve"]
    proc, url = fixtures.start_server()  # the README's command on a free port, the run's compile cache
    try:
        client = block("from openai import OpenAI").replace("http://127.0.0.1:8000", url)
        lines = run(client).strip().splitlines()
        assert lines[:3] == ["8 9 5 -> 1 0 4", "1 2 3 -> 8 7 6", "0 0 7 -> 9 9 2"]  # the comment's answers
        assert len(lines) == 4 and lines[3] == "5 5 5"  # the streamed answer the comment promises
        curl = shlex.split(block("curl -s", BASH_BLOCKS).replace("\\\n", " "))
        target, body = curl[2], json.loads(curl[curl.index("-d") + 1])
        reply = httpx.post(target.replace("http://127.0.0.1:8000", url), json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "7 2 8"
        assert "prints a `chat.completion` whose message is `7 2 8`" in README
    finally:
        proc.terminate()
        proc.wait(30)
