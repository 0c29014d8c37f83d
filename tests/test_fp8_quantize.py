"""The fused activation quantisers of the FP8 FFN (pallas_kernels/fp8_quantize.py) and the kernel path of the FFN.

On the CPU the Triton kernels run interpreted (and the FP8 GEMM in the Mosaic GPU simulator); on a GPU compiled.
"""

import dataclasses

import fixtures
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.transformer import ffn
from dllm_jax.transformer import params as P
from dllm_jax.transformer.layers import RMSNorm
from dllm_jax.transformer.params import init_params, stack_layers, unstack_layers
from pallas_kernels import fp8_matmul as F
from pallas_kernels import fp8_quantize as Q

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _codes(q):
    return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _dequant(q, s_t):
    m, k = q.shape
    return (np.asarray(q.astype(jnp.float32)).reshape(m, k // 128, 128) * np.asarray(s_t).T[..., None]).reshape(m, k)


def _check_quantised(q, s_t, exact, m):
    """q/s_t quantise `exact` [m, K] (fp32) within e4m3 precision; rows m.. are zeros with scale 1."""
    mp, k = q.shape
    assert q.dtype == jnp.float8_e4m3fn and s_t.shape == (k // 128, mp) and s_t.dtype == jnp.float32
    back = _dequant(q, s_t)
    s = np.repeat(np.asarray(s_t).T, 128, axis=1)
    assert np.all(np.isfinite(back))
    # half an e4m3 step (2^-4 relative), the subnormal spacing, and a bf16 rounding step of the input for slack
    err = np.abs(back[:m] - exact)
    assert np.all(err <= 2.0**-4 * np.abs(exact) + 2.0**-9 * s[:m] + 2.0**-7 * np.abs(exact) + 1e-12)
    amax = np.abs(exact.reshape(m, k // 128, 128)).max(-1)
    np.testing.assert_allclose(np.asarray(s_t).T[:m], np.where(amax > 0, amax / 448.0, 1.0), rtol=2e-2)
    assert np.all(back[m:] == 0) and np.all(np.asarray(s_t)[:, m:] == 1.0)


NORM_CASES = [(1, 1, 128), (5, 64, 384), (33, 64, 896), (3, 128, 256)]  # ragged rows, 7 groups, pad rows


@pytest.mark.parametrize("m,m_pad,k", NORM_CASES)
def test_rmsnorm_quantize_matches_rmsnorm_then_quantise(m, m_pad, k):
    key = jax.random.key(m * 1000 + k)
    x = (jax.random.normal(key, (m, k)) * jnp.exp(jnp.linspace(-3, 3, k))).astype(jnp.bfloat16)
    x = x.at[0, :128].set(0.0)  # an all-zero group: scale 1, codes 0, never NaN
    w = (1 + 0.3 * jax.random.normal(jax.random.key(7), (k,))).astype(jnp.bfloat16)
    q, s_t = Q.rmsnorm_quantize(x, w, eps=1e-5, m_pad=m_pad, interpret=INTERPRET)
    h = RMSNorm(1e-5, jnp.bfloat16).apply({"params": {"scale": w}}, x)
    _check_quantised(q, s_t, np.asarray(h, np.float32), m)
    assert np.all(np.asarray(q[0, :128].astype(jnp.float32)) == 0) and float(s_t[0, 0]) == 1.0
    qr, sr = Q.rmsnorm_quantize_reference(x, w, 1e-5, m_pad)
    # the same codes but where a different fp32 summation order of the statistic flips a bf16 rounding
    assert np.mean(_codes(q) == _codes(qr)) > 0.97
    np.testing.assert_allclose(np.asarray(s_t), np.asarray(sr), rtol=1e-2)


@pytest.mark.parametrize("m,m_pad,k", [(5, 64, 384), (33, 64, 896)])
def test_rmsnorm_quantize_adds_the_residual_first(m, m_pad, k):
    """With residual=: the attention residual add in bf16 (returned exactly as x + r), then the same RMSNorm +
    quantisation as on that sum."""
    x = jax.random.normal(jax.random.key(k), (m, k)).astype(jnp.bfloat16)
    r = (3 * jax.random.normal(jax.random.key(k + 1), (m, k))).astype(jnp.bfloat16)
    w = (1 + 0.3 * jax.random.normal(jax.random.key(7), (k,))).astype(jnp.bfloat16)
    q, s_t, total = Q.rmsnorm_quantize(x, w, eps=1e-5, m_pad=m_pad, residual=r, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(x + r, np.float32))
    q1, s1 = Q.rmsnorm_quantize(x + r, w, eps=1e-5, m_pad=m_pad, interpret=INTERPRET)
    np.testing.assert_array_equal(_codes(q), _codes(q1))
    np.testing.assert_array_equal(np.asarray(s_t), np.asarray(s1))
    qr, sr, tr = Q.rmsnorm_quantize_reference(x, w, 1e-5, m_pad, residual=r)
    np.testing.assert_array_equal(np.asarray(tr, np.float32), np.asarray(total, np.float32))
    assert np.mean(_codes(q) == _codes(qr)) > 0.97
    with pytest.raises(ValueError, match="residual"):
        Q.rmsnorm_quantize(x, w, eps=1e-5, m_pad=m_pad, residual=r[:, :128], interpret=True)


SWIGLU_CASES = [(1, 64, 256), (3, 16, 384), (2, 128, 128)]


@pytest.mark.parametrize("splits,m_pad,f", SWIGLU_CASES)
def test_swiglu_quantize_sums_partials_then_quantises(splits, m_pad, f):
    gu = jax.random.normal(jax.random.key(splits + f), (splits, m_pad, 2 * f), jnp.float32) * 3
    arg = gu[0].astype(jnp.bfloat16) if splits == 1 else gu
    q, s_t = Q.swiglu_quantize_t(arg, interpret=INTERPRET)
    s = np.asarray(arg, np.float32).reshape(-1, m_pad, 2 * f).sum(0)
    s = np.asarray(jnp.asarray(s).astype(jnp.bfloat16), np.float32)
    g, u = s[:, :f], s[:, f:]
    exact = g / (1 + np.exp(-g)) * u
    assert q.shape == (m_pad, f)
    _check_quantised(q, s_t, exact, m_pad)
    qr, sr = Q.swiglu_quantize_t_reference(arg)
    assert np.mean(_codes(q) == _codes(qr)) > 0.97
    np.testing.assert_allclose(np.asarray(s_t), np.asarray(sr), rtol=1e-5)
    # rows past live_rows are the GEMM's pad rows: not read (poisoned here), zeros with scale 1 out
    live = m_pad // 2 + 1
    poisoned = arg.at[..., live:, :].set(jnp.nan)
    q2, s2 = Q.swiglu_quantize_t(poisoned, live_rows=live, interpret=INTERPRET)
    np.testing.assert_array_equal(_codes(q2)[:live], _codes(q)[:live])
    np.testing.assert_array_equal(np.asarray(s2)[:, :live], np.asarray(s_t)[:, :live])
    _check_quantised(q2, s2, exact[:live], live)


@pytest.mark.parametrize(
    "blocks",
    [Q.QuantizeBlocks(block_m=8, groups=2), Q.QuantizeBlocks(block_m=4, num_warps=2, groups=4)],
    ids=["8rows-2groups", "4rows-4groups"],
)
def test_swiglu_quantize_tilings_agree(blocks):
    """Every tiling of the SwiGLU quantiser (rows per program, several 128-wide groups per program) writes the same
    codes and scales as the default one, pad rows included."""
    gu = jax.random.normal(jax.random.key(3), (2, 16, 2 * 512), jnp.float32) * 3
    q0, s0 = Q.swiglu_quantize_t(gu, live_rows=13, interpret=INTERPRET)
    q1, s1 = Q.swiglu_quantize_t(gu, live_rows=13, blocks=blocks, interpret=INTERPRET)
    np.testing.assert_array_equal(_codes(q1), _codes(q0))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s0))
    with pytest.raises(ValueError, match="groups=3"):
        Q.swiglu_quantize_t(gu, blocks=Q.QuantizeBlocks(groups=3), interpret=INTERPRET)


def test_quantizer_default_tilings(monkeypatch):
    """The block-step tilings swept in v15 (8 rows per SwiGLU program up to 256 padded rows, 16 warps per RMSNorm row
    of >= 2048); the FFN plan carries them, and a default is read per call, outside the jitted body (a patched one
    applies to the next call with the same shapes instead of a cached trace)."""
    gu = jnp.ones((16, 2 * 256), jnp.bfloat16)
    Q.swiglu_quantize_t(gu, interpret=INTERPRET)  # traced and cached with the default tiling
    monkeypatch.setattr(Q.QuantizeBlocks, "for_swiglu", classmethod(lambda cls, mp: cls(block_m=32)))
    with pytest.raises(ValueError, match="block_m=32"):  # 16 rows: the patched tiling is refused, so it was read
        Q.swiglu_quantize_t(gu, interpret=INTERPRET)
    monkeypatch.undo()

    assert Q.QuantizeBlocks.for_swiglu(256) == Q.QuantizeBlocks(block_m=8, num_warps=4)
    assert Q.QuantizeBlocks.for_swiglu(4096).block_m == 64 and Q.QuantizeBlocks.for_swiglu(4).block_m == 4
    assert Q.QuantizeBlocks.for_rmsnorm(4096, 256).num_warps == 16
    assert Q.QuantizeBlocks.for_rmsnorm(128, 32).num_warps == 4
    assert Q.QuantizeBlocks.for_rmsnorm(4096, 4096).num_warps == 4  # block starts: not swept, unchanged
    plan = ffn.ffn_plan(256, 2 * 12288, 4096)
    assert not plan.fused and plan.swiglu_blocks == Q.QuantizeBlocks.for_swiglu(256)
    assert plan.norm_blocks == Q.QuantizeBlocks.for_rmsnorm(4096, 256)
    assert ffn.ffn_plan(32, 2 * 12288, 4096).swiglu_blocks is None  # fused into the gate/up GEMM's epilogue


def test_quantizer_errors():
    x = jnp.ones((4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        Q.rmsnorm_quantize(x, jnp.ones((128,), jnp.bfloat16), eps=1e-5, m_pad=64, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        Q.rmsnorm_quantize(
            jnp.ones((4, 200), jnp.bfloat16), jnp.ones((200,), jnp.bfloat16), eps=1e-5, m_pad=64, interpret=True
        )
    with pytest.raises(ValueError, match="m_pad=2"):
        Q.rmsnorm_quantize(x, jnp.ones((256,), jnp.bfloat16), eps=1e-5, m_pad=2, interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        Q.swiglu_quantize_t(jnp.ones((48, 512), jnp.bfloat16), blocks=Q.QuantizeBlocks(block_m=32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        Q.QuantizeBlocks(block_m=3)
    with pytest.raises(ValueError, match="2F=384"):
        Q.swiglu_quantize_t(jnp.ones((16, 384), jnp.bfloat16), interpret=True)


# ------------------------------------------------------------------------------ the FFN on the kernels
CFG = fixtures.fp8_config(n_layers=2)


@pytest.fixture(scope="module")
def unrolled_fp8():
    q, c8 = P.quantize_params(init_params(CFG, jax.random.key(0), std=0.05), CFG)
    return unstack_layers(q), c8


def test_kernel_scale_tables_built_once_and_dropped_when_stacked(unrolled_fp8):
    params, c8 = unrolled_fp8
    mlp = params["layers"][1]["mlp_fp8"]
    for src, w in P.KERNEL_SCALES.items():
        n, k = mlp[w].shape
        for cfg in (
            F.Fp8MatmulConfig(wg_dimension=F.Dim.N, wg_tile_n=64),  # 128-wide CTA tiles, and 256-wide
            F.Fp8MatmulConfig(wg_dimension=F.Dim.N, wg_tile_n=128, epi_tile_n=32),
        ):
            table = mlp[P.kernel_scale_key(src, F.ws_cols(cfg))]
            np.testing.assert_array_equal(np.asarray(table), np.asarray(F.kernel_weight_scales(mlp[src], n, cfg)))
    assert sorted(stack_layers(params, c8)["layers"]["mlp_fp8"]) == ["s_down", "s_gu", "w_down", "w_gu"]


def test_fp8_ffn_on_the_kernels_matches_the_xla_path(unrolled_fp8):
    params, c8 = unrolled_fp8
    lp = params["layers"][1]
    x = jax.random.normal(jax.random.key(3), (2, 21, CFG.d_model)).astype(jnp.bfloat16)  # 42 rows: padded to 64
    ref = ffn.fp8_ffn_residual(params, c8, lp, 1, x, backend="xla")
    out = ffn.fp8_ffn_residual(params, c8, lp, 1, x, backend="pallas", interpret=INTERPRET)
    d_ref = np.asarray(ref, np.float32) - np.asarray(x, np.float32)
    d_out = np.asarray(out, np.float32) - np.asarray(x, np.float32)
    assert float(np.abs(d_ref).max()) > 1e-2  # the FFN contributes
    # equal up to fp32 summation order (the RMSNorm statistic, split-K partials; identical in the CPU simulator)
    assert np.linalg.norm(d_out - d_ref) / np.linalg.norm(d_ref) < 2e-2
    # the kernel path reads the load-time scale tables: zeroing one removes the FFN's contribution
    cols = F.ws_cols(F.default_config(42, CFG.d_model, CFG.mlp_hidden))
    key = P.kernel_scale_key("s_down", cols)
    poisoned = {**lp, "mlp_fp8": {**lp["mlp_fp8"], key: jnp.zeros_like(lp["mlp_fp8"][key])}}
    np.testing.assert_array_equal(
        np.asarray(ffn.fp8_ffn_residual(params, c8, poisoned, 1, x, backend="pallas", interpret=INTERPRET)),
        np.asarray(x),
    )


def test_fp8_ffn_on_column_tiles_reads_their_load_time_table(monkeypatch):
    """The gate/up GEMM on column tiles (Dream-7B's block-step tiling; here on 2 "SMs" so the tiny FFN's 512 columns
    fill them): the load-time per-column table is built where the rule picks the tiling, the FFN equals the XLA
    path, and zeroing that table removes the FFN's contribution (so it is what the kernel reads)."""
    cfg_256 = dataclasses.replace(CFG, d_model=256, n_heads=8)  # K = 256: the column tiling's two K groups per stage
    q, c8 = P.quantize_params(init_params(cfg_256, jax.random.key(1), std=0.05), cfg_256)
    params = unstack_layers(q)
    monkeypatch.setattr(F, "TUNED_SMS", 2)
    lp = params["layers"][1]
    mlp = P.with_kernel_scales(P.without_kernel_scales(lp["mlp_fp8"]))
    n, k = mlp["w_gu"].shape
    cfg = F.column_small_m_config(32, n, k)
    assert cfg is not None and cfg.column_scales
    key = P.column_scale_key("s_gu", cfg)
    assert key in mlp and "s_down_col" not in " ".join(mlp)  # the down GEMM (128 columns) has no column tiling
    x = jax.random.normal(jax.random.key(5), (32, cfg_256.d_model)).astype(jnp.bfloat16)
    scale = lp["ffn_norm"]["scale"]
    ref = ffn.fp8_ffn_residual(params, c8, lp, 1, x[None], backend="xla")[0]
    out = ffn.fp8_ffn_pallas(x, scale, c8.rms_eps, mlp, INTERPRET, gate_up=(cfg, False))
    d_ref = np.asarray(ref, np.float32) - np.asarray(x, np.float32)
    d_out = np.asarray(out, np.float32) - np.asarray(x, np.float32)
    assert float(np.abs(d_ref).max()) > 1e-2
    assert np.linalg.norm(d_out - d_ref) / np.linalg.norm(d_ref) < 2e-2
    poisoned = {**mlp, key: jnp.zeros_like(mlp[key])}
    np.testing.assert_array_equal(
        np.asarray(ffn.fp8_ffn_pallas(x, scale, c8.rms_eps, poisoned, INTERPRET, gate_up=(cfg, False))), np.asarray(x)
    )


@pytest.mark.parametrize("layer", [0, 1])
def test_fp8_ffn_takes_the_attention_residual(unrolled_fp8, layer):
    """attn_out= (the model's path): s = x + attn_out then the FFN's residual block, on both backends and for the
    bf16 first layer, equal to adding first."""
    params, c8 = unrolled_fp8
    lp = params["layers"][layer]
    x = jax.random.normal(jax.random.key(5), (2, 21, CFG.d_model)).astype(jnp.bfloat16)
    o = (2 * jax.random.normal(jax.random.key(6), x.shape)).astype(jnp.bfloat16)
    for backend in ("xla", "pallas"):
        added = np.asarray(
            ffn.fp8_ffn_residual(params, c8, lp, layer, x + o, backend=backend, interpret=INTERPRET), np.float32
        )
        fused = np.asarray(
            ffn.fp8_ffn_residual(params, c8, lp, layer, x, backend=backend, interpret=INTERPRET, attn_out=o), np.float32
        )
        _same(fused, added, np.asarray(x + o, np.float32))
    # the stacked layers' scan path: a traced layer index (lax.cond), the same result
    traced = jax.jit(lambda i: ffn.fp8_ffn_residual(params, c8, lp, i, x, backend="xla", attn_out=o))(layer)
    _same(
        np.asarray(traced, np.float32),
        np.asarray(ffn.fp8_ffn_residual(params, c8, lp, layer, x + o, backend="xla"), np.float32),
        np.asarray(x + o, np.float32),
    )


def _same(a, b, residual):
    """Bit-equal on the CPU; on the GPU up to the e4m3 rounding noise of the FFN: under jit XLA may keep x + o in
    fp32 inside a fusion (excess precision), so codes at rounding boundaries flip (measured: 5.6% of the FFN's
    contribution on the H200; the two RMSNorm kernels alone are bit-equal there,
    test_rmsnorm_quantize_adds_the_residual_first). Ignoring attn_out would be ~14x the contribution here."""
    if ON_GPU:
        assert np.linalg.norm(a - b) / np.linalg.norm(b - residual) < 0.1
    else:
        np.testing.assert_array_equal(a, b)


def test_fp8_ffn_with_the_fused_swiglu_epilogue_matches_the_xla_path(unrolled_fp8):
    """The FFN on the gate/up kernel with the SwiGLU epilogue (256-wide tiles, as at block-step M on the GPU)."""
    params, c8 = unrolled_fp8
    lp = params["layers"][1]
    x = jax.random.normal(jax.random.key(8), (2, 21, CFG.d_model)).astype(jnp.bfloat16)
    o = jax.random.normal(jax.random.key(9), x.shape).astype(jnp.bfloat16)
    wide = F.Fp8MatmulConfig(wg_dimension=F.Dim.N, wg_tile_n=128, epi_tile_n=32, max_concurrent_steps=2)
    assert F.swiglu_fusable(wide)
    b, n, d = x.shape
    fused, unfused = (
        ffn.fp8_ffn_pallas(
            x.reshape(b * n, d),
            lp["ffn_norm"]["scale"],
            c8.rms_eps,
            lp["mlp_fp8"],
            INTERPRET,
            residual=o.reshape(b * n, d),
            gate_up=(wide, epilogue),
        )
        for epilogue in (True, False)
    )
    ref = ffn.fp8_ffn_residual(params, c8, lp, 1, x, backend="xla", attn_out=o).reshape(b * n, d)
    s = np.asarray(x + o, np.float32).reshape(b * n, d)
    d_ref = np.asarray(ref, np.float32) - s
    for out in (fused, unfused):
        assert np.linalg.norm(np.asarray(out, np.float32) - s - d_ref) / np.linalg.norm(d_ref) < 2e-2
    # bit-equal in the simulator; compiled, the epilogue's exp-based sigmoid may flip an e4m3 code
    _same(np.asarray(fused, np.float32), np.asarray(unfused, np.float32), s)


def test_fp8_layers_share_one_traced_body_of_kernels(monkeypatch):
    """Every FP8 layer of a model calls one traced body of FFN kernels (one jaxpr, so jax lowers each Mosaic GPU and
    Triton kernel once per program): lowered once per layer, LLaDA-8B's 31 FP8 layers made the first compile of a
    generate program take 126 s on the H200 (7.6 s in bf16)."""
    cfg = dataclasses.replace(CFG, n_layers=4)
    q, c8 = P.quantize_params(init_params(cfg, jax.random.key(0), std=0.05), cfg)
    params = unstack_layers(q)
    x = jnp.zeros((2, 21, cfg.d_model), jnp.bfloat16)

    def bodies():
        def forward(params, x):  # a new function per trace: make_jaxpr caches the trace of one
            for i, lp in enumerate(params["layers"]):
                x = ffn.fp8_ffn_residual(params, c8, lp, i, x, backend="pallas", attn_out=x)
            return x

        eqns = [
            e
            for e in jax.make_jaxpr(forward)(params, x).eqns
            if e.primitive.name in ("jit", "pjit") and e.params["name"] == "_fp8_ffn_kernels"
        ]
        return eqns, {id(e.params["jaxpr"]) for e in eqns}

    eqns, shared = bodies()
    assert len(eqns) == cfg.n_layers - 1 and len(shared) == 1  # layer 0 stays bf16
    body = [e.primitive.name for e in eqns[0].params["jaxpr"].jaxpr.eqns]
    # the shared body holds the kernels: the quantisers (jitted pallas_calls) and both GEMMs (the Mosaic GPU kernel
    # sits in a custom_vmap_call)
    assert body.count("custom_vmap_call") == 2 and body.count("jit") + body.count("pjit") >= 2, body
    # a tiling chosen differently at the next trace (a benchmark flipping a module switch) is a new body
    plan = ffn.gate_up_plan(42, 2 * cfg.mlp_hidden, cfg.d_model)
    monkeypatch.setattr(
        ffn, "gate_up_plan", lambda m, f2, d: (dataclasses.replace(plan[0], wg_tile_n=32, epi_tile_n=32), plan[1])
    )
    assert bodies()[1].isdisjoint(shared)


@pytest.mark.parametrize("splits,m,m_pad,d", [(4, 32, 64, 512), (2, 42, 64, 384), (3, 17, 128, 128)])
def test_splitk_residual_add_matches_sum_then_add(splits, m, m_pad, d):
    p = jax.random.normal(jax.random.key(m), (splits, m_pad, d), jnp.float32) * 3
    p = p.at[:, m:].set(jnp.nan)  # pad rows: never read into the output
    x = jax.random.normal(jax.random.key(d), (m, d)).astype(jnp.bfloat16)
    out = Q.splitk_residual_add(p, x, interpret=INTERPRET)
    ref = Q.splitk_residual_add_reference(p, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    with pytest.raises(ValueError, match="partials"):
        Q.splitk_residual_add(p[0], x, interpret=True)


def test_gate_up_plan_fuses_where_the_default_tiling_allows():
    assert ffn.gate_up_plan(32, 24576, 4096)[1]  # LLaDA-8B block step: 256-wide tiles, fused
    assert not ffn.gate_up_plan(32, 37888, 3584)[1]  # Dream-7B: column tiles (one wave) fill the waves better
    assert not ffn.gate_up_plan(256, 24576, 4096)[1]  # batch 8: 64-row warpgroup tiles along M
