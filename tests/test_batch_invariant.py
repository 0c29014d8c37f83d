"""The batch-invariant mode (`KernelChoice.batch_invariant`): a row's result is bit-identical whatever shares its
call. Unit level: `attend_segments` (other rows, padding keys, left padding, key segments, query positions) and
the model forward (a row alone against the same row padded among others); engine level: every answer of a mixed
stream equals solo `generate`, bit for bit, in fp32 and bf16, on the tiny models and on the bundled model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax import GenerationConfig, answer_tokens, generate
from dllm_jax.config import ModelConfig
from dllm_jax.engine import Engine, EngineConfig
from dllm_jax.io.loading import Model
from dllm_jax.transformer import KernelChoice, Kernels, forward, init_params
from dllm_jax.transformer.attention import (
    KEY_CHUNK,
    QUERY_TILE,
    KeySegment,
    attend,
    attend_reference,
    attend_segments,
    attend_slots,
)

RNG = np.random.default_rng(0)


def _qkv(b, n, s, hq=4, hkv=2, d=64, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, n, hq, d), (b, s, hkv, d), (b, s, hkv, d))
    )
    return q, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_segments_is_attention(dtype):
    """The same attention as the reference (another summation order: close, not equal), masked keys skipped, a row
    without keys zeros."""
    q, k, v = _qkv(3, 21, 2 * KEY_CHUNK + 37, dtype=dtype)
    mask = jnp.asarray(RNG.random((3, k.shape[1])) < 0.7).at[2].set(False)
    got = attend_segments(q, [KeySegment(k, v, mask)])
    want = attend_reference(q, k, v, mask)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    assert not np.asarray(got[2]).any()


def _through_slots(q: jax.Array, segments: list[KeySegment]) -> jax.Array:
    """`attend_slots` (the interpreted slot kernel) over KeySegments: each one's K/V as a pool of its rows' keys and
    a read table listing each row's valid keys in order, as the engine's pool and `attend` give it."""
    parts = []
    for k, v, valid in segments:
        b, s = k.shape[:2]
        valid = jnp.ones((b, s), bool) if valid is None else valid
        table = jnp.argsort(~valid, axis=1, stable=True).astype(jnp.int32) + jnp.arange(b, dtype=jnp.int32)[:, None] * s
        pools = (a.reshape(b * s, *a.shape[2:]) for a in (k, v))
        parts.append((q, *pools, table, valid.sum(axis=1).astype(jnp.int32)))
    return attend_slots(parts, interpret=jax.default_backend() != "gpu")


def test_attend_slots_is_attention_over_its_segments_in_order():
    """The slot path computes attention (close to the reference, another order) over two segments read one after
    the other, one of them empty for some rows, and `attend` packs a masked contiguous cache into it."""
    q, k, v = _qkv(3, 21, 150, dtype=jnp.float32, seed=7)
    first = jnp.asarray(RNG.random((3, 150)) < 0.3).at[1].set(False)  # row 1: an empty first segment
    second = jnp.asarray(RNG.random((3, 150)) < 0.6) & ~first
    got = _through_slots(q, [KeySegment(k, v, first), KeySegment(k, v, second)])
    want = attend_reference(q, k, v, first | second)
    # compiled, the kernel's fp32 dots run on TF32 tensor cores (H100: 3.1e-4 apart at most); interpreted, exact fp32
    tol = 1e-5 if jax.default_backend() != "gpu" else 2e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)
    packed = attend(q, k, v, second, "invariant_slot", interpret=jax.default_backend() != "gpu")
    np.testing.assert_allclose(np.asarray(packed), np.asarray(attend_reference(q, k, v, second)), atol=tol, rtol=tol)


def test_the_mode_runs_the_slot_kernel_where_asked_and_on_gpus():
    """Which attention the mode resolves to: the slot kernel for a Pallas choice (and on a GPU in bf16 by default),
    XLA's key chunks otherwise; tensor-parallel params always XLA's."""
    config, params = _model("bfloat16")
    gpu = jax.default_backend() == "gpu"
    resolve = lambda attention: Kernels.resolve(KernelChoice(attention, batch_invariant=True), config, params)  # noqa: E731
    assert resolve("pallas").attention == resolve("invariant_slot").attention == "invariant_slot"
    assert resolve("xla").attention == "invariant"
    assert resolve("auto").attention == ("invariant_slot" if gpu else "invariant")
    fp32 = Kernels.resolve(KernelChoice(batch_invariant=True), *_model("float32"))
    assert fp32.attention == "invariant"  # the kernel's dots would run fp32 as TF32


@pytest.mark.parametrize(
    "dtype,backend",
    [
        (jnp.float32, "invariant"),
        (jnp.bfloat16, "invariant"),
        (jnp.float32, "invariant_slot"),
        (jnp.bfloat16, "invariant_slot"),
    ],
)
def test_attend_segments_row_result_does_not_depend_on_its_call(dtype, backend):
    """One row's queries over its keys, bit for bit: alone; among other rows; its keys left-padded, right-padded and
    scattered among masked ones; split into an empty shared segment and its own; its queries at other offsets of a
    longer window (another place in the query tiles). Compiled, as the engine runs it: one program a shape. Both
    backends of the mode: XLA's key chunks, and the slot kernel at its fixed tiles (interpreted here; compiled on a
    GPU, where this file runs as it is)."""
    attend = jax.jit(attend_segments if backend == "invariant" else _through_slots)
    s, n = KEY_CHUNK + 45, QUERY_TILE + 3
    q, k, v = _qkv(1, n, s, dtype=dtype, seed=1)
    alone = np.asarray(attend(q, [KeySegment(k, v)]))

    oq, ok, ov = _qkv(4, n, s, dtype=dtype, seed=2)  # other rows around it
    batch = attend(oq.at[2].set(q[0]), [KeySegment(ok.at[2].set(k[0]), ov.at[2].set(v[0]))])
    np.testing.assert_array_equal(np.asarray(batch[2]), alone[0])

    # scattered among masked keys (any layout), a width of other chunks
    width = 3 * KEY_CHUNK + 11
    where = np.sort(RNG.choice(width, s, replace=False))
    big_k, big_v = (jnp.zeros((1, width) + a.shape[2:], dtype).at[:, where].set(a) for a in (k, v))
    big_k = big_k + jnp.asarray(np.isin(np.arange(width), where, invert=True)[None, :, None, None], dtype) * 7
    mask = jnp.asarray(np.isin(np.arange(width), where))[None]
    np.testing.assert_array_equal(np.asarray(attend(q, [KeySegment(big_k, big_v, mask)])), alone)

    # behind an empty segment (the engine's shared list of a row that shares nothing)
    empty = KeySegment(ok[:1, :40], ov[:1, :40], jnp.zeros((1, 40), bool))
    np.testing.assert_array_equal(np.asarray(attend(q, [empty, KeySegment(k, v)])), alone)

    # the same queries at an offset inside a longer window of other queries
    off = 5
    longer = jnp.concatenate([oq[:1, :off], q, oq[:1, : 2 * QUERY_TILE]], axis=1)
    got = attend(longer, [KeySegment(k, v)])[:, off : off + n]
    np.testing.assert_array_equal(np.asarray(got), alone)


def _model(dtype: str) -> tuple[ModelConfig, dict]:
    """A model wide enough that a GEMM's blocking depends on its row count on the CPU (d_model 256, FFN 704)."""
    config = ModelConfig(
        family="llada", vocab_size=300, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
        mlp_hidden=704, rms_eps=1e-5, rope_theta=10000.0, rope_fp32=True, qkv_bias=False, tie_embeddings=False,
        max_seq_len=512, mask_token_id=299, eos_token_id=298, pad_token_id=297, dtype=dtype,
    )  # fmt: skip
    return config, init_params(config, jax.random.key(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_row_result_does_not_depend_on_its_batch(dtype):
    """A sequence's logits alone and as one row of a batch (other rows, left padding, a wider window): equal bit
    for bit in the batch-invariant mode."""
    config, params = _model(dtype)
    kernels = Kernels.resolve(KernelChoice(batch_invariant=True), config, params)
    n, width, pad = 37, 70, 9
    tokens = jnp.asarray(RNG.integers(0, 290, (1, n)), jnp.int32)
    alone = forward(params, config, tokens, jnp.arange(n)[None], kernels=kernels).logits

    others = jnp.asarray(RNG.integers(0, 290, (3, width)), jnp.int32)
    batch = others.at[1, pad : pad + n].set(tokens[0])
    positions = jnp.broadcast_to(jnp.arange(width), (3, width)).at[1].set(jnp.arange(width) - pad)
    mask = jnp.ones((3, width), bool).at[1].set((jnp.arange(width) >= pad) & (jnp.arange(width) < pad + n))
    got = forward(params, config, batch, positions, key_mask=mask, kernels=kernels).logits[1, pad : pad + n]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone[0], np.float32))


def _near_tie_model(dtype: str, eps: float):
    """The wide model with half its output vocabulary in near-twin pairs (column 2j + 1 = column 2j scaled by
    1 + eps N(0, 1), eps near the dtype's rounding), so that which twin wins depends on the last bits of the hidden
    state: any rounding that depends on the batch shows as a changed answer. (On the machine this was written on,
    the ordinary mode's engine answered 6 of `_requests`' 12 fp32 requests and 2 of its 12 bf16 ones differently
    from solo `generate`.)"""
    config, params = _model(dtype)
    w = np.array(params["lm_head"], np.float32)
    half = w.shape[1] // 2
    noise = np.random.default_rng(1).standard_normal((w.shape[0], half))
    w[:, 1 : 2 * half : 2] = w[:, 0 : 2 * half : 2] * (1 + eps * noise)
    return Model(config, {**params, "lm_head": jnp.asarray(w, config.jnp_dtype)})


def _requests(config, n: int, seed: int, affix: list[int] | None = None, attention: str = "auto") -> list[tuple]:
    """(prompt, config, seed, span): prompts of 3-70 tokens, alternating two settings (greedy at a fixed 4 steps a
    block and 8 tokens; temperature 0.7 with a confidence threshold and 4 tokens; the solo references compile one
    program each: the prompt region is one bucket); with an affix, ACache at ratio 0.2 around it (prefix, infix or
    suffix)."""
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        sampling, gen, steps = [(dict(), 8, 8), (dict(temperature=0.7, threshold=0.5), 4, 4)][i % 2]
        own = rng.integers(0, 290, int(rng.integers(3, 70))).tolist()
        span, technique = None, dict()
        if affix is not None:
            cut = [0, len(own) // 2, len(own)][i % 3]
            own, span, technique = own[:cut] + affix + own[cut:], (cut, cut + len(affix)), dict(affix="anchors")
        gc = GenerationConfig.from_options(
            gen_length=gen, block_length=4, steps=steps, cache="dual", stop_at_eos=False, batch_invariant=True,
            prompt_bucket=112, attention=attention, **sampling, **technique,
        )  # fmt: skip
        items.append((own, gc, int(rng.integers(1000)), span))
    return items


def _serve(model, items, max_batch: int = 4, attention: str = "auto") -> list[list[int]]:
    engine = Engine(
        model,
        EngineConfig(
            max_batch=max_batch, max_model_len=128, block_lengths=(4,), batch_invariant=True, kv_budget_bytes=1 << 25,
            window_chunk=32, min_affix_tokens=8, attention=attention,
        ),
    )  # fmt: skip
    ids = [engine.add_request(p, gc, affix=span, seed=seed) for p, gc, seed, span in items]
    while engine.has_unfinished():
        engine.step()
    return [engine.request(i).answer(()) for i in ids]


@pytest.mark.parametrize(
    "dtype,eps,attention,n",
    [("float32", 1e-7, "auto", 12), ("bfloat16", 1e-3, "auto", 12), ("float32", 1e-7, "pallas", 6)],
)
def test_engine_answers_equal_solo_generate_bit_for_bit(dtype, eps, attention, n):
    """Mixed requests decoded together in a batch-invariant engine (rows of other lengths, temperatures, samplers
    and step counts beside them, batches of 1 to 4) answer exactly what solo `generate` does on each (its prompt
    left-padded to another width), on a model where the last bit of a logit decides answers. "auto": the mode's
    attention of this machine (XLA's on the CPU, the slot kernel on a GPU); "pallas": the slot kernel, interpreted
    off the GPU."""
    model = _near_tie_model(dtype, eps)
    items = _requests(model.config, n, seed=3, attention=attention)
    served = _serve(model, items, attention=attention)
    for (prompt, gc, seed, _), answer in zip(items, served):
        solo = answer_tokens(generate(model, [prompt], gc, seed=seed).tokens, model.config, gc)[0]
        assert answer == solo, (len(prompt), gc.sampler, gc.schedule)


@pytest.mark.parametrize("attention", ["auto", "pallas"])
def test_shared_affix_answers_do_not_depend_on_their_batch(attention):
    """ACache requests (one shared copy of the affix, anchors from the probe) answer the same among other requests
    as alone in the engine; "pallas": through the slot kernel's two lists (the query rotated back by the placement)."""
    model = _near_tie_model("float32", 1e-7)
    affix = np.random.default_rng(4).integers(0, 290, 24).tolist()
    shared = _requests(model.config, 3, seed=5, affix=affix, attention=attention)  # prefix, infix, suffix
    others = _requests(model.config, 3, seed=6, attention=attention)
    together = _serve(model, [x for pair in zip(shared, others) for x in pair], attention=attention)[::2]
    alone = [_serve(model, [item], attention=attention)[0] for item in shared]
    assert together == alone


def test_the_mode_replaces_programs_rather_than_adding_them():
    """A batch-invariant engine warms as many programs as an ordinary one of the same settings (its programs replace
    the ordinary ones: serve's start-up is the same count of compilations)."""
    model = _near_tie_model("float32", 1e-7)
    settings = dict(max_batch=8, max_model_len=128, block_lengths=(4, 8), kv_budget_bytes=1 << 25)
    ordinary = Engine(model, EngineConfig(**settings))
    invariant = Engine(model, EngineConfig(**settings, batch_invariant=True))
    assert invariant.program_count() == ordinary.program_count() > 0
