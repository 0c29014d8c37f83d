"""`dllm-jax serve --replicas 2`: two engine replicas on Ray Serve behind one ingress, on the CPU with the bundled
model. Requests that share an affix meet on one replica, different affixes spread over both, a registration
reaches every replica, streams stream, and SIGTERM stops the cluster."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import fixtures
import httpx
import pytest

from dllm_jax.cli import DEMO_PROMPT

pytest.importorskip("ray.serve", reason="the cluster runs on Ray Serve (pip install 'dllm-jax[cluster]')")

NAME = "dllm-jax-demo"
RULES = DEMO_PROMPT.split(" input :")[0]  # the digit rule's five examples: a shared affix


def _wait_ready(url: str, seconds: float) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=10)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the cluster was not ready within {seconds} s")


def _chat(url: str, content: str, affix=None, **extra) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], **extra}
    if affix is not None:
        body["affix"] = affix
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_two_replicas_route_by_affix_broadcast_registrations_and_stop_on_sigterm():
    proc, url = fixtures.start_server(
        "--replicas", "2", "--dtype", "float32", "--max-batch", "2", "--max-model-len", "128", "--spill-queue", "64"
    )
    stderr = fixtures.drain_stderr(proc)
    try:
        ready = _wait_ready(url, 240)
        assert ready["status"] == "ready" and [r["status"] for r in ready["replicas"]] == ["ready", "ready"]

        # the README's question through the cluster: the bundled model's answer
        r = _chat(url, DEMO_PROMPT, affix={"text": RULES})
        assert r.json()["choices"][0]["message"]["content"] == "1 0 4"
        home = r.headers["x-dllm-replica"]
        # every request with that affix meets on the replica that stores it
        for digits in ("1 2 3", "4 5 6", "7 8 9"):
            again = _chat(url, f"{RULES} input : {digits} what does the rule give ?", affix={"text": RULES})
            assert again.headers["x-dllm-replica"] == home
        # different affixes spread: eight keys on two replicas by rendezvous hashing, each always on its own one
        owners = {}
        for i in range(8):
            affix = f"rule examples : {i} 4 0 -> {9 - i} 5 9 ; 3 6 {i} -> 6 3 {9 - i} ;"
            first = _chat(url, f"{affix} input : 1 2 3 what does the rule give ?", affix={"text": affix}, max_tokens=8)
            second = _chat(url, f"{affix} input : 4 5 6 what does the rule give ?", affix={"text": affix}, max_tokens=8)
            assert first.headers["x-dllm-replica"] == second.headers["x-dllm-replica"]
            owners[i] = first.headers["x-dllm-replica"]
        assert len(set(owners.values())) == 2, owners

        # a registration reaches both replicas; the id routes to one, which serves it; a deletion reaches both
        reg = httpx.post(f"{url}/v1/affixes", json={"text": RULES}, timeout=60)
        assert reg.status_code == 200, reg.text
        assert len(set(reg.headers["x-dllm-replicas"].split(","))) == 2
        aid = reg.json()["id"]
        assert _chat(url, DEMO_PROMPT, affix={"id": aid}).json()["choices"][0]["message"]["content"] == "1 0 4"
        gone = httpx.delete(f"{url}/v1/affixes/{aid}", timeout=60)
        assert gone.status_code == 200 and len(set(gone.headers["x-dllm-replicas"].split(","))) == 2
        refused = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": DEMO_PROMPT}], "affix": {"id": aid}},
            timeout=60,
        )
        assert refused.status_code == 400 and "no affix" in refused.json()["error"]["message"]

        # a stream streams through the ingress: one event per block, then [DONE]
        body = {"model": NAME, "prompt": DEMO_PROMPT, "max_tokens": 16, "block_length": 8, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as s:
            assert s.status_code == 200 and s.headers["x-dllm-replica"]
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        assert len(events) >= 2 and events[-1] == "data: [DONE]"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ray = Path(sys.executable).parent / "ray"
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=60)  # anything left behind
    assert not any("Traceback" in line for line in stderr), "".join(stderr)[-3000:]


def test_a_replica_reports_flags_the_model_refuses_instead_of_restarting():
    """A flag only the loaded model can refuse (a BiCache depth past its 6 layers) makes the replica answer 503s
    that carry the one-line refusal, which `serve --replicas` prints before exiting 2 (`run.refusal`)."""
    import asyncio
    import json

    from dllm_jax.cluster.replica import ReplicaServer
    from dllm_jax.cluster.run import refusal

    server = ReplicaServer(["--dtype", "float32", "--shallow-depth", "9"])
    assert server.refused.startswith("argument --shallow-depth: 9 exceeds the model's 6 layers")
    assert server.alive() is None and server.queued() == 0  # reported, not restarted by Ray

    async def answer(method, path):
        return [part async for part in server.request(method, path, body=b"{}")]

    head, body = asyncio.run(answer("GET", "/ready"))
    assert head["status"] == 503 and json.loads(body) == {"status": "failed", "error": server.refused}
    head, body = asyncio.run(answer("POST", "/v1/completions"))
    assert head["status"] == 503 and json.loads(body)["error"]["message"] == server.refused
    ready = {
        "status": "not ready",
        "replicas": [{"status": "warming"}, json.loads(asyncio.run(answer("GET", "/ready"))[1])],
    }
    assert refusal(ready) == server.refused and refusal({"replicas": [{"status": "warming"}]}) is None
