"""Tensor parallelism (dllm_jax/transformer/sharding.py) on 8 host devices: tokens identical to one device for
generate (plain dual cache, an ACache shared affix, FP8 FFN weights) and for the engine; the weights, the caches
and the engine's pool split by head; the compiled programs all-reduce. Each test runs in a fresh interpreter that
the test gives XLA_FLAGS (the library never sets it)."""

import json
import subprocess
import sys
from pathlib import Path

import fixtures

TESTS = Path(__file__).parent

PRELUDE = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import jax
import dllm_jax, fixtures
from dllm_jax import GenerationConfig, generate
from dllm_jax.decoding.caches import acache

assert len(jax.devices()) == 8
root = sys.argv[2]

def load(name, tp, **kw):
    d = fixtures.write_checkpoint(name, f"{root}/{name}")
    return dllm_jax.load(d, dtype="float32", tensor_parallel=tp, **kw)

def tokens(model, gc, prompts, **kw):
    return np.asarray(generate(model, prompts, gc, **kw).tokens).tolist()

rng = np.random.default_rng(0)
AFFIX = rng.integers(0, 100, 24).tolist()
PROMPTS = [AFFIX + rng.integers(0, 100, 5).tolist(), rng.integers(0, 100, 3).tolist() + AFFIX]
SPANS = [(0, 24), (3, 27)]
dual = GenerationConfig.from_options(gen_length=8, block_length=4, steps=8, cache="dual")
anchors = GenerationConfig.from_options(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors")
out = {}
"""

GENERATE = """
# the shared affix on both families; FP8 weights with the plain dual cache; the layout checks once per model
# (2 devices: the FP8 model's; every count divides the heads the same way, and each is a compile: the suite's time)
for name, fp8, tps in [("llada_tp", False, (1, 8)), ("dream_tp", False, (1, 8)), ("llada_fp8_tp", True, (1, 2))]:
    for tp in tps:
        m = load(name, tp, fp8_ffn=fp8)
        out[f"{name}/{tp}"] = [tokens(m, dual, PROMPTS)]
        if not fp8:
            shared = acache.build_shared_affix(m.params, m.config, AFFIX)
            out[f"{name}/{tp}"].append(tokens(m, anchors, PROMPTS, shared_affix=shared, affix_spans=SPANS))
        if tp == tps[-1] and tp > 1:
            q = m.params["layers"]["q_proj"]["kernel"]
            out[f"{name}/{tp}/q_shard"] = list(q.addressable_shards[0].data.shape)
            from dllm_jax.transformer import KVCache, forward
            x = jax.numpy.asarray([PROMPTS[0]])
            pos = jax.numpy.arange(x.shape[1])[None]
            empty = KVCache.for_params(m.params, m.config, 1, x.shape[1])
            run = jax.jit(lambda p, x, pos, c: forward(p, m.config, x, pos, cache=c))
            cache = run(m.params, x, pos, empty).cache
            out[f"{name}/{tp}/kv_spec"] = [str(a) for a in cache.stacked().k.sharding.spec]
            out[f"{name}/{tp}/all_reduce"] = "all-reduce" in run.lower(m.params, x, pos, empty).compile().as_text()
print(json.dumps(out))
"""

ENGINE = """
from dllm_jax import Engine, EngineConfig
for tp in (1, 4):  # 2 and 8 run generate above
    m = load("llada_tp", tp)
    engine = Engine(m, EngineConfig(max_batch=4, kv_budget_bytes=1 << 22, min_affix_tokens=8, block_lengths=(4,)))
    ids = [engine.add_request(p, dual) for p in PROMPTS]
    ids += [engine.add_request(p, anchors, affix=s) for p, s in zip(PROMPTS, SPANS)]  # one stored copy
    while engine.has_unfinished():
        engine.step()
    out[str(tp)] = [engine.request(i).answer(()) for i in ids]
    if tp > 1:
        k = engine.runner.k[0]
        out[f"{tp}/pool_shard"] = list(k.addressable_shards[0].data.shape)
        out[f"{tp}/pool_shape"] = list(k.shape)
print(json.dumps(out))
"""


def run(body: str, tmp_path) -> dict:
    env = fixtures.subprocess_env(host_devices=8)
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + body, str(TESTS), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_generate_on_2_and_8_devices_equals_one_device(tmp_path):
    out = run(GENERATE, tmp_path)
    for name, tps in [("llada_tp", (8,)), ("dream_tp", (8,)), ("llada_fp8_tp", (2,))]:
        for tp in tps:
            assert out[f"{name}/{tp}"] == out[f"{name}/1"], (name, tp)  # plain and with a shared affix
        assert out[f"{name}/{tp}/all_reduce"]  # partitioned, not replicated
        assert out[f"{name}/{tp}/kv_spec"][:4] == ["None", "None", "None", "tp"]  # [L, B, S, Hkv, D]
    assert out["llada_tp/8/q_shard"] == [2, 64, 64 // 8]  # each device: its heads' columns of every layer


def test_engine_on_4_devices_equals_one_device(tmp_path):
    out = run(ENGINE, tmp_path)
    assert out["4"] == out["1"]
    for tp in (4,):
        slots, heads, dim = out[f"{tp}/pool_shape"]
        assert out[f"{tp}/pool_shard"] == [slots, heads // tp, dim]  # every page, this device's KV heads


def test_bad_tensor_parallel_counts(tmp_path):
    body = """
for tp in (3, 16):
    try:
        load("llada_tp", tp)
    except ValueError as e:
        out[str(tp)] = str(e)
print(json.dumps(out))
"""
    out = run(body, tmp_path)
    assert "tensor_parallel=3 does not divide" in out["3"] and "n_heads" in out["3"]
    assert "tensor_parallel=16 needs 1..8 devices" in out["16"]
