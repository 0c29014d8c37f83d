"""`dllm-jax serve --replicas 2`: two engine replicas on Ray Serve behind one ingress, on the CPU with the bundled
model, driven by the `openai` client. Answers equal one engine's, plain and streamed; requests that share an affix
meet on one replica and each affix is stored once; a hot affix spills to the other replica; a replica killed
mid-run loses no request; registrations reach every replica; SIGTERM stops the cluster and leaves no replica.
(The control, `--no-affinity`, which stores every affix on every replica: `test_cluster_routing.py` and
`bench/bench_cluster.py`.)"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fixtures
import httpx
import jax
import pytest

from dllm_jax.cli import DEMO_PROMPT
from dllm_jax.cluster.run import free_port

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


def _pids(*names: bytes) -> list[int]:
    """Processes whose command line holds one of these names."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and any(n in (proc / "cmdline").read_bytes() for n in names):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _replica_pids() -> list[int]:
    """The processes of this test's engine replicas (Ray names them by their deployment)."""
    return _pids(b"ServeReplica:dllm-jax:Replica")


RAY_PROCESSES = (b"ServeReplica:dllm-jax", b"ray::", b"raylet", b"gcs_server")


def _stop_and_check_nothing_left(proc) -> None:
    """SIGTERM stops `serve --replicas` cleanly (exit 0) and no process of its Ray cluster is left."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    deadline = time.time() + 30
    while _pids(*RAY_PROCESSES) and time.time() < deadline:
        time.sleep(0.5)
    assert not _pids(*RAY_PROCESSES)


def _kill_if_running(proc) -> None:
    """After a failure: the server and every Ray process of this machine's (tests start one cluster at a time)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, timeout=60)


def _per_replica(url: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    families = text_string_to_metric_families(text)
    return {s.labels["replica"]: s.value for f in families for s in f.samples if s.name == name}


FLAGS = ("--dtype", "float32", "--max-batch", "1", "--max-model-len", "128", "--affix-technique", "anchors")
# ACache at ratio 1: exact, and each affix's copy stored once per replica that serves it (its builds and hits count)
EXACT = ("--anchor-ratio", "1")


@pytest.mark.xdist_group("ray-cluster")  # one Ray cluster at a time: each checks none is left
def test_replicas_answer_as_one_engine_route_by_affix_spill_survive_a_kill_and_stop():
    import asyncio
    import concurrent.futures as cf
    import json

    from openai import OpenAI

    from dllm_jax.cluster.replica import ReplicaServer

    # one engine with the same settings, in this process, no Ray; warmed first, so that the replicas load its
    # programs from the run's compilation cache instead of compiling them again side by side
    single = ReplicaServer([*FLAGS, *EXACT, "--compile-cache", jax.config.jax_compilation_cache_dir])
    deadline = time.time() + 240
    while not single.service.warmed and time.time() < deadline:
        time.sleep(0.2)
    # without --address the server starts a Ray instance of its own, whatever cluster the environment names
    # (RAY_ADDRESS, here one where nothing listens; `ray start` leaves one the same way): joining it, stopping would
    # shut down its Serve
    nowhere = {"RAY_ADDRESS": f"127.0.0.1:{free_port('127.0.0.1')}"}
    proc, url = fixtures.start_server("--replicas", "2", "--spill-queue", "3", *FLAGS, *EXACT, env=nowhere)
    stderr = fixtures.drain_stderr(proc)
    try:
        ready = _wait_ready(url, 240)
        assert [r["status"] for r in ready["replicas"]] == ["ready", "ready"]
        # a second server joining this Ray cluster (the address the server names: under pytest-xdist another
        # worker's cluster may be this machine's newest, which `auto` would pick) is refused in one line before it
        # deploys anything: under the same application name it would replace this one
        address = re.search(r"Ray cluster at (\S+?)\)", proc.start_line).group(1)
        joining = {**fixtures.subprocess_env(), "RAY_AUTH_MODE": "token"}  # Ray 2.60: an explicit address needs it
        second = subprocess.run(
            [sys.executable, "-m", "dllm_jax.cli", "serve", "--replicas", "2", "--address", address, *FLAGS],
            env=joining,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and "already runs a dllm-jax server" in second.stderr, second.stderr[-2000:]
        # on a cluster whose Serve runs already, the proxy keeps its address: a server joining it reports that one
        joined = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray\nfrom dllm_jax.cluster.run import serve_address\n"
                f"ray.init(address={address!r}, log_to_driver=False)\n"
                "print(*serve_address('127.0.0.1', 1))\nray.shutdown()",
            ],
            env=joining,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert joined.stdout.split()[-2:] == ["127.0.0.1", url.rsplit(":", 1)[1]], joined.stderr[-2000:]
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def body(question: str, affix: str, max_tokens: int | None) -> dict:  # None: the model's default length
            b = dict(model=NAME, messages=[{"role": "user", "content": f"{affix} {question}"}])
            return b if max_tokens is None else {**b, "max_tokens": max_tokens}

        def ask(question: str, affix: str, max_tokens: int | None = None, stream: bool = False):
            b, extra = body(question, affix, max_tokens), {"affix": {"text": affix}}
            if stream:
                chunks = client.chat.completions.create(**b, extra_body=extra, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None
            raw = client.chat.completions.with_raw_response.create(**b, extra_body=extra)
            return raw.parse().choices[0].message.content, raw.headers["x-dllm-replica"]

        def alone(question: str, affix: str, max_tokens: int | None = None) -> str:
            sent = json.dumps({**body(question, affix, max_tokens), "affix": {"text": affix}}).encode()
            call = single.request("POST", "/v1/chat/completions", "", [("content-type", "application/json")], sent)

            async def answer():
                return [part async for part in call]

            return json.loads(asyncio.run(answer())[1])["choices"][0]["message"]["content"]

        # the same answers as one engine, plain and streamed: the README's question gets its answer
        question = "input : 8 9 5 what does the rule give ?"
        assert ask(question, RULES)[0] == alone(question, RULES) == "1 0 4"
        assert ask(question, RULES, stream=True)[0] == "1 0 4"
        # a method no endpoint has: the replicas' 405 in OpenAI's error shape, also where the ingress broadcasts
        for path in ("/v1/completions", "/v1/affixes"):
            refused = httpx.put(f"{url}{path}", json={}, timeout=60)
            assert refused.status_code == 405 and refused.json()["error"]["type"] == "invalid_request_error", path

        # four affixes, one request after another (below the spill bound): each always on one replica, stored once
        affixes = [f"rule examples : {i} 4 0 -> {9 - i} 5 9 ; 3 6 {i} -> 6 3 {9 - i} ;" for i in range(4)]
        builds = sum(_per_replica(url, "dllm_jax_affix_builds_total").values())
        owners: dict[str, set] = {}
        for affix in affixes:
            for digits in ("1 2 3", "4 5 6"):
                q = f"input : {digits} what does the rule give ?"
                answer, replica = ask(q, affix, max_tokens=8)
                owners.setdefault(affix, set()).add(replica)
                if digits == "1 2 3":
                    assert answer == alone(q, affix, max_tokens=8)
        assert all(len(r) == 1 for r in owners.values()), owners
        assert sum(_per_replica(url, "dllm_jax_affix_builds_total").values()) - builds == len(affixes)

        # a registration reaches both replicas, its id routes to one that serves it; a deletion reaches both
        reg = httpx.post(f"{url}/v1/affixes", json={"text": RULES}, timeout=60)
        assert reg.status_code == 200 and len(set(reg.headers["x-dllm-replicas"].split(","))) == 2, reg.text
        named = {"model": NAME, "messages": [{"role": "user", "content": f"{RULES} {question}"}]}
        named["affix"] = {"id": reg.json()["id"]}
        r = httpx.post(f"{url}/v1/chat/completions", json=named, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "1 0 4"
        gone = httpx.delete(f"{url}/v1/affixes/{reg.json()['id']}", timeout=60)
        assert gone.status_code == 200 and len(set(gone.headers["x-dllm-replicas"].split(","))) == 2
        assert httpx.post(f"{url}/v1/chat/completions", json=named, timeout=60).status_code == 400

        # the cluster's metrics and audit: every replica's, each sample / group naming its replica
        served = _per_replica(url, "dllm_jax_requests_finished_total")
        assert set(served) == set(_per_replica(url, "dllm_jax_ready")) and len(served) == 2
        audit = httpx.get(f"{url}/v1/audit", timeout=30)
        assert audit.status_code == 200 and audit.json()["fraction"] == 0.02
        assert all(g["replica"] in served for g in audit.json()["groups"])

        # one hot affix past the spill bound: both replicas serve it, every request is answered
        questions = [f"input : {a} {b} 0 what does the rule give ?" for a in range(4) for b in range(2)]
        with cf.ThreadPoolExecutor(8) as pool:
            hot = list(pool.map(lambda q: ask(q, affixes[0], max_tokens=8), questions))
        assert len({replica for _, replica in hot}) == 2 and all(answer for answer, _ in hot)

        # a replica killed while it decodes: every request is still answered, as one engine answers it (the ones
        # on the dead replica sent again to the one left)
        pids = {r["replica"]: r["pid"] for r in httpx.get(f"{url}/ready", timeout=30).json()["replicas"]}
        assert set(pids.values()) <= set(_replica_pids())
        with cf.ThreadPoolExecutor(6) as pool:
            running = [pool.submit(ask, q, affixes[0]) for q in questions[:6]]
            deadline, busy = time.time() + 30, {}
            while not any(busy.values()) and time.time() < deadline:
                time.sleep(0.05)  # each poll gathers every replica's metrics: not in a tight loop
                busy = _per_replica(url, "dllm_jax_requests_running")
            victim = max(busy, key=busy.get)
            os.kill(pids[victim], signal.SIGKILL)
            answers = [f.result(timeout=120) for f in running]
        assert [a for a, _ in answers] == [alone(q, affixes[0]) for q in questions[:6]]
        # those of the dead replica went to the live one, not to its replacement (compiling: it would hold them
        # for its whole warm-up)
        assert {replica for _, replica in answers} <= set(pids), (answers, pids)

        _stop_and_check_nothing_left(proc)
    finally:
        single.stop()
        _kill_if_running(proc)
    assert not any("Traceback" in line for line in stderr), "".join(stderr)[-3000:]


def test_a_replica_reports_flags_the_model_refuses_instead_of_restarting():
    """A flag only the loaded model can refuse (a BiCache depth past its 6 layers) makes the replica answer 503s
    that carry the one-line refusal, which `serve --replicas` prints before exiting 2 (`run.refusal`)."""
    import asyncio
    import json

    from dllm_jax.cluster.replica import ReplicaServer
    from dllm_jax.cluster.run import refusal

    server = ReplicaServer(["--dtype", "float32", "--shallow-depth", "9", "--no-compile-cache"])
    assert server.refused.startswith("argument --shallow-depth: 9 exceeds the model's 6 layers")
    assert server.alive() is None  # reported, not restarted by Ray

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


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_a_plain_answer_is_retried():
    """The part of a stream already sent cannot be sent again: where its replica dies, the ingress ends it with an
    error event in OpenAI's shape and [DONE]. A plain answer goes out only whole: a replica that dies after its
    head (before its body) is retried on another, never an empty 200 (seen once in a kill run before this)."""
    import asyncio
    import json

    from ray.exceptions import RayActorError

    from dllm_jax.cluster.app import answer_rest, first_answer

    first = b'data: {"choices": [{"text": "1 0"}]}\n\n'
    events = {"status": 200, "headers": [("content-type", "text/event-stream")]}
    plain = {"status": 200, "headers": [("content-type", "application/json")]}

    async def dying(head):
        yield head
        yield first
        raise RayActorError()

    async def whole(head):
        yield head
        yield b'{"choices": []}'

    async def stream_of(call) -> tuple[dict, list[bytes] | None, list[bytes]]:
        head, body, stream = await first_answer(call)
        return head, body, [part async for part in answer_rest(stream)] if body is None else []

    head, body, streamed = asyncio.run(stream_of(lambda: dying(events)))
    assert head == events and body is None
    assert streamed[0] == first and streamed[-1].endswith(b"data: [DONE]\n\n")
    error = json.loads(streamed[-1].split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == "replica_lost" and error["type"] == "server_error"

    calls = iter([dying(plain), whole(plain)])
    head, body, _ = asyncio.run(stream_of(lambda: next(calls)))
    assert head == plain and body == [b'{"choices": []}']
    with pytest.raises(RayActorError):  # two replicas lost in a row: the client gets the ingress's 500
        asyncio.run(first_answer(lambda: dying(plain)))


def test_metrics_and_audits_of_the_replicas_merge_into_one():
    from prometheus_client.parser import text_string_to_metric_families

    from dllm_jax.cluster.app import merge_audit, merge_metrics

    text = "# HELP x_total Things\n# TYPE x_total counter\nx_total 3.0\n"
    text += '# HELP y A gauge\n# TYPE y gauge\ny{affix="a b"} 1.0\n'
    merged = {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(merge_metrics([("r1", text), ("r2", text.replace("3.0", "4.0"))]))
    }
    assert merged["x"] == [({"replica": "r1"}, 3.0), ({"replica": "r2"}, 4.0)]
    assert merged["y"] == [({"replica": "r1", "affix": "a b"}, 1.0), ({"replica": "r2", "affix": "a b"}, 1.0)]
    report = {"fraction": 0.02, "audited": 2, "pending": 1, "groups": [{"affix": "a"}], "calibration": []}
    both = merge_audit([("r1", report), ("r2", {**report, "audited": 3, "groups": []})])
    assert both["audited"] == 5 and both["pending"] == 2 and both["fraction"] == 0.02
    assert both["groups"] == [{"affix": "a", "replica": "r1"}] and both["calibration"] == []
