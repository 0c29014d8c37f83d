"""The forward on fused norm/RoPE kernels (norm_rope_backend="pallas", dllm_jax/fused_layers.py; opt-in, measured
no faster on the H200) and on the RoPE + K/V write kernel alone fed by the q/k/v GEMM's split-K partials
("pallas_rope") against the plain XLA forward, and generate's tokens with them (identical to the reference path's
in fp32). Kernels interpreted on the CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.generate import GenerationConfig, generate
from dllm_jax.loading import Model
from dllm_jax.modeling import KVCache, forward, init_params, unstack_layers
from test_layer_loop import CONFIGS, PROMPTS, _close


@pytest.fixture(scope="module")
def unrolled():
    return {k: Model(c, unstack_layers(init_params(c, jax.random.key(i), std=0.2)))
            for i, (k, c) in enumerate(CONFIGS.items())}


def _random_cache(config, params, b, s, seed):
    zeros = KVCache.for_params(params, config, b, s)
    keys = jax.random.split(jax.random.key(seed), 2 * config.n_layers)
    return KVCache(tuple(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, zeros.k)),
                   tuple(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys[config.n_layers:], zeros.v)))


@pytest.mark.parametrize("backend", ["pallas", "pallas_rope"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_forward_equals_xla_forward(name, backend, unrolled):
    """Logits, the written cache and the fresh K/V, with and without a cache (masked keys, a masked write). 16
    tokens: the q/k/v projection reaches the RoPE kernel as split-K partials (Dream's with its bias)."""
    m = unrolled[name]
    b, n, s = 2, 8, 16
    tokens = jax.random.randint(jax.random.key(1), (b, n), 0, m.config.vocab_size - 3)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + 5, (b, n))
    plain = forward(m.params, m.config, tokens, positions, return_kv=True)
    fused = forward(m.params, m.config, tokens, positions, return_kv=True, norm_rope_backend=backend)
    for got, ref in ((fused.logits, plain.logits), (fused.kv[0], plain.kv[0]), (fused.kv[1], plain.kv[1])):
        _close(got, ref)
    cache = _random_cache(m.config, m.params, b, s, seed=2)
    kw = dict(cache=cache, cache_offset=5, write_mask=jax.random.bernoulli(jax.random.key(3), 0.7, (b, n)),
              key_mask=jax.random.bernoulli(jax.random.key(4), 0.8, (b, s)).at[:, 5].set(True), return_kv=True)
    plain = forward(m.params, m.config, tokens, positions, **kw)
    fused = forward(m.params, m.config, tokens, positions, norm_rope_backend=backend, **kw)
    _close(fused.logits, plain.logits)
    for got, ref in ((fused.cache.stacked().k, plain.cache.stacked().k),
                     (fused.cache.stacked().v, plain.cache.stacked().v), (fused.kv[0], plain.kv[0])):
        _close(got, ref)
    untouched = np.ones(s, bool)
    untouched[5:5 + n] = False  # outside the window the cache keeps its bits
    np.testing.assert_array_equal(np.asarray(fused.cache.stacked().k)[:, :, untouched],
                                  np.asarray(cache.stacked().k)[:, :, untouched])


def test_fused_forward_with_the_fp8_ffn():
    """The FP8 FFN (which adds both residuals in its own kernels) inside the fused loop."""
    c = dataclasses.replace(CONFIGS["llada"], d_model=128, mlp_hidden=256, n_heads=8, n_kv_heads=8, fp8_ffn=True)
    params = unstack_layers(init_params(c, jax.random.key(0), std=0.2))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, c.vocab_size - 3)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    cache = _random_cache(c, params, 2, 12, seed=5)
    plain = forward(params, c, tokens, positions, cache=cache, cache_offset=4)
    fused = forward(params, c, tokens, positions, cache=cache, cache_offset=4, norm_rope_backend="pallas")
    _close(fused.logits, plain.logits)
    _close(fused.cache.stacked().k, plain.cache.stacked().k)


@pytest.mark.parametrize("backend", ["pallas", "pallas_rope"])
@pytest.mark.parametrize("name,cache", [("llada", "dual"), ("dream", "prefix")])  # no cache: the forward test
def test_generate_tokens_identical_with_fused_kernels(name, cache, backend, unrolled):
    m = unrolled[name]
    gc = GenerationConfig(gen_length=16, block_length=8, steps=8, cache=cache, stop_at_eos=False,
                          norm_rope_backend="xla")
    ref = generate(m, PROMPTS, gc)
    out = generate(m, PROMPTS, dataclasses.replace(gc, norm_rope_backend=backend))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.nfe == ref.nfe


def test_fused_kernels_need_per_layer_params(unrolled):
    m = unrolled["llada"]
    stacked = init_params(m.config, jax.random.key(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="per-layer params"):
        forward(stacked, m.config, tokens, positions, norm_rope_backend="pallas")
    for backend in ("pallas", "pallas_rope"):
        with pytest.raises(ValueError, match="per-layer KVCache"):
            forward(m.params, m.config, tokens, positions, cache=KVCache.zeros(m.config, 1, 8),
                    norm_rope_backend=backend)
    with pytest.raises(ValueError, match="unknown norm_rope_backend"):
        forward(m.params, m.config, tokens, positions, norm_rope_backend="triton")
    with pytest.raises(ValueError, match="norm_rope_backend"):
        GenerationConfig(norm_rope_backend="fused").validate()
    assert GenerationConfig().norm_rope_backend == "auto"  # the RoPE kernel where it was measured faster, else XLA
    gc = GenerationConfig(gen_length=8, block_length=8, steps=8, cache="dual", norm_rope_backend="pallas")
    with pytest.raises(ValueError, match="needs per-layer params"):  # before anything is compiled
        generate(Model(m.config, stacked), PROMPTS, gc)
    with pytest.raises(ValueError, match="needs per-layer params"):
        generate(Model(m.config, stacked), PROMPTS, dataclasses.replace(gc, norm_rope_backend="pallas_rope"))


def _pallas_inputs(jaxpr, name: str) -> list:
    """The input avals of every pallas_call named `name` in a jaxpr (nested jits included)."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call" and e.params["name"] == name:
            found.append([v.aval for v in e.invars])
        sub = e.params.get("jaxpr")
        if sub is not None:
            found += _pallas_inputs(getattr(sub, "jaxpr", sub), name)
    return found


@pytest.mark.parametrize("n", [16, 80])
def test_pallas_rope_takes_split_k_partials_at_block_step_sizes(n, unrolled):
    """Up to PARTIALS_MAX_TOKENS the RoPE kernel reads the q/k/v GEMM's fp32 split-K partials [QKV_SPLITS, tokens,
    W] (no reduction kernel in front of it); longer windows (block starts, batch 8) keep XLA's ops, no kernel."""
    from dllm_jax import fused_layers

    m = unrolled["llada"]
    cache = KVCache.for_params(m.params, m.config, 1, 96)
    tokens = jnp.zeros((1, n), jnp.int32)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    jaxpr = jax.make_jaxpr(lambda p, c: forward(p, m.config, tokens, positions, cache=c, cache_offset=0,
                                                norm_rope_backend="pallas_rope").logits)(m.params, cache)
    calls = _pallas_inputs(jaxpr.jaxpr, "rope_kv_write")
    if n > fused_layers.PARTIALS_MAX_TOKENS:
        assert calls == []
        return
    assert len(calls) == m.config.n_layers
    qkv = calls[0][1]
    width = (m.config.n_heads + 2 * m.config.n_kv_heads) * m.config.head_dim
    assert qkv.shape == (fused_layers.QKV_SPLITS, n, width) and qkv.dtype == jnp.float32
