"""The forward with RoPE + the K/V cache write as one kernel (`Kernels.rope_write`, the GPU default in bf16) fed
by the q/k/v GEMM's split-K partials, against the plain XLA forward, and generate's tokens with it (identical to
the reference path's in fp32). The kernel is interpreted on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layer_loop import CONFIGS, PROMPTS, _close

from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate
from dllm_jax.io.loading import Model
from dllm_jax.transformer import XLA, CacheWrite, KernelChoice, Kernels, KVCache, forward
from dllm_jax.transformer.params import init_params, unstack_layers
from dllm_jax.transformer.rope_write import QKV_SPLITS, ROPE_WRITE_MAX_TOKENS

FUSED = Kernels(rope_write=True)


@pytest.fixture(scope="module")
def unrolled():
    return {
        k: Model(c, unstack_layers(init_params(c, jax.random.key(i), std=0.2)))
        for i, (k, c) in enumerate(CONFIGS.items())
    }


def _random_cache(config, params, b, s, seed):
    zeros = KVCache.for_params(params, config, b, s)
    keys = jax.random.split(jax.random.key(seed), 2 * config.n_layers)
    return KVCache(
        tuple(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, zeros.k)),
        tuple(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys[config.n_layers :], zeros.v)),
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_write_equals_xla_forward(name, unrolled):
    """Logits and the written cache with masked keys and a masked write; outside the window the cache keeps its
    bits. 16 tokens: the q/k/v projection reaches the kernel as split-K partials (Dream's with its bias)."""
    m = unrolled[name]
    b, n, s = 2, 8, 16
    tokens = jax.random.randint(jax.random.key(1), (b, n), 0, m.config.vocab_size - 3)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) + 5, (b, n))
    cache = _random_cache(m.config, m.params, b, s, seed=2)
    kw = dict(
        cache=cache,
        write=CacheWrite.at(5, jax.random.bernoulli(jax.random.key(3), 0.7, (b, n))),
        key_mask=jax.random.bernoulli(jax.random.key(4), 0.8, (b, s)).at[:, 5].set(True),
    )
    plain = forward(m.params, m.config, tokens, positions, **kw)
    fused = forward(m.params, m.config, tokens, positions, kernels=FUSED, **kw)
    _close(fused.logits, plain.logits)
    for got, ref in (
        (fused.cache.stacked().k, plain.cache.stacked().k),
        (fused.cache.stacked().v, plain.cache.stacked().v),
    ):
        _close(got, ref)
    untouched = np.ones(s, bool)
    untouched[5 : 5 + n] = False
    np.testing.assert_array_equal(
        np.asarray(fused.cache.stacked().k)[:, :, untouched], np.asarray(cache.stacked().k)[:, :, untouched]
    )


def test_fused_write_with_the_fp8_ffn():
    """The FP8 FFN (which adds both residuals in its own kernels) after the fused write."""
    c = CONFIGS["llada"].replace(d_model=128, mlp_hidden=256, n_heads=8, n_kv_heads=8, fp8_ffn=True)
    params = unstack_layers(init_params(c, jax.random.key(0), std=0.2))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, c.vocab_size - 3)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    cache = _random_cache(c, params, 2, 12, seed=5)
    plain = forward(params, c, tokens, positions, cache=cache, write=CacheWrite.at(4))
    fused = forward(params, c, tokens, positions, cache=cache, write=CacheWrite.at(4), kernels=FUSED)
    _close(fused.logits, plain.logits)
    _close(fused.cache.stacked().k, plain.cache.stacked().k)


@pytest.mark.parametrize("name,cache", [("llada", "dual"), ("dream", "prefix")])
def test_generate_tokens_identical_with_the_kernel(name, cache, unrolled):
    m = unrolled[name]
    base = dict(gen_length=16, block_length=8, steps=8, cache=cache, stop_at_eos=False)
    ref = generate(m, PROMPTS, GenerationConfig.from_options(**base, rope_write="xla"))
    out = generate(m, PROMPTS, GenerationConfig.from_options(**base, rope_write="pallas"))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.nfe == ref.nfe


def test_resolution(unrolled):
    """ "pallas" needs per-layer params (refused before anything compiles); "auto" is the kernel only on a GPU in
    bf16 with per-layer params; a stacked cache or a scattered write simply keeps XLA's ops."""
    m = unrolled["llada"]
    stacked = init_params(m.config, jax.random.key(0))
    with pytest.raises(ValueError, match="needs per-layer params"):
        Kernels.resolve(KernelChoice(rope_write="pallas"), m.config, stacked)
    gc = GenerationConfig.from_options(gen_length=8, block_length=8, steps=8, cache="dual", rope_write="pallas")
    with pytest.raises(ValueError, match="needs per-layer params"):
        generate(Model(m.config, stacked), PROMPTS, gc)
    assert Kernels.resolve(KernelChoice(), m.config, m.params).rope_write == (jax.default_backend() == "gpu")
    assert not Kernels.resolve(KernelChoice(), m.config, stacked).rope_write
    with pytest.raises(ValueError, match="rope_write="):
        KernelChoice(rope_write="fused")


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
def test_kernel_takes_split_k_partials_at_block_step_sizes(n, unrolled):
    """Up to ROPE_WRITE_MAX_TOKENS the kernel reads the q/k/v GEMM's fp32 split-K partials [QKV_SPLITS, tokens, W]
    (no reduction kernel in front of it); longer windows (block starts, batch 8) keep XLA's ops, no kernel."""
    m = unrolled["llada"]
    cache = KVCache.for_params(m.params, m.config, 1, 96)
    tokens = jnp.zeros((1, n), jnp.int32)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    jaxpr = jax.make_jaxpr(lambda p, c: forward(p, m.config, tokens, positions, cache=c, kernels=FUSED).logits)(
        m.params, cache
    )
    calls = _pallas_inputs(jaxpr.jaxpr, "rope_kv_write")
    if n > ROPE_WRITE_MAX_TOKENS:
        assert calls == []
        return
    assert len(calls) == m.config.n_layers
    qkv = calls[0][1]
    width = (m.config.n_heads + 2 * m.config.n_kv_heads) * m.config.head_dim
    assert qkv.shape == (QKV_SPLITS, n, width) and qkv.dtype == jnp.float32
    assert XLA.rope_write is False
