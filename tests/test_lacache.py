"""LaCache's first-layer memoisation (decoding/caches/lacache.py, cache="first_layer"): the online-softmax merge
against the reference attention, its forwards against the uncached forward, and the uncached tokens exactly."""

import fixtures
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.caches import lacache
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate
from dllm_jax.io.loading import Model
from dllm_jax.transformer import forward
from dllm_jax.transformer.attention import attend_reference, finish_state, merge_states, softmax_state
from dllm_jax.transformer.params import init_params, quantize_params, unstack_layers

opts = GenerationConfig.from_options

PROMPTS = [[5, 17, 3, 44, 9, 12, 30], [8, 2, 61], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_state_then_merge_equals_attention(hq, hkv):
    """Attention over keys split in two (a ragged, masked split; one row has no keys on the first side) equals
    the reference attention over all of them."""
    rng = np.random.default_rng(0)
    b, n, s, d = 3, 7, 11, 8
    q = jnp.asarray(rng.standard_normal((b, n, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    valid = rng.random((b, s)) < 0.8
    valid[:, -1] = True
    first = rng.random((b, s)) < 0.5
    first[2] = False  # row 2: everything in the second part
    state = softmax_state(q, k, v, jnp.asarray(valid & first))
    assert np.isneginf(np.asarray(state.m)[2]).all() and (np.asarray(state.l)[2] == 0).all()
    got = finish_state(merge_states(state, softmax_state(q, k, v, jnp.asarray(valid & ~first))), jnp.float32)
    want = attend_reference(q, k, v, jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llada_gqa_tied", "dream"])
def test_block_start_and_steps_equal_the_full_forward(name, models_fp32):
    """The block-start forward and a later step (block tokens changed, memo reused) give the logits a full
    uncached forward gives at the block's predictors."""
    m = models_fp32[name]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="first_layer")
    x, inp = fixtures.decode_inputs(m, gc, PROMPTS)
    strat = lacache.FirstLayerCache()
    bs = jnp.int32(inp.prompt_len + 4)  # the second block
    rows = jnp.arange(x.shape[0])[:, None]
    idx = jnp.broadcast_to(bs + jnp.arange(4) - inp.shift, (x.shape[0], 4))

    @jax.jit
    def full(x):
        return forward(m.params, m.config, x, inp.positions, key_mask=inp.key_mask, logits_at=idx).logits

    start = jax.jit(lambda x: strat.block_start(m.params, m.config, inp, strat.init(m.params, m.config, inp, x), x, bs))
    logits, memo = start(x)
    np.testing.assert_allclose(np.asarray(logits), full(x), rtol=1e-4, atol=1e-4)
    x2 = x.at[rows, bs + jnp.array([0, 2])].set(jnp.array([7, 9]))  # two block tokens committed
    logits, memo2 = jax.jit(lambda memo, x: strat.step(m.params, m.config, inp, memo, x, bs))(memo, x2)
    np.testing.assert_allclose(np.asarray(logits), full(x2), rtol=1e-4, atol=1e-4)
    # outside the block the memo is what the block start wrote
    out_cols = np.r_[0 : int(bs), int(bs) + 4 : x.shape[1]]
    np.testing.assert_array_equal(np.asarray(memo2.k)[:, out_cols], np.asarray(memo.k)[:, out_cols])


@pytest.mark.parametrize(
    "name,kw",
    [
        ("llada", dict(gen_length=12, block_length=4, steps=12)),
        ("llada_gqa_tied", dict(gen_length=8, block_length=4, steps=8, threshold=0.3)),
        ("dream", dict(gen_length=8, block_length=4, steps=8)),
        ("dream_tied", dict(gen_length=8, block_length=8, steps=8, sampler="dream")),
    ],
)
def test_tokens_equal_the_uncached_loop(name, kw, models_fp32):
    m = models_fp32[name]
    plain = generate(m, PROMPTS, opts(stop_at_eos=False, **kw))
    memo = generate(m, PROMPTS, opts(stop_at_eos=False, cache="first_layer", **kw))
    np.testing.assert_array_equal(memo.tokens, plain.tokens)
    assert memo.nfe == plain.nfe


def test_layouts_and_fp8_ffn(models_fp32):
    """Per-layer (unrolled) params give the same tokens; with the FP8 FFN (layer 1 stays in the activation dtype,
    LaCache's other half) the memoised loop decodes as the uncached FP8 loop."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, stop_at_eos=False)
    memo = opts(gen_length=8, block_length=4, steps=8, stop_at_eos=False, cache="first_layer")
    plain = generate(m, PROMPTS, gc).tokens
    unrolled = Model(m.config, unstack_layers(m.params))
    np.testing.assert_array_equal(generate(unrolled, PROMPTS, memo).tokens, plain)
    # exactness is a property of fp32: bf16 rounds the merged halves differently
    cfg = fixtures.fp8_config(dtype="float32")
    q, c8 = quantize_params(init_params(cfg, jax.random.key(0), std=0.05), cfg)  # FFN shapes of 128s
    m8 = Model(c8, q)
    np.testing.assert_array_equal(generate(m8, PROMPTS, memo).tokens, generate(m8, PROMPTS, gc).tokens)


def test_first_layer_settings(models_fp32):
    m = models_fp32["dream"]
    # exact: Dream needs no first-token rule and no second step per block
    opts(gen_length=8, block_length=4, steps=2, cache="first_layer").check_model(m.config)
    with pytest.raises(ValueError, match="needs cache 'prefix' or 'dual'"):
        opts(cache="first_layer", affix="naive")
    assert (
        jax.tree.structure(
            lacache.FirstLayerCache().init(
                m.params,
                m.config,
                fixtures.decode_inputs(m, opts(gen_length=8, block_length=4, steps=8), PROMPTS)[1],
                jnp.zeros((3, 40), jnp.int32),
            )
        ).num_leaves
        == 7
    )


def test_attend_state_on_the_slot_kernel_equals_the_jnp_state():
    """`attend_state`: the slot kernel's state out, and its state in continued over more keys, equal the jnp
    reference's (interpreted on the CPU), a row with no keys on the first side included."""
    from dllm_jax.transformer.attention import attend_state

    rng = np.random.default_rng(1)
    b, n, s, hq, hkv, d = 3, 5, 12, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, n, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    first = jnp.asarray(rng.random((b, s)) < 0.5).at[2].set(False)
    ref = attend_state(q, k, v, first, "xla", True, return_state=True)
    got = attend_state(q, k, v, first, "pallas", True, return_state=True)
    np.testing.assert_allclose(np.asarray(got.l), np.asarray(ref.l), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.o), np.asarray(ref.o), rtol=1e-5, atol=1e-5)
    out_ref = attend_state(q, k, v, ~first, "xla", True, init_state=ref)
    out = attend_state(q, k, v, ~first, "pallas", True, init_state=got)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attend_reference(q, k, v, None)), rtol=1e-5, atol=1e-6)


def test_the_memo_through_the_slot_kernel_and_fp8_all_keeps_the_tokens(models_fp32):
    """With attention on the slot kernel (interpreted here) the memo runs layer 1's attention through its state in
    and out, and decodes the tokens of the same settings without the memo; so it does with FP8 projections
    (weights="fp8_all": layer 1 stays bf16, the memo's layer)."""
    m = models_fp32["llada_gqa_tied"]
    kw = dict(gen_length=8, block_length=4, steps=8, stop_at_eos=False, attention="pallas")
    plain = generate(m, PROMPTS, opts(**kw)).tokens
    np.testing.assert_array_equal(generate(m, PROMPTS, opts(cache="first_layer", **kw)).tokens, plain)
    from dllm_jax.transformer.params import quantize_projections

    cfg = fixtures.fp8_config(dtype="float32", n_kv_heads=4)  # q/k/v widths of whole 128-blocks

    q8, c8 = quantize_params(init_params(cfg, jax.random.key(0), std=0.05), cfg)
    q8, c8 = quantize_projections(q8, c8)
    m8 = Model(c8, q8)
    gc = dict(gen_length=8, block_length=4, steps=8, stop_at_eos=False)
    np.testing.assert_array_equal(
        generate(m8, PROMPTS, opts(cache="first_layer", **gc)).tokens, generate(m8, PROMPTS, opts(**gc)).tokens
    )
