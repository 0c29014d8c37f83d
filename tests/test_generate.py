"""The jitted denoising loop against straightforward step-by-step reference loops written from the papers."""

import dataclasses

import fixtures
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.caches import STRATEGIES
from dllm_jax.decoding.caches.base import DecodeInputs
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate, layout
from dllm_jax.transformer import XLA, forward

opts = GenerationConfig.from_options

PROMPTS = [[5, 17, 3, 44, 9, 12, 30], [8, 2, 61], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


_jit_forward = jax.jit(forward, static_argnames=("config",))


def full_logits(model, x):
    """Logits of one row; [MASK] excluded from predictions (the engine never commits it, see decode_loop)."""
    x = jnp.asarray(x, jnp.int32)[None]
    pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    logits = np.asarray(_jit_forward(model.params, config=model.config, inputs=x, positions=pos).logits[0], np.float64)
    logits[:, model.config.mask_token_id] = -np.inf
    return logits


def softmax(l):
    e = np.exp(l - l.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def llada_reference(model, prompt, gen_length, block_length, steps, threshold=None, shift=False, commit_steps=None):
    """LLaDA `generate` (temperature 0, low_confidence remasking), and Fast-dLLM's threshold rule, one row.
    shift: the logits are those of an AR-adapted model (Dream): position i is predicted at i - 1. commit_steps: a
    list that receives, per generated position, the step inside its block that chose it."""
    mask = model.config.mask_token_id
    x = np.array(list(prompt) + [mask] * gen_length)
    chosen_at = np.full(len(x), -1)
    p = len(prompt)
    n_blocks = gen_length // block_length
    spb = steps // n_blocks
    nfe = 0
    for b in range(n_blocks):
        s, e = p + b * block_length, p + (b + 1) * block_length
        n = int((x[s:e] == mask).sum())
        schedule = [n // spb + (1 if i < n % spb else 0) for i in range(spb)]
        i = 0
        while (x[s:e] == mask).any():
            logits = full_logits(model, x)
            if shift:
                logits = np.concatenate([logits[:1], logits[:-1]], 0)
            nfe += 1
            x0 = logits.argmax(-1)
            conf = np.take_along_axis(softmax(logits), x0[:, None], 1)[:, 0]
            masked = x == mask
            conf = np.where(masked, conf, -np.inf)
            conf[e:] = -np.inf
            if threshold is None:
                k = schedule[i]
                chosen = np.argsort(-conf, kind="stable")[:k]
            else:
                chosen = [j for j in range(len(x)) if conf[j] >= threshold] or [int(np.argmax(conf))]
                chosen = set(chosen) | {int(np.argmax(conf))}
            for j in chosen:
                x[j], chosen_at[j] = x0[j], i
            i += 1
    if commit_steps is not None:
        commit_steps.extend(chosen_at[p:].tolist())
    return x[p:], nfe


def dream_reference(model, prompt, gen_length, steps, eps=1e-3):
    """Dream `diffusion_generate` (alg maskgit_plus, temperature 0, logits shifted right by one), one row."""
    mask = model.config.mask_token_id
    x = np.array(list(prompt) + [mask] * gen_length)
    timesteps = np.linspace(1, eps, steps + 1)
    for i in range(steps):
        logits = full_logits(model, x)
        logits = np.concatenate([logits[:1], logits[:-1]], 0)
        masked = x == mask
        probs = softmax(logits)
        conf, x0 = probs.max(-1), probs.argmax(-1)
        t, s = timesteps[i], timesteps[i + 1]
        n = int(masked.sum())
        k = int(n * (1 - s / t)) if i < steps - 1 else n
        full_conf = np.where(masked, conf, -np.inf)
        for j in np.argsort(-full_conf, kind="stable")[:k]:
            x[j] = x0[j]
    return x[len(prompt) :]


@pytest.mark.parametrize("name", ["llada", "llada_gqa_tied"])
@pytest.mark.parametrize("blocks", [(12, 12, 6), (12, 4, 6)])
def test_llada_matches_reference_loop(name, blocks, models_fp32):
    m = models_fp32[name]
    gen, bl, steps = blocks
    gc = opts(gen_length=gen, block_length=bl, steps=steps, stop_at_eos=False)
    out = generate(m, PROMPTS, gc)
    for row, row_steps, prompt in zip(out.tokens, out.commit_steps, PROMPTS):
        ref_steps = []
        ref, nfe = llada_reference(m, prompt, gen, bl, steps, commit_steps=ref_steps)
        np.testing.assert_array_equal(row, ref)
        # each token was committed at the step of its block where the reference loop chose it: the fixed schedule's
        # count at each step (steps // n_blocks steps a block), the most confident first
        np.testing.assert_array_equal(row_steps, ref_steps)
        spb = steps // (gen // bl)
        for block in row_steps.reshape(gen // bl, bl):
            assert np.bincount(block, minlength=spb).tolist() == [bl // spb] * spb
    assert out.nfe == steps and list(out.steps_per_block) == [steps // (gen // bl)] * (gen // bl)
    assert out.committed_per_step.sum() == gen * len(PROMPTS)


def test_llada_threshold_matches_reference(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=12, block_length=4, threshold=0.3, stop_at_eos=False)
    for prompt in PROMPTS[:2]:
        out = generate(m, [prompt], gc)
        ref_steps = []
        ref, nfe = llada_reference(m, prompt, 12, 4, 12, threshold=0.3, commit_steps=ref_steps)
        np.testing.assert_array_equal(out.tokens[0], ref)
        assert out.nfe == nfe
        # the positions each step committed are those the threshold rule passed at that step
        np.testing.assert_array_equal(out.commit_steps[0], ref_steps)
        assert out.commit_steps.max(axis=None) < 4 and out.commit_steps.min(axis=None) == 0


@pytest.mark.parametrize("name", ["dream", "dream_tied"])
def test_dream_matches_reference_loop(name, models_fp32):
    m = models_fp32[name]
    gc = opts(gen_length=10, block_length=10, steps=5, stop_at_eos=False)
    out = generate(m, PROMPTS, gc)
    for row, prompt in zip(out.tokens, PROMPTS):
        np.testing.assert_array_equal(row, dream_reference(m, prompt, 10, 5))
    assert out.nfe == 5


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_refreshed_every_step_is_exact(name, cache, models_fp32):
    m = models_fp32[name]
    base = dict(gen_length=12, block_length=4, steps=12, stop_at_eos=False, sampler="llada")
    ref = generate(m, PROMPTS, opts(**base))
    out = generate(m, PROMPTS, opts(**base, cache=cache, refresh="step"))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.nfe == ref.nfe == 12


def _strategy_logits(model, name, x, block_start, edit):
    """Run block_start at x, then one step at x edited by `edit`; returns the step's block logits."""
    gc = opts(gen_length=12, block_length=4, steps=12, cache=name)
    xs, pos, km, frozen, P = layout([x], model.config, gc)
    inp = DecodeInputs(jnp.asarray(pos), jnp.asarray(km), jnp.asarray(frozen), P, 4, 0, XLA)
    s = STRATEGIES[name]
    xs = jnp.asarray(xs)
    state = s.init(model.params, model.config, inp, xs)
    _, state = s.block_start(model.params, model.config, inp, state, xs, jnp.int32(block_start))
    logits, _ = s.step(
        model.params, model.config, inp, state, jnp.asarray(edit(np.asarray(xs).copy(), P)), jnp.int32(block_start)
    )
    return np.asarray(logits)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_which_positions_a_step_recomputes(cache, models_fp32):
    """prefix: positions before the block come from the cache, the block AND the suffix are recomputed;
    dual: only the block is recomputed, prompt and suffix come from the cache."""
    m = models_fp32["llada"]
    prompt = PROMPTS[0]
    bs_rel = 4  # second block of 4
    same = lambda x, P: x  # noqa: E731

    def edit_prompt(x, P):
        x[0, P - 2] = (x[0, P - 2] + 1) % 50
        return x

    def edit_suffix(x, P):  # a still-masked position after the current block [P+4, P+8)
        x[0, P + 10] = 3
        return x

    def edit_block(x, P):
        x[0, P + bs_rel + 1] = 3
        return x

    P = layout([prompt], m.config, opts(gen_length=12, block_length=4, steps=12))[4]
    bs = P + bs_rel
    base = _strategy_logits(m, cache, prompt, bs, same)
    changed = lambda f: np.abs(_strategy_logits(m, cache, prompt, bs, f) - base).max() > 1e-6  # noqa: E731
    assert not changed(edit_prompt)  # prompt K/V are read from the cache in both modes
    assert changed(edit_block)  # the block itself is always recomputed
    assert changed(edit_suffix) == (cache == "prefix")


def test_threshold_commits_inside_block_and_at_least_one(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=12, block_length=4, threshold=0.99, cache="dual", stop_at_eos=False)
    out = generate(m, PROMPTS, gc)
    # every step committed >= 1 token per row; blocks finish in <= block_length steps
    assert (out.committed_per_step >= len(PROMPTS)).all()
    assert all(1 <= s <= 4 for s in out.steps_per_block)
    assert out.nfe == int(out.steps_per_block.sum())
    assert (out.tokens != m.config.mask_token_id).all()
    # never outside the current block: the commits of each block's steps add up to exactly one block per row
    # (a commit into a later block would overfill an earlier block's total)
    ends = np.cumsum(out.steps_per_block)
    per_block = np.split(out.committed_per_step, ends[:-1])
    assert [int(c.sum()) for c in per_block] == [4 * len(PROMPTS)] * 3


def test_factor_rule_commits_at_least_one(models_fp32):
    m = models_fp32["dream"]
    out = generate(m, PROMPTS, opts(gen_length=8, block_length=4, factor=1.0, cache="prefix"))
    assert (out.committed_per_step >= len(PROMPTS)).all() and out.nfe <= 8


@pytest.mark.parametrize("name,cache", [("llada", "none"), ("dream", "dual"), ("llada_gqa_tied", "prefix")])
def test_batch_rows_equal_rows_alone(name, cache, models_fp32):
    m = models_fp32[name]
    gc = opts(gen_length=8, block_length=4, steps=8, cache=cache, stop_at_eos=False)
    batch = generate(m, PROMPTS, gc)
    for i, prompt in enumerate(PROMPTS):
        np.testing.assert_array_equal(batch.tokens[i], generate(m, [prompt], gc).tokens[0])


def test_eos_fills_rest_and_stops(models_fp32):
    m = models_fp32["llada"]
    base = dict(gen_length=12, block_length=4, steps=12)
    free = generate(m, PROMPTS[:1], opts(**base, stop_at_eos=False)).tokens[0]
    # declare the first generated token a stop token: the row ends after block 1 and is filled with EOS
    stop = int(free[0])
    out = generate(m, PROMPTS[:1], opts(**base, stop_at_eos=True, extra_stop_ids=(stop,)))
    first = int(np.argmax(out.tokens[0] == stop))
    assert (out.tokens[0, first + 1 :] == m.config.eos_token_id).all()
    assert out.nfe == 4 and list(out.steps_per_block) == [4, 0, 0]  # blocks 2 and 3 cost nothing


def test_temperature_and_random_remasking_are_seeded(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=8, steps=4, temperature=1.0, remasking="random")
    a, b, c = (generate(m, PROMPTS, gc, seed=s).tokens for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_cfg_and_dream_algorithms_run(models_fp32):
    m = models_fp32["llada"]
    out = generate(m, PROMPTS, opts(gen_length=8, block_length=8, steps=4, cfg_scale=1.0))
    assert (out.tokens != m.config.mask_token_id).all() and out.nfe == 4
    d = models_fp32["dream"]
    for alg in ["origin", "maskgit_plus", "topk_margin", "entropy"]:
        gc = opts(
            gen_length=8,
            block_length=8,
            steps=4,
            alg=alg,
            temperature=0.5,
            top_p=0.9,
            top_k=20,
            alg_temp=0.1 if alg == "entropy" else None,
            stop_at_eos=False,
        )
        assert (generate(d, PROMPTS, gc).tokens != d.config.mask_token_id).all()


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(gen_length=10, block_length=4), "not a multiple of block_length"),
        (dict(gen_length=8, block_length=4, steps=3), "multiple of the number of blocks"),
        (dict(threshold=1.5), "threshold=1.5"),
        (dict(threshold=0.0), "threshold=0.0"),
        (dict(cfg_scale=1.0, cache="dual"), "cfg_scale"),
        (dict(cache="paged"), "cache='paged'"),
        (dict(threshold=0.9, factor=1.0), "threshold or factor, not both"),
        (dict(gen_length=8, block_length=8, steps=16), "exceeds gen_length"),
    ],
)
def test_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        opts(**kw)


def test_bad_prompts(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=8, steps=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(m, [[1, 2], []], gc)
    with pytest.raises(ValueError, match="outside"):
        generate(m, [[1, 2, 1000]], gc)
    with pytest.raises(ValueError, match="maximum sequence length 256"):
        generate(m, [[1] * 250], gc)
    with pytest.raises(ValueError, match="no prompts"):
        generate(m, [], gc)


def test_naive_affix_reuse_freezes_affix(models_fp32):
    """affix='naive': the affix K/V are those of the affix alone. With the affix being the whole prompt prefix the
    result equals a cache where the affix's K/V never see the rest; differs from dual cache in general."""
    m = models_fp32["llada"]
    base = dict(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False)
    gc = opts(**base)
    spans = [(0, 4), (0, 2), (3, 8)]
    naive = generate(m, PROMPTS, opts(**base, affix="naive"), affix_spans=spans)
    dual = generate(m, PROMPTS, gc)
    assert naive.tokens.shape == dual.tokens.shape
    assert (naive.tokens != dual.tokens).any()
    # spans are ignored unless an affix technique is selected
    np.testing.assert_array_equal(generate(m, PROMPTS, gc, affix_spans=spans).tokens, dual.tokens)
    with pytest.raises(ValueError, match="affix_spans"):
        generate(m, PROMPTS, opts(**base, affix="naive"))


def test_llada_sampler_on_dream_model_keeps_the_shift(models_fp32):
    """The logit shift is a property of the model family (Dream is AR-adapted), not of the sampler."""
    m = models_fp32["dream"]
    gc = opts(gen_length=8, block_length=4, steps=8, sampler="llada", stop_at_eos=False)
    out = generate(m, PROMPTS[:2], gc)
    for row, prompt in zip(out.tokens, PROMPTS[:2]):
        ref, _ = llada_reference(m, prompt, 8, 4, 8, shift=True)
        np.testing.assert_array_equal(row, ref)


def test_factor_rule_reference_quirk():
    from dllm_jax.decoding.samplers import commit

    masked = jnp.ones((3, 3), bool).at[0, 2].set(False)
    # row 0: two masked, the second fails (0.1 < 1 - 1/3): the reference commits both
    # row 1: three masked, the second fails: commit 1; row 2: all pass: commit 3
    conf = jnp.array([[0.99, 0.1, -jnp.inf], [0.99, 0.1, 0.05], [0.99, 0.9, 0.8]])
    committed = np.asarray(commit.commit_factor(conf, masked, factor=1.0))
    assert committed.sum(-1).tolist() == [2, 1, 3]


@pytest.mark.parametrize(
    "kw,msg",
    [(dict(alg="confidence_threshold"), "alg="), (dict(remasking="top"), "remasking="), (dict(eps=1.0), "eps=1.0")],
)
def test_bad_sampler_settings(kw, msg):
    with pytest.raises(ValueError, match=msg):
        opts(gen_length=8, block_length=8, steps=8, **kw)


def test_dream_cache_needs_two_steps_per_block(models_fp32):
    gc = opts(gen_length=8, block_length=4, steps=2, cache="dual")
    with pytest.raises(ValueError, match=">= 2 steps per block"):
        generate(models_fp32["dream"], PROMPTS, gc)
    generate(models_fp32["llada"], PROMPTS, gc)  # LLaDA has no first-token rule: fine
    assert opts(extra_stop_ids=[3, 4]).extra_stop_ids == (3, 4)


def test_compiler_options_turn_triton_gemms_off_only_for_fp8_past_the_limit(monkeypatch):
    """XLA's Triton GEMMs are turned off (v15) only on a GPU, for FP8-FFN models, when a block step has more than
    NO_TRITON_GEMM_FP8_ABOVE_TOKENS tokens (batch x block); never for bf16, never on the CPU; None disables it."""
    import importlib

    G = importlib.import_module("dllm_jax.decoding.generate")  # the module (also the name of the function)
    fp8 = fixtures.fp8_config(n_layers=2, n_kv_heads=4, max_seq_len=512, pad_token_id=297, fp8_ffn=True)
    bf16 = dataclasses.replace(fp8, fp8_ffn=False)
    gc = opts(block_length=32, cache="dual")
    prefix = opts(block_length=32, cache="prefix")
    monkeypatch.setattr(G.jax, "default_backend", lambda: "cpu")
    assert G.compiler_options(fp8, gc, 8) is None
    monkeypatch.setattr(G.jax, "default_backend", lambda: "gpu")
    assert G.compiler_options(fp8, gc, 8) == {"xla_gpu_enable_triton_gemm": False}
    assert G.compiler_options(fp8, gc, 2) is None and G.compiler_options(bf16, gc, 8) is None  # 64 tokens; bf16
    assert G.compiler_options(fp8, prefix, 8) is None  # only what was measured
    assert G.fp8_compiler_options(fp8, 16 * 32) == G.NO_TRITON_GEMM  # the serving engine's block calls (dual)
    monkeypatch.setattr(G, "NO_TRITON_GEMM_FP8_ABOVE_TOKENS", None)
    assert G.compiler_options(fp8, gc, 8) is None


def test_generate_compiles_with_the_policy_options(monkeypatch, models_fp32):
    """generate compiles its program with what compiler_options returns: one jit (and compilation cache) per set of
    options, XLA's defaults when it returns None."""
    import importlib

    G = importlib.import_module("dllm_jax.decoding.generate")
    seen = []
    real = G._generate_jit

    def spy(options=()):
        seen.append(options)
        return real(options)

    monkeypatch.setattr(G, "_generate_jit", spy)
    model = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=8, steps=2, cache="dual")
    out0 = generate(model, [[1, 2, 3]], gc)
    monkeypatch.setattr(G, "compiler_options", lambda *a: {"xla_cpu_enable_fast_math": False})
    out1 = generate(model, [[1, 2, 3]], gc)
    assert seen == [(), (("xla_cpu_enable_fast_math", False),)]
    assert real(()) is not real(seen[1]) and real(()) is real(())
    np.testing.assert_array_equal(out0.tokens, out1.tokens)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("llada", dict(gen_length=12, block_length=4, steps=12, cache="dual")),
        ("llada", dict(gen_length=8, block_length=8, steps=4, cfg_scale=1.0)),
        ("llada", dict(gen_length=8, block_length=4, steps=4, temperature=1.0, remasking="random", cache="prefix")),
        ("dream", dict(gen_length=8, block_length=4, steps=4, cache="dual")),  # the first-token commit
        ("dream", dict(gen_length=8, block_length=8, steps=4, alg="entropy", alg_temp=0.1, temperature=0.5)),
        ("dream", dict(gen_length=8, block_length=4, steps=8, sampler="llada", cache="dual")),
    ],
)
def test_fixed_step_loop_equals_the_while_loop(name, kw, models_fp32):
    """step_loop="auto" runs the in-block steps as a loop of known trip count where every block provably takes
    steps / n_blocks steps: the same tokens, NFEs and per-step commits as the while loop that checks each step."""
    from dllm_jax.decoding.loop import fixed_step_count

    m = models_fp32[name]
    gc = opts(stop_at_eos=False, **kw)
    assert fixed_step_count(gc, m.config)  # the case exercises the fixed loop
    fixed = generate(m, PROMPTS, gc, seed=3)
    ref = generate(m, PROMPTS, opts(stop_at_eos=False, step_loop="while", **kw), seed=3)
    np.testing.assert_array_equal(fixed.tokens, ref.tokens)
    assert fixed.nfe == ref.nfe and list(fixed.steps_per_block) == list(ref.steps_per_block)
    np.testing.assert_array_equal(fixed.committed_per_step, ref.committed_per_step)


def test_fixed_step_loop_with_a_finished_row(models_fp32):
    """A row that stops early (EOS-filled blocks) and one that does not: both loops agree, and the blocks after
    every row has finished still cost nothing."""
    m = models_fp32["llada"]
    base = dict(gen_length=12, block_length=4, steps=12)
    stop = int(generate(m, PROMPTS[:1], opts(**base, stop_at_eos=False)).tokens[0, 0])
    gc = opts(**base, extra_stop_ids=(stop,))
    fixed = generate(m, PROMPTS[:2], gc)
    ref = generate(m, PROMPTS[:2], opts(**base, extra_stop_ids=(stop,), step_loop="while"))
    np.testing.assert_array_equal(fixed.tokens, ref.tokens)
    assert fixed.nfe == ref.nfe and list(fixed.steps_per_block) == list(ref.steps_per_block)
    alone = generate(m, PROMPTS[:1], gc)
    assert alone.nfe == 4 and list(alone.steps_per_block) == [4, 0, 0]


def test_fixed_step_count_rule(models_fp32):
    from dllm_jax.decoding.loop import fixed_step_count

    llada, dream = models_fp32["llada"].config, models_fp32["dream"].config
    base = dict(gen_length=8, block_length=4, steps=4)
    g = opts(**base)
    assert fixed_step_count(g, llada) and fixed_step_count(g, dream)
    assert not fixed_step_count(opts(**base, threshold=0.9), llada)
    assert not fixed_step_count(opts(**base, factor=1.0), dream)
    assert not fixed_step_count(opts(**base, alg="origin"), dream)  # random reveals
    assert fixed_step_count(opts(**base, alg="origin"), llada)  # Dream's alg is not LLaDA's rule
    assert not fixed_step_count(opts(gen_length=4, block_length=1, steps=4), dream)


def test_fixed_step_loop_has_a_known_trip_count(models_fp32):
    """The point of the fixed loop: XLA sees the in-block loop's trip count (steps / n_blocks - 1), so its GPU
    runtime runs it without a predicate copied to the host per step; step_loop="while" has no such loop."""
    import re

    from dllm_jax.decoding.generate import _generate_jit

    m = models_fp32["llada"]
    counts = {}
    for loop in ("auto", "while"):
        gc = opts(gen_length=24, block_length=12, steps=22, cache="dual", stop_at_eos=False, step_loop=loop)
        x, pos, km, fr, P = layout([PROMPTS[0]], m.config, gc)
        txt = (
            _generate_jit(())
            .lower(
                m.params,
                jnp.asarray(x),
                jnp.asarray(pos),
                jnp.asarray(km),
                jnp.asarray(fr),
                jax.random.key(0),
                config=m.config,
                gc=gc,
                prompt_len=P,
                padded=False,
                kernels=XLA,
            )
            .compile()
            .as_text()
        )
        counts[loop] = len(re.findall(r'known_trip_count":\{"n":"10"\}', txt))
    assert counts["auto"] >= 1 and counts["while"] == 0


def test_bad_step_loop():
    with pytest.raises(ValueError, match="step_loop="):
        opts(step_loop="scan")
