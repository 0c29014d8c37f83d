"""ACache (decoding/caches/acache.py): layout, probe, anchor choice, and its identities with the naive reuse and the
plain cache, on tiny fp32 checkpoints of both families (ragged batches, every affix placement)."""

import fixtures
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.caches import acache
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate
from dllm_jax.io.loading import Model
from dllm_jax.transformer import CacheWrite, KVCache, forward
from dllm_jax.transformer.params import unstack_layers

opts = GenerationConfig.from_options

# ragged prompts; spans put the affix first, inside and last (suffix: the prompt's last token is affix)
PROMPTS = [[5, 17, 3, 44, 9, 12, 30, 21, 8], [8, 2, 61, 7, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
SPANS = [(0, 6), (1, 4), (5, 11)]


def test_anchor_count_rule():
    assert [acache.anchor_count(10, r) for r in (0.0, 0.1, 0.15, 0.2, 0.99, 1.0)] == [0, 1, 2, 2, 10, 10]
    assert acache.anchor_count(0, 0.5) == 0 and acache.anchor_count(7, 0.2) == 2  # ceil(1.4)


def test_anchor_inputs_layout():
    """Request part: the real prompt positions outside the affix (plus P - 1, unwritten when it is affix),
    fillers (slot P, unwritten) in front, then the whole generation region at the same offset in every row."""
    pads = np.array([1, 0, 3])
    a = acache.anchor_inputs([(0, 2), (1, 3), None], pads, prompt_len=5, total_len=8, ratio=0.5)
    affix = np.asarray(a.affix)
    assert affix[0].tolist() == [False, True, True, False, False, False, False, False]
    assert affix[1].tolist() == [False, True, True, False, False, False, False, False]
    assert not affix[2].any()
    req, w = np.asarray(a.request), np.asarray(a.request_writes)
    # row 0: real prompt 1..4, affix 1..2 -> own [3, 4]; row 1: own [0, 3, 4]; row 2: real 3..4 -> [3, 4]
    assert req.tolist() == [[5, 3, 4, 5, 6, 7], [0, 3, 4, 5, 6, 7], [5, 3, 4, 5, 6, 7]]
    assert w.tolist() == [[False, True, True, True, True, True], [True] * 6, [False, True, True, True, True, True]]
    assert np.asarray(a.anchor_counts).tolist() == [1, 1, 0] and a.max_anchors == 1
    # a suffix affix: P - 1 is forwarded (Dream's predictor of the first generated token) but never written
    s = acache.anchor_inputs([(2, 5)], np.array([0]), prompt_len=5, total_len=7, ratio=0.0)
    assert np.asarray(s.request).tolist() == [[0, 1, 4, 5, 6]]
    assert np.asarray(s.request_writes).tolist() == [[True, True, False, True, True]]


def probe_reference(q, k, affix_keys, mask_queries):
    """The paper's score, one loop per row, query head and query: softmax over the affix keys of q.k/sqrt(d)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, n, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, k.shape[1]))
    for r in range(b):
        keys = np.flatnonzero(affix_keys[r])
        for h in range(hq):
            for t in np.flatnonzero(mask_queries[r]):
                if len(keys):
                    s = k[r, keys, h // g] @ q[r, t, h] / np.sqrt(d)
                    p = np.exp(s - s.max())
                    out[r, keys] += p / p.sum()
    return out


def test_probe_hook_matches_reference():
    rng = np.random.default_rng(0)
    b, n, s, hq, hkv, d = 3, 5, 9, 6, 2, 8
    q = rng.standard_normal((b, n, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    affix_keys = rng.random((b, s)) < 0.5
    affix_keys[2] = False  # a row without an affix scores zero, never NaN
    mask_queries = rng.random((b, n)) < 0.6
    got = acache.affix_importance_probe(jnp.asarray(affix_keys), jnp.asarray(mask_queries))(q, KVCache((k,), (k,)), 0)
    np.testing.assert_allclose(np.asarray(got), probe_reference(q, k, affix_keys, mask_queries), rtol=1e-5, atol=1e-6)


def prepared(model, prompts, spans, ratio, gen_length=8):
    """The state `generate` starts decoding from, built eagerly (plus the inputs and the affix-alone cache)."""
    gc = opts(
        gen_length=gen_length, block_length=4, steps=gen_length, cache="dual", affix="anchors", anchor_ratio=ratio
    )
    x, inp = fixtures.decode_inputs(model, gc, prompts)
    a = acache.anchor_inputs(spans, np.asarray(~inp.key_mask).sum(1), inp.prompt_len, x.shape[1], ratio)
    state = acache.prepare(model.params, model.config, inp, a, x)
    alone = acache.affix_alone_cache(model.params, model.config, inp, x, a.affix)
    return inp, a, x, state, alone


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_probe_mass_and_anchor_choice(name, models_fp32):
    """Each [MASK] query's softmax over the affix sums to 1 per head and layer; the anchors are the top-K affix
    positions by that score, in position order, K = ceil(ratio * affix_len) per row."""
    m = models_fp32[name]
    inp, a, x, state, _ = prepared(m, PROMPTS, SPANS, ratio=0.34)
    imp = np.asarray(state.importance)
    affix = np.asarray(a.affix)
    assert (imp[~affix] == 0).all() and (imp[affix] > 0).all()
    n_mask = np.asarray((jnp.take_along_axis(x, a.request, 1) == m.config.mask_token_id) & a.request_writes).sum(1)
    np.testing.assert_allclose(imp.sum(1), m.config.n_layers * m.config.n_heads * n_mask, rtol=1e-5)
    window, writes = np.asarray(state.window), np.asarray(state.writes)
    for r, (s, e) in enumerate(SPANS):
        k = acache.anchor_count(e - s, 0.34)
        anchors = window[r, : a.max_anchors][writes[r, : a.max_anchors]]
        assert len(anchors) == k and (np.diff(anchors) > 0).all()
        top = np.sort(np.argsort(-np.where(affix[r], imp[r], -np.inf), kind="stable")[:k])
        np.testing.assert_array_equal(anchors, top)


def test_block_start_recomputes_anchors_and_request_only(models_fp32):
    """After a block start, non-anchor affix slots still hold the K/V of the affix alone, bit for bit; anchor
    slots and request slots hold what a forward of the window wrote (not the affix-alone values)."""
    m = models_fp32["llada"]
    inp, a, x, state, alone = prepared(m, PROMPTS, SPANS, ratio=0.5)
    strat = acache.AnchoredRefresh(inner=None)
    _, state = strat.block_start(m.params, m.config, inp, state, x, jnp.int32(inp.prompt_len))
    k_now, k_alone = np.asarray(state.kv.stacked().k), np.asarray(alone.stacked().k)
    window, writes = np.asarray(state.window), np.asarray(state.writes)
    affix = np.asarray(a.affix)
    for r in range(len(PROMPTS)):
        anchors = set(window[r, : a.max_anchors][writes[r, : a.max_anchors]].tolist())
        for j in np.flatnonzero(affix[r]):
            same = np.array_equal(k_now[:, r, j], k_alone[:, r, j])
            assert same == (j not in anchors), (r, j)
        written = window[r][writes[r]]
        assert np.abs(k_now[:, r, written]).sum(axis=(0, 2, 3)).min() > 0  # request slots were written


def test_write_slots_equals_contiguous_write(models_fp32):
    """A scattered CacheWrite over a gathered window writes what the contiguous window writes."""
    m = models_fp32["dream"]
    x = jnp.asarray([[5, 17, 3, 44, 9, 12, 30, 21]], jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    empty = KVCache.for_params(m.params, m.config, 1, 8)
    full = forward(m.params, m.config, x, pos, cache=empty)
    contiguous = forward(m.params, m.config, x[:, 3:6], pos[:, 3:6], cache=full.cache, write=CacheWrite.at(3))
    slots = jnp.asarray([[5, 3, 4]], jnp.int32)  # the same window, gathered out of order
    gathered = forward(
        m.params, m.config, x[:, [5, 3, 4]], pos[:, [5, 3, 4]], cache=full.cache, write=CacheWrite.scatter(slots)
    )
    np.testing.assert_allclose(
        np.asarray(gathered.cache.stacked().k), np.asarray(contiguous.cache.stacked().k), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(gathered.logits[0]), np.asarray(contiguous.logits[0, [2, 0, 1]]), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("name,cache", [("llada", "dual"), ("llada_gqa_tied", "prefix"), ("dream", "dual")])
def test_ratio_identities(name, cache, models_fp32):
    """anchor_ratio 0 decodes exactly as the naive reuse; anchor_ratio 1 exactly as the plain cache (the probe is
    one more NFE in both); in between, the tokens are those of neither in general."""
    m = models_fp32[name]
    base = dict(gen_length=8, block_length=4, steps=8, cache=cache, stop_at_eos=False)
    plain = generate(m, PROMPTS, opts(**base))
    naive = generate(m, PROMPTS, opts(**base, affix="naive"), affix_spans=SPANS)
    r0 = generate(m, PROMPTS, opts(**base, affix="anchors", anchor_ratio=0.0), affix_spans=SPANS)
    r1 = generate(m, PROMPTS, opts(**base, affix="anchors", anchor_ratio=1.0), affix_spans=SPANS)
    assert (naive.tokens != plain.tokens).any()  # the affix matters here, so the identities are not vacuous
    np.testing.assert_array_equal(r0.tokens, naive.tokens)
    np.testing.assert_array_equal(r1.tokens, plain.tokens)
    assert r0.nfe == naive.nfe + 1 and r1.nfe == plain.nfe + 1


def test_rows_without_affix_and_refresh_every_step(models_fp32):
    """A row with no affix decodes as with the plain cache; refresh="step" with ratio 1 equals no cache."""
    m = models_fp32["llada"]
    base = dict(gen_length=8, block_length=4, steps=8, stop_at_eos=False)
    gc = opts(**base, cache="dual", affix="anchors", anchor_ratio=0.3)
    mixed = generate(m, PROMPTS, gc, affix_spans=[SPANS[0], None, SPANS[2]])
    plain = generate(m, PROMPTS, opts(**base, cache="dual"))
    np.testing.assert_array_equal(mixed.tokens[1], plain.tokens[1])
    every = opts(**base, cache="dual", affix="anchors", anchor_ratio=1.0, refresh="step")
    np.testing.assert_array_equal(
        generate(m, PROMPTS, every, affix_spans=SPANS).tokens, generate(m, PROMPTS, opts(**base, cache="none")).tokens
    )


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(affix="anchors"), "needs cache 'prefix' or 'dual'"),
        (dict(affix="anchors", cache="dual", anchor_ratio=1.5), "ratio=1.5"),
        (dict(affix="anchored", cache="dual"), "affix='anchored'"),
    ],
)
def test_bad_affix_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        opts(gen_length=8, block_length=4, steps=8, **kw)


def test_bad_affix_spans(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors")
    with pytest.raises(ValueError, match="needs affix_spans"):
        generate(m, PROMPTS, gc)
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        generate(m, PROMPTS, gc, affix_spans=SPANS[:2])
    with pytest.raises(ValueError, match="outside its 5 tokens"):
        generate(m, PROMPTS, gc, affix_spans=[SPANS[0], (2, 9), SPANS[2]])


AFFIX = [11, 12, 13, 14, 15, 16]
SHARED_PROMPTS = [AFFIX + [20, 21], [30] + AFFIX + [31, 32, 33], [40, 41, 42] + AFFIX]  # prefix, infix, suffix


@pytest.mark.parametrize("name", ["llada_gqa_tied", "dream"])
def test_shared_affix_placed_equals_affix_alone(name, models_fp32):
    """The affix's K/V built once at positions 0.. and placed (K re-rotated to each row's offset) equal the
    affix-alone forward of every row (within fp32 rounding: that forward runs at the batch's shape); zero
    outside the affix."""
    m = models_fp32[name]
    shared = acache.build_shared_affix(m.params, m.config, AFFIX)
    assert len(shared) == 6 and shared.k.shape == (m.config.n_layers, 6, m.config.n_kv_heads, m.config.head_dim)
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="naive")
    spans = [(0, 6), (1, 7), (3, 9)]
    x, inp = fixtures.decode_inputs(m, gc, SHARED_PROMPTS, spans)
    alone = acache.affix_alone_cache(m.params, m.config, inp, x, inp.frozen).stacked()
    frozen, pads = np.asarray(inp.frozen), np.asarray(~inp.key_mask).sum(1)
    starts = np.array([s for s, _ in spans])
    placed = acache.place_shared_affix(
        m.params,
        m.config,
        shared.k,
        shared.v,
        jnp.asarray(pads + starts),
        jnp.asarray(starts),
        jnp.ones(3, bool),
        *x.shape,
    ).stacked()
    for got, want in ((placed.k, alone.k), (placed.v, alone.v)):
        got, want = np.asarray(got), np.asarray(want)
        assert (got[:, ~frozen] == 0).all()
        np.testing.assert_allclose(got[:, frozen], want[:, frozen], rtol=1e-5, atol=1e-5)
    # at offset 0 (the prefix row) placing is a copy: rotating by 0 changes no bit
    np.testing.assert_array_equal(np.asarray(placed.k)[:, 0, frozen[0]], np.asarray(shared.k))


@pytest.mark.parametrize("affix", ["naive", "anchors"])
def test_generate_with_a_shared_affix(affix, models_fp32):
    """generate(shared_affix=...) finds the affix in each prompt and decodes as when every row computes it."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False, affix=affix, anchor_ratio=0.34)
    shared = acache.build_shared_affix(m.params, m.config, AFFIX)
    per_row = generate(m, SHARED_PROMPTS, gc, affix_spans=[(0, 6), (1, 7), (3, 9)])
    once = generate(m, SHARED_PROMPTS, gc, shared_affix=shared)
    np.testing.assert_array_equal(once.tokens, per_row.tokens)
    assert once.nfe == per_row.nfe
    # per-layer params and buffers (the GPU layout) place it the same way
    unrolled = Model(m.config, unstack_layers(m.params))
    np.testing.assert_array_equal(generate(unrolled, SHARED_PROMPTS, gc, shared_affix=shared).tokens, per_row.tokens)
    # a row without the affix, marked by its span
    mixed = generate(
        m, SHARED_PROMPTS + [[50, 51]], gc, shared_affix=shared, affix_spans=[(0, 6), (1, 7), (3, 9), None]
    )
    np.testing.assert_array_equal(mixed.tokens[:3], per_row.tokens)


def test_bad_shared_affix(models_fp32):
    m = models_fp32["llada"]
    shared = acache.build_shared_affix(m.params, m.config, AFFIX)
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors")
    with pytest.raises(ValueError, match="prompt 1 does not contain the shared affix"):
        generate(m, [AFFIX + [1], [1, 2, 3]], gc, shared_affix=shared)
    with pytest.raises(ValueError, match=r"span \(1, 7\) of prompt 0 does not hold"):
        generate(m, [AFFIX + [1]], gc, shared_affix=shared, affix_spans=[(1, 7)])
    with pytest.raises(ValueError, match="shared_affix needs an affix technique"):
        generate(m, [AFFIX + [1]], opts(gen_length=8, block_length=4, steps=8, cache="dual"), shared_affix=shared)
    with pytest.raises(ValueError, match="do not fit this model"):
        generate(models_fp32["dream"], [AFFIX + [1]], gc, shared_affix=shared)
    with pytest.raises(ValueError, match="outside"):
        acache.build_shared_affix(m.params, m.config, [1, 5000])
    with pytest.raises(ValueError, match="non-empty list"):
        acache.build_shared_affix(m.params, m.config, [])


def test_probe_in_query_chunks_equals_one_pass():
    """A window longer than PROBE_CHUNK is scored chunk by chunk (bounded memory): the same importance."""
    rng = np.random.default_rng(0)
    n, s = acache.PROBE_CHUNK + 77, 40
    q = jnp.asarray(rng.normal(size=(2, n, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, s, 2, 8)), jnp.float32)
    keys = jnp.asarray(rng.random((2, s)) < 0.7)
    queries = jnp.asarray(rng.random((2, n)) < 0.5)
    cache = KVCache((k,), (k,))
    chunked = acache.affix_importance_probe(keys, queries)(q, cache, 0)
    whole = sum(
        acache.affix_importance_probe(keys, queries[:, i : i + 256])(q[:, i : i + 256], cache, 0)
        for i in range(0, n, 256)
    )
    every = acache.row_importance_probe(keys, queries)(q, cache, 0)  # each row over its own span (the engine's)
    np.testing.assert_allclose(np.asarray(every), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-5)
    assert float(chunked.sum()) > 0
