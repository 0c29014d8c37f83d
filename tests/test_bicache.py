"""BiCache (decoding/caches/bicache.py): the depth rule, a forward split at a layer, the refresh against a masked
full-window formulation, and its identities with the plain cache (depth 0) and the naive reuse (depth L)."""

import fixtures
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.caches import acache, bicache
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate, layout
from dllm_jax.transformer import CacheWrite, KVCache, forward

opts = GenerationConfig.from_options

PROMPTS = [[5, 17, 3, 44, 9, 12, 30, 21, 8], [8, 2, 61, 7, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
SPANS = [(0, 6), (0, 3), (3, 11)]  # ragged prefixes and a suffix (P - 1 is affix)


def test_depth_rule():
    table = bicache.DEPTH_TABLES[("llada", 32)]
    assert bicache.depth_from_table(table, 512, 600, 256) == 13  # r = round(59.8) = 60 -> key 54
    assert bicache.depth_from_table(table, 0, 100, 256) == 1
    assert bicache.depth_from_table(table, 990, 1000, 0) == 32  # r = 99
    dream = bicache.DEPTH_TABLES[("dream", 28)]
    assert bicache.depth_from_table(dream, 250, 300, 200) == 7  # r = 50 -> key 47

    class Cfg:
        family, n_layers = "llada", 32

    # the shallowest row wins; rows without a prefix do not count; none with one: depth 0 (plain cache)
    assert bicache.batch_depth(Cfg, [(0, 512), (0, 100), None], [600, 600, 600], 256, None) == 3  # r 12 -> key 10
    assert bicache.batch_depth(Cfg, [None, None], [10, 10], 256, None) == 0
    assert bicache.batch_depth(Cfg, [(0, 5)], [10], 256, 7) == 7

    class Tiny:
        family, n_layers = "llada", 3

    with pytest.raises(ValueError, match=r"set Shallow\(depth=0..3\)"):
        bicache.batch_depth(Tiny, [(0, 5)], [10], 8, None)


@pytest.mark.parametrize("name", ["llada", "dream_tied"])
def test_forward_split_at_a_layer(name, models_fp32):
    """forward(layers 0..k-1, output_hidden) then forward(layers k.., hidden=...) equals one forward, with and
    without a cache (the cache's buffers keep their absolute layer index)."""
    m = models_fp32[name]
    x = jnp.asarray([[5, 17, 3, 44, 9, 12, 30, 21]], jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    whole = forward(m.params, m.config, x, pos)
    for k in range(m.config.n_layers + 1):
        h = forward(m.params, m.config, x, pos, layers=(0, k), output_hidden=True)
        assert h.logits is None and h.hidden.shape == (1, 8, m.config.d_model)
        out = forward(m.params, m.config, h.hidden, pos, layers=(k, m.config.n_layers))
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(whole.logits), rtol=1e-5, atol=1e-5)
    cache = KVCache.for_params(m.params, m.config, 1, 8)
    full = forward(m.params, m.config, x, pos, cache=cache)
    first = forward(m.params, m.config, x, pos, cache=cache, layers=(0, 1), output_hidden=True)
    rest = forward(m.params, m.config, first.hidden, pos, cache=first.cache, layers=(1, m.config.n_layers))
    np.testing.assert_allclose(
        np.asarray(rest.cache.stacked().k), np.asarray(full.cache.stacked().k), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="not within the model's"):
        forward(m.params, m.config, x, pos, layers=(1, m.config.n_layers + 1))


def setup(model, spans, depth, prompts=PROMPTS):
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="shallow")
    x, inp = fixtures.decode_inputs(model, gc, prompts)
    a = acache.anchor_inputs(spans, np.asarray(~inp.key_mask).sum(1), inp.prompt_len, x.shape[1], 0.0)
    state = bicache.prefix_alone_state(model.params, model.config, inp, x, a.affix, a.request, a.request_writes, depth)
    return inp, a, x, state


def masked_refresh_reference(model, inp, x, prefix, alone_kv, prefix_hidden, depth, block_start):
    """The refresh written without gathered windows: layers < depth over the whole buffer with the prefix's K/V
    kept (write_mask), the prefix's hidden state replaced by the one computed alone (but at P - 1), then layers
    >= depth."""
    cfg = model.config
    shallow = forward(
        model.params,
        cfg,
        x,
        inp.positions,
        key_mask=inp.key_mask,
        cache=alone_kv,
        write=CacheWrite.at(0, ~prefix),
        layers=(0, depth),
        output_hidden=True,
    )
    spliced = prefix & (jnp.arange(x.shape[1]) != inp.prompt_len - 1)[None]  # P - 1 stays in context
    hidden = jnp.where(spliced[:, :, None], prefix_hidden, shallow.hidden)
    idx = jnp.broadcast_to(block_start + jnp.arange(4) - inp.shift, (x.shape[0], 4))
    deep = forward(
        model.params,
        cfg,
        hidden,
        inp.positions,
        key_mask=inp.key_mask,
        cache=shallow.cache,
        layers=(depth, cfg.n_layers),
        logits_at=idx,
    )
    return deep.logits, deep.cache


@pytest.mark.parametrize("name,depth", [("llada", 1), ("llada_gqa_tied", 0), ("dream", 1)])
def test_refresh_matches_the_masked_formulation(name, depth, models_fp32):
    m = models_fp32[name]
    inp, a, x, state = setup(m, SPANS, depth)
    strat = bicache.ShallowReuse(inner=None, depth=depth)
    p = inp.prompt_len
    logits, new = strat.block_start(m.params, m.config, inp, state, x, jnp.int32(p))
    ref_logits, ref_kv = masked_refresh_reference(m, inp, x, a.affix, state.kv, state.prefix_hidden, depth, p)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-4, atol=1e-4)
    got_k, want_k = np.asarray(new.kv.stacked().k), np.asarray(ref_kv.stacked().k)
    real = np.asarray(inp.key_mask)
    np.testing.assert_allclose(got_k[:, real], want_k[:, real], rtol=1e-4, atol=1e-5)
    # the prefix's K/V: those of the prefix alone, bit for bit, in layers < depth; recomputed in the others
    alone = np.asarray(acache.affix_alone_cache(m.params, m.config, inp, x, a.affix).stacked().k)
    prefix = np.asarray(a.affix)
    np.testing.assert_array_equal(got_k[:depth, prefix], alone[:depth, prefix])
    # layer `depth` reads the spliced prefix-alone hidden state, so its prefix K/V are the alone ones too; the
    # layers after it see the request
    # (but at P - 1, which runs in context)
    spliced = prefix & (np.arange(prefix.shape[1]) != p - 1)[None]
    np.testing.assert_allclose(got_k[depth, spliced], alone[depth, spliced], rtol=1e-5, atol=1e-5)
    for layer in range(depth + 1, m.config.n_layers):
        assert not np.allclose(got_k[layer, prefix], alone[layer, prefix], atol=1e-4), layer


@pytest.mark.parametrize("name,cache", [("llada", "dual"), ("dream", "dual"), ("llada_gqa_tied", "prefix")])
def test_depth_identities(name, cache, models_fp32):
    """shallow_depth 0 decodes exactly as the plain cache, shallow_depth = n_layers exactly as the naive reuse;
    in between, neither in general. No extra NFE."""
    m = models_fp32[name]
    base = dict(gen_length=8, block_length=4, steps=8, cache=cache, stop_at_eos=False)
    spans = [(0, 6), (1, 4), (3, 11)]  # a prefix, an infix, a suffix
    plain = generate(m, PROMPTS, opts(**base))
    naive = generate(m, PROMPTS, opts(**base, affix="naive"), affix_spans=spans)
    assert (naive.tokens != plain.tokens).any()
    d0 = generate(m, PROMPTS, opts(**base, affix="shallow", shallow_depth=0), affix_spans=spans)
    dl = generate(m, PROMPTS, opts(**base, affix="shallow", shallow_depth=m.config.n_layers), affix_spans=spans)
    np.testing.assert_array_equal(d0.tokens, plain.tokens)
    np.testing.assert_array_equal(dl.tokens, naive.tokens)
    assert d0.nfe == plain.nfe and dl.nfe == naive.nfe and dl.shallow_depth == m.config.n_layers


def test_shared_prefix_built_once(models_fp32):
    """build_shared_prefix's hidden states are the prefix-alone ones at every depth, and generate with it decodes
    as when every row computes its prefix alone."""
    m = models_fp32["llada"]
    prefix = [11, 12, 13, 14, 15, 16]
    prompts = [prefix + [20, 21], [31, 32] + prefix + [33, 34], [7, 8]]  # the second row: an infix
    shared = bicache.build_shared_prefix(m.params, m.config, prefix)
    assert shared.hidden.shape == (m.config.n_layers + 1, 6, m.config.d_model) and shared.tokens == tuple(prefix)
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False, affix="shallow", shallow_depth=2)
    spans = [(0, 6), (2, 8), None]
    for depth in range(m.config.n_layers + 1):
        _, a, _, state = setup(m, spans, depth, prompts)
        got = np.asarray(state.prefix_hidden)[np.asarray(a.affix)].reshape(2, 6, -1)
        np.testing.assert_allclose(
            got, np.broadcast_to(np.asarray(shared.hidden[depth]), got.shape), rtol=1e-5, atol=1e-5
        )
    per_row = generate(m, prompts, gc, affix_spans=spans)
    once = generate(m, prompts, gc, affix_spans=spans, shared_affix=shared)
    np.testing.assert_array_equal(once.tokens, per_row.tokens)


def test_bad_shallow_settings(models_fp32):
    m = models_fp32["llada"]
    base = dict(gen_length=8, block_length=4, steps=8, cache="dual", affix="shallow")
    gc = opts(**base, shallow_depth=1)
    with pytest.raises(ValueError, match=r"set Shallow\(depth"):
        generate(m, PROMPTS, opts(**base), affix_spans=SPANS)
    with pytest.raises(ValueError, match="shallow depth 4 exceeds the model's 3 layers"):
        generate(m, PROMPTS, opts(**base, shallow_depth=4), affix_spans=SPANS)
    with pytest.raises(ValueError, match="must be >= 0"):
        opts(**base, shallow_depth=-1)
    with pytest.raises(ValueError, match="build_shared_prefix"):
        generate(m, PROMPTS, gc, shared_affix=acache.build_shared_affix(m.params, m.config, PROMPTS[0][:6]))


def test_profile_statistic_and_table(models_fp32):
    """Layer 1's K/V depend only on the token and its position, so alone and in context agree there (cos 1); the
    table keeps a staircase of leading-layer counts, its first entry keyed 0."""
    m = models_fp32["dream"]
    gc = opts(gen_length=8, block_length=8, steps=8)
    x, pos, km, frozen, _ = layout(PROMPTS, m.config, gc, SPANS)
    sim = np.asarray(
        bicache.kv_similarity(
            m.params, m.config, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(km), jnp.asarray(frozen)
        )
    )
    assert sim.shape == (3, m.config.n_layers)
    np.testing.assert_allclose(sim[:, 0], 1.0, atol=1e-6)
    assert (sim[:, 1:] < 0.9999).all() and (sim > -1).all()
    sims = np.array([[1, 0.99, 0.5], [1, 0.99, 0.98], [1, 0.5, 0.5], [1, 0.99, 0.99], [1, 0.99, 0.99]])
    # r 10: mean [1, .99, .74] -> 2; r 20 -> 1 (no growth: dropped); r 30 -> 3; r 40 -> 3 (dropped)
    assert bicache.depth_table_from_profile([10, 10, 20, 30, 40], sims, 0.97) == {0: 2, 30: 3}
    # strict: the depth layer must pass too (one fewer unless every layer passes)
    assert bicache.depth_table_from_profile([10, 10, 20, 30, 40], sims, 0.97, strict=True) == {0: 1, 30: 3}
    assert bicache.depth_table_from_profile([5], np.array([[1, 0.5, 0.5]]), 0.97, strict=True) == {0: 0}
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="shallow", shallow_table={0: 1, 50: 2})
    assert gc.cache.affix.table == ((0, 1), (50, 2))
    out = generate(m, PROMPTS, gc, affix_spans=SPANS)
    assert out.shallow_depth == 1  # every row's affix is under half its sequence
    with pytest.raises(ValueError, match="entry for r = 0"):
        opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="shallow", shallow_table=((5, 1),))
