"""`dllm-jax serve` as a process on the bundled model: a soak of concurrent clients gets every answer once and
right; SIGTERM drains what runs, and a second signal or the drain timeout cuts it with every open request answered;
the server answers /health at once and /ready once warmed up (requests sent meanwhile are answered), compiles
nothing after its warm-up, and restarts faster from its compilation cache. (In-process server tests:
test_server.py.)"""

import asyncio
import collections
import importlib.util
import json
import re
import signal
import threading
import time
from pathlib import Path

import fixtures
import httpx
import pytest

import dllm_jax
from dllm_jax import GenerationConfig
from dllm_jax.cli import DEMO_PROMPT

NAME = "dllm-jax-demo"


@pytest.fixture(scope="module")
def model():
    return dllm_jax.load(dtype="float32")  # the server processes below run float32 too


def test_soak(model, request):
    """bench/soak.py's driver: N requests (120 by default, --soak-requests for a longer one) from 64 concurrent
    clients, mixed lengths, half sharing one document (ACache), some clients leaving mid-stream, some deadlines
    too short to meet, a burst of 96 at once past the pool: 0 lost, 0 duplicated, every answer equal to its solo
    `generate` and to its replay through the server, the deadlines 504s, the pool idle at the end. Bounded in time."""
    n = request.config.getoption("--soak-requests")
    soak = _bench("soak")
    # a server process of its own (an in-process one would share the GIL with the 64 clients); a 16 MiB pool holds
    # about 16 of these requests: the burst of 96 waits for pages
    flags = ["--dtype", "float32", "--max-batch", "16", "--max-model-len", "128", "--kv-budget-gib", "0.015625"]
    proc, url = fixtures.start_server(*flags, optimized=True)
    stderr = fixtures.drain_stderr(proc)
    job_list = soak.jobs(n, disconnect=0.05, deadline=0.05, lengths=(4,))  # one block each: the suite's time
    keys = sorted({json.dumps(j["body"], sort_keys=True) for j in job_list if j["kind"] == "answer"})
    keys = keys[:: max(1, len(keys) // 8)]  # about 8 distinct requests replayed: their answers are checked
    try:
        t0 = time.time()
        _wait_ready(url, t0 + 300)
        replayed = asyncio.run(soak.replay(url, keys, NAME))
        rep = asyncio.run(asyncio.wait_for(soak.drive(url, job_list, NAME, 64, 96, progress=False), 600))
        deadline = time.time() + 10
        while _metrics(url)["dllm_jax_kv_pages_used"] and time.time() < deadline:
            time.sleep(0.05)
        out = soak.summary(rep, replayed, _metrics(url)["dllm_jax_kv_pages_used"], [])
        kinds = collections.Counter(j["kind"] for j in job_list)
        assert out["lost"] == 0 and out["duplicated"] == 0 and out["wrong"] == 0, out
        assert sum(k in replayed for k, _ in rep.answers) >= n // 10  # the answers checked against a replay
        assert out["answered"] == kinds["answer"] and out["refused"] == {"504": kinds["deadline"]}, out
        assert out["disconnected"] == kinds["disconnect"] > 0 and out["kv_pages_used_end"] == 0
        doc_ids = model.tokenizer.encode(soak.DOC)
        # one request sharing the document: its replay equals solo generate (the engine tests cover the rest)
        for key in [k for k in keys if "affix" in json.loads(k)][:1]:
            body = json.loads(key)
            shared = "affix" in body
            gc = GenerationConfig.from_options(
                gen_length=-(-body["max_tokens"] // 8) * 8,
                block_length=8,
                steps=-(-body["max_tokens"] // 8) * 8,
                cache="dual",
                **(dict(affix="anchors", anchor_ratio=0.5) if shared else {}),
            )
            ids = model.tokenizer.encode(body["prompt"])
            want = fixtures.solo_text(model, ids, gc, doc_ids if shared else None, max_tokens=body["max_tokens"])
            assert replayed[key] == want, (body, replayed[key], want)
        m = _metrics(url)
        assert m["dllm_jax_requests_waiting"] == 0 and m["dllm_jax_requests_running"] == 0
        assert time.time() - t0 < 600 and "Traceback" not in "".join(stderr)
    finally:
        proc.terminate()
        proc.wait(30)


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sigterm_finishes_what_runs_then_exits(tmp_path):
    # one request decoded at a time and three sent: the drain outlasts the checks below on a loaded machine too
    proc, url = fixtures.start_server("--dtype", "float32", "--max-batch", "1", "--max-model-len", "128")
    stderr = fixtures.drain_stderr(proc)
    try:
        _wait_ready(url, time.time() + 300)
        body = {"model": NAME, "prompt": DEMO_PROMPT, "max_tokens": 64, "block_length": 8, "steps": 64, "stream": True}
        streams = [[] for _ in range(3)]

        def stream(got):
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                got.extend(line for line in r.iter_lines() if line.startswith("data:"))

        threads = [threading.Thread(target=stream, args=(got,)) for got in streams]
        for t in threads:
            t.start()
        deadline = time.time() + 60

        def in_engine() -> float:  # running + waiting, read from /metrics
            text = httpx.get(f"{url}/metrics", timeout=10).text
            found = re.findall(r"^dllm_jax_requests_(?:running|waiting) (\S+)$", text, re.M)
            return sum(map(float, found))

        # all three inside the engine (one decoding, two queued) before the signal: a request still connecting
        # when the drain ends would find the server gone, which is right but not what this test checks
        while (in_engine() < 3 or not any(streams)) and time.time() < deadline:
            time.sleep(0.05)
        assert in_engine() == 3
        proc.send_signal(signal.SIGTERM)
        while httpx.get(f"{url}/ready", timeout=10).json()["status"] != "draining":  # the signal handled
            assert time.time() < deadline
            time.sleep(0.05)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # alive while it drains
        r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": DEMO_PROMPT}, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["code"] is not None or r.json()["error"]["type"]
        for t in threads:
            t.join(120)
        for got in streams:  # the running request and the queued ones finished
            assert got[-1] == "data: [DONE]"
            assert json.loads(got[-2][5:])["choices"][0]["finish_reason"] in ("stop", "length")
        assert proc.wait(60) == 0, "".join(stderr)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("cut", ["second signal", "drain timeout"])
def test_a_cut_drain_answers_every_open_request_and_exits_without_tracebacks(cut):
    """SIGTERM drains (saying what is left); a second one, or --drain-timeout running out, answers every open
    request at once (a plain one a 503 in OpenAI's shape, a stream the error event then [DONE]) and exits within
    seconds (128 + SIGTERM, or 3), without a traceback."""
    flags = ["--dtype", "float32", "--max-batch", "1", "--max-model-len", "512"]
    proc, url = fixtures.start_server(*flags, *(["--drain-timeout", "2"] if cut == "drain timeout" else []))
    stderr = fixtures.drain_stderr(proc)
    got: dict = {}
    try:
        _wait_ready(url, time.time() + 300)
        body = {"model": NAME, "prompt": DEMO_PROMPT, "max_tokens": 400, "block_length": 8, "steps": 400}

        def plain():
            got["plain"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                got["stream_status"] = r.status_code
                got["stream"] = list(r.iter_lines())

        clients = [threading.Thread(target=f, daemon=True) for f in (plain, stream)]
        for c in clients:
            c.start()
        deadline = time.time() + 60
        while _metrics(url).get("dllm_jax_requests_running", 0) + _metrics(url).get("dllm_jax_requests_waiting", 0) < 2:
            assert time.time() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        while httpx.get(f"{url}/ready", timeout=10).json()["status"] != "draining":
            assert time.time() < deadline
            time.sleep(0.05)
        t0 = time.time()
        if cut == "second signal":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        assert code == (128 + signal.SIGTERM if cut == "second signal" else 3) and time.time() - t0 < 10
        for c in clients:
            c.join(10)
        assert got["plain"].status_code == 503
        assert got["plain"].json()["error"]["type"] == "service_unavailable"
        if got["stream_status"] == 200:  # its stream had begun: the error event, then [DONE]
            events = [ln[len("data: ") :] for ln in got["stream"] if ln.startswith("data: ")]
            assert json.loads(events[-2])["error"]["type"] == "service_unavailable" and events[-1] == "[DONE]"
        else:  # refused before it began (still waiting to be taken in): a plain 503
            assert got["stream_status"] == 503
            assert json.loads("".join(got["stream"]))["error"]["type"] == "service_unavailable"
        log = "".join(stderr)
        assert "draining: 1 running" in log and "Traceback" not in log
        assert ("second signal: exiting now" if cut == "second signal" else "the drain took over 2 s") in log
    finally:
        if proc.poll() is None:
            proc.kill()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(dllm_jax_\w+) (\S+)$", text, re.M)}


def _wait_ready(url: str, deadline: float) -> None:
    """Poll /ready until 200; /health answers 200 all along (alive while warming)."""
    while True:
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        ready = httpx.get(f"{url}/ready", timeout=10)
        if ready.status_code == 200:
            assert ready.json() == {"status": "ready"}
            return
        assert ready.status_code == 503 and ready.json()["status"] == "warming", ready.text
        assert time.time() < deadline, "no warm-up end in time"
        time.sleep(0.2)


QUESTION = "input : 8 9 5 what does the rule give ?"  # 11 tokens: the longest answer below fits max_model_len 64


def test_serve_warms_up_serves_what_came_meanwhile_and_restarts_from_its_compile_cache(tmp_path):
    """`dllm-jax serve` (max_batch 2, max_model_len 64: a short warm-up) answers /health at once and /ready once
    warmed; a request sent during the warm-up is answered; varied requests compile nothing after it, nor do the
    audit's shadow requests (--audit-fraction 1: the shared-affix request is decoded again exactly); a second
    start on the same --compile-cache loads every program (compiles none) and warms up faster."""
    flags = ("--dtype", "float32", "--max-batch", "2", "--max-model-len", "64", "--compile-cache", str(tmp_path))
    flags += ("--audit-fraction", "1")
    deadline = time.time() + 300
    proc, url = fixtures.start_server(*flags)
    stderr = fixtures.drain_stderr(proc)
    try:
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        warming = httpx.get(f"{url}/ready", timeout=10)
        assert warming.status_code == 503 and warming.json()["status"] == "warming", warming.text
        assert warming.json()["programs"] > 0
        early: list = []
        body = {"model": NAME, "prompt": QUESTION, "max_tokens": 8}
        sent = threading.Thread(
            target=lambda: early.append(httpx.post(f"{url}/v1/completions", json=body, timeout=300))
        )
        sent.start()
        _wait_ready(url, deadline)
        sent.join(300)
        assert early[0].status_code == 200, early[0].text
        later = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert early[0].json()["choices"][0]["text"] == later["choices"][0]["text"]  # greedy: the same answer
        varied = [
            {"max_tokens": 3},
            {"max_tokens": 13, "steps": 4},
            {"max_tokens": 16, "steps": 16, "temperature": 0.7, "seed": 1},
            {"max_tokens": 5, "temperature": 1.0, "threshold": 0.9},
        ]

        async def all_at_once():  # two at a time fill the batch: every batch size runs
            async with httpx.AsyncClient(timeout=120) as client:
                bodies = [
                    {"model": NAME, "prompt": v["affix"]["text"] + " " + QUESTION if "affix" in v else QUESTION, **v}
                    for v in varied
                ]
                return await asyncio.gather(*[client.post(f"{url}/v1/completions", json=b) for b in bodies])

        rule = "rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ;"
        varied.append({"max_tokens": 8, "affix_technique": "anchors", "affix": {"text": rule}})
        replies = asyncio.run(all_at_once())
        assert [r.status_code for r in replies] == [200] * len(varied), [r.text for r in replies]
        assert all(r.json()["usage"]["completion_tokens"] <= v["max_tokens"] for r, v in zip(replies, varied))
        while (audit := httpx.get(f"{url}/v1/audit", timeout=10).json())["shadows_finished"] < 1:
            assert time.time() < deadline, audit
            time.sleep(0.1)
        m = _metrics(url)
        assert m["dllm_jax_compiles_after_warmup_total"] == 0 and m["dllm_jax_compile_seconds_after_warmup_total"] == 0
        assert m["dllm_jax_programs"] == warming.json()["programs"] and m["dllm_jax_ready"] == 1
        assert m["dllm_jax_compiles_total"] > 0 and m["dllm_jax_compile_seconds_total"] > 0
        first = m["dllm_jax_warmup_seconds"]
        assert first > 0 and any(f"warmed up {int(m['dllm_jax_programs'])} programs in" in line for line in stderr)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        # the same settings again: the programs come from the cache
        proc, url = fixtures.start_server(*flags)
        stderr = fixtures.drain_stderr(proc)
        _wait_ready(url, deadline)
        again = _metrics(url)
        assert 0 < again["dllm_jax_warmup_seconds"] < first, (again["dllm_jax_warmup_seconds"], first)
        assert again["dllm_jax_compiles_total"] == 0  # every program loaded, none compiled
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"] == later["choices"]
        assert _metrics(url)["dllm_jax_compiles_after_warmup_total"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
