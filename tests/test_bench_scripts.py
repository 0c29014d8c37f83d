"""GPU benchmark scripts end to end on the CPU with the tiny model: the GPU runs' code paths, their JSON and plots."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest


def _run(script: str, *args: str) -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = sys.argv
    sys.argv = [f"{script}.py", *args]
    try:
        mod.main()
    finally:
        sys.argv = argv


def test_bench_generate_smoke_layouts_and_fp8(tmp_path):
    _run("bench_generate", "--models", "tiny", "--batches", "1", "--modes", "dual", "--layer-layout", "unrolled",
         "--compare-stacked", "--fp8-ffn", "--compare-bf16", "--compare-v13", "--no-steps256",
         "--out", str(tmp_path))
    rows = json.loads((tmp_path / "generate_fp8_h200.json").read_text())["rows"]
    v13 = [r for r in rows if r.get("comparison") == "same-run v13 default kernels"]
    assert len(v13) == 1 and v13[0]["norm_rope_backend"] == "xla"
    rows = [r for r in rows if r not in v13]
    assert rows[1]["speedup_vs_v13_default"] == v13[0]["seconds"] / rows[1]["seconds"]
    # the same-run stacked comparison, the FP8 row on the layout asked for, and its same-run bf16 twin
    assert [(r["layer_layout"], r["fp8_ffn"], r.get("comparison")) for r in rows] == [
        ("stacked", True, "same-run stacked baseline"), ("unrolled", True, None),
        ("unrolled", False, "same-run bf16 baseline")]
    for r in rows:
        assert r["nfe"] == r["steps"] == 64 and r["tokens_per_s"] > 0 and r["ms_block_step"] > 0
    assert rows[1]["speedup_vs_bf16"] == rows[2]["seconds"] / rows[1]["seconds"]
    assert (tmp_path / "generate_fp8_h200.png").stat().st_size > 0


def test_bench_generate_step_loop_twin(tmp_path):
    _run("bench_generate", "--models", "tiny", "--batches", "2", "--modes", "dual", "--compare-step-loop",
         "--no-steps256", "--out", str(tmp_path))
    main, twin = json.loads((tmp_path / "generate_h200.json").read_text())["rows"]
    assert (main["step_loop"], twin["step_loop"]) == ("auto", "while")
    assert twin["comparison"] == "same-run step_loop while"
    assert main["speedup_vs_while_step_loop"] == twin["seconds"] / main["seconds"]
    assert twin["nfe"] == main["nfe"] == 64



def test_bench_generate_column_tiles_twin(tmp_path, monkeypatch):
    """--compare-column-tiles times the FP8 row's twin with fp8_matmul.COLUMN_TILES off (seen by the twin's timing,
    restored after) and records the speedup over it."""
    from pallas_kernels import fp8_matmul

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seen = []
    real = mod.bench_one
    monkeypatch.setattr(mod, "bench_one", lambda *a, **kw: (seen.append(fp8_matmul.COLUMN_TILES), real(*a, **kw))[1])
    monkeypatch.setattr(sys, "argv", ["bench_generate.py", "--models", "tiny", "--batches", "1", "--modes", "dual",
                                      "--fp8-ffn", "--compare-column-tiles", "--no-steps256", "--out", str(tmp_path)])
    before = fp8_matmul.COLUMN_TILES
    mod.main()
    assert seen == [before, False] and fp8_matmul.COLUMN_TILES == before
    main, twin = json.loads((tmp_path / "generate_fp8_h200.json").read_text())["rows"]
    assert twin["comparison"] == "same-run FP8 without column tiles" and twin["fp8_ffn"] is True
    assert main["speedup_vs_no_column_tiles"] == twin["seconds"] / main["seconds"]

def test_bench_sampling_smoke(tmp_path):
    _run("bench_sampling", "--cases", "tiny:2", "tiny:3", "--reps", "2", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "sampling_h200.json").read_text())["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 2), ("tiny", 3)]
    for r in rows:  # the alternative formulation picks what the engine does
        assert r["same_tokens"] and r["same_commits"] and r["conf_max_abs_diff"] < 1e-6
        assert r["us_engine"] > 0 and r["us_select"] > 0


def test_profile_block_step_smoke(tmp_path):
    _run("profile_block_step", "--models", "tiny", "--batches", "1", "--backends", "xla", "--variants", "unfused",
         "stacked_cache", "fp8_ffn", "fp8_ffn_v5", "xla_norm_rope", "--layer-layout",
         "unrolled", "--no-stages", "--no-gemms", "--trace", "--long-loop", "10", "--norm-rope", "pallas",
         "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "block_step_h200.json").read_text())["rows"]
    assert row["layer_layout"] == "unrolled" and row["ms_block_step"] > 0 and row["xla_baseline_ms"] > 0
    # the step on the fused norm/RoPE kernels (forced), and its XLA-ops twin in the same process
    assert row["norm_rope_backend"] == "pallas" and row["ms_xla_norm_rope"] > 0
    assert "marginal_ms" in row["long_loop_xla_norm_rope"]
    assert row["ms_unfused"] > 0 and row["ms_stacked_cache"] > 0  # both v4 choices reverted, same process
    assert row["fp8_ffn_speedup"] == row["ms_block_step"] / row["ms_fp8_ffn"]
    assert row["ms_floor_hbm"] > 0 and row["ms_floor_compute"] > 0 and not any(k.startswith("error") for k in row)
    assert "by_kind_ms" in row["trace_per_step"]  # empty on the CPU (no device plane), filled on a GPU
    assert "by_kind_ms" in row["trace_fp8_ffn"]  # the FP8 variant is traced too
    assert row["ms_fp8_ffn_v5"] > 0 and "by_kind_ms" in row["trace_fp8_ffn_v5"]  # and session 5's FP8 wrapper
    # the loop of 10 beside the loop of 8: the slope, what a call adds, the pass-through call's cost
    for ll in (row["long_loop"], row["long_loop_fp8_ffn"]):
        assert ll["steps"] == 10 and ll["ms_long"] > 0 and ll["dispatch_ms"] > 0 and "marginal_ms" in ll
        assert ll["mid_steps"] == 9 and isinstance(ll["linear"], bool)
    assert row["fp8_ffn_marginal_speedup"] == row["long_loop"]["marginal_ms"] / row["long_loop_fp8_ffn"]["marginal_ms"]


def test_profile_block_step_v14_options(tmp_path):
    """The RoPE/merge-kernel variants, XLA options per compile (one process), --layers and the HLO dump."""
    hlo = tmp_path / "hlo"
    _run("profile_block_step", "--models", "tiny", "--batches", "1", "--backends", "pallas", "--variants",
         "pallas_rope_merge", "v13_kernels", "--xla-options", "xla_gpu_autotune_level=1", "--layers", "1",
         "--layer-layout", "unrolled", "--no-stages", "--no-gemms", "--no-baseline", "--hlo-dir", str(hlo),
         "--long-loop", "10", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "block_step_h200.json").read_text())["rows"]
    assert row["layers"] == 1 and row["ms_pallas_rope_merge"] > 0 and row["ms_v13_kernels"] > 0
    assert row["ms_xla[xla_gpu_autotune_level=1]"] > 0
    assert "marginal_ms" in row["long_loop_xla[xla_gpu_autotune_level=1]"]  # the option's own loop slope (v15)
    assert not any(k.startswith("error") for k in row)
    import gzip

    assert "HloModule" in gzip.open(hlo / "tiny_b1.hlo.txt.gz", "rt").read()
    import profile_block_step

    assert profile_block_step.parse_compiler_options("xla_a=true,xla_b=3,xla_c=x") == {"xla_a": True, "xla_b": 3,
                                                                                        "xla_c": "x"}
    with pytest.raises(SystemExit, match="xla_NAME=VALUE"):
        profile_block_step.parse_compiler_options("autotune=1")


def test_loop_costs_split_a_call_into_steps_and_overhead():
    """8 steps in 10 ms and 40 in 42 ms: 1 ms per step and 2 ms per call; a long loop no slower is flagged."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import profile_block_step

    c = profile_block_step.loop_costs(0.010, 8, 0.042, 40)
    assert abs(c["marginal_ms"] - 1.0) < 1e-9 and abs(c["call_overhead_ms"] - 2.0) < 1e-9
    assert abs(c["ms_long"] - 1.05) < 1e-9 and "warning" not in c
    assert "warning" in profile_block_step.loop_costs(0.010, 8, 0.009, 40)
    # a third length: on the line (26 ms at 24 steps) is linear; 10% above it is not
    on = profile_block_step.loop_costs(0.010, 8, 0.042, 40, 0.026, 24)
    assert abs(on["mid_residual_ms"]) < 1e-9 and on["linear"] and on["mid_steps"] == 24
    off = profile_block_step.loop_costs(0.010, 8, 0.042, 40, 0.026 * 1.1, 24)
    assert not off["linear"] and abs(off["mid_residual_frac"] - 0.1 / 1.1) < 1e-9
    with pytest.raises(ValueError, match="between"):
        profile_block_step.loop_costs(0.010, 8, 0.042, 40, 0.05, 48)


def test_sweep_fp8_small_m_smoke(tmp_path):
    """The FP8 tiling sweep on the tiny model's FFN (the kernels simulated/interpreted): a row per quantiser and
    per GEMM tiling, each checked against the reference (no device time on the CPU)."""
    out = tmp_path / "fp8_small_m_h200.json"
    _run("sweep_fp8_small_m", "--models", "tiny", "--ms", "32", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows[:2]] == ["rmsnorm_quantize", "swiglu_quantize"]
    gemm = rows[2:]
    assert all(r["kind"] == "gemm" for r in gemm)  # no tail-split rows at the tiny shapes (one wave)
    assert [r["gemm"] for r in gemm if r["is_default"]] == ["gate_up", "down"] and gemm[0]["is_default"]
    assert all("error" not in r and r["rel_err"] < 1e-2 and r["stages"] >= 2 for r in gemm)


def test_sweep_fp8_tail_split_rows(monkeypatch):
    """The sweep's tail-split row (two kernels beside the one-kernel default) on a shape where the plan applies
    with the simulator's 4 SMs: the split's result checked against the reference, the plan recorded."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sweep_fp8_small_m
    from pallas_kernels import fp8_matmul as F

    monkeypatch.setattr(F, "TUNED_SMS", 4)
    (row,) = sweep_fp8_small_m.tail_split_rows("tiny", "gate_up", 1280, 512, 5)
    assert row["kind"] == "tail_split" and row["n_main"] == 1024 and row["tail"]["split_k"] == 2
    assert row["rel_err"] < 1e-2 and row["tail_split"] is None  # bf16 output; no device time on the CPU
    assert sweep_fp8_small_m.tail_split_rows("tiny", "down", 512, 1280, 5) == []  # 4 tiles: one whole wave


def test_fp8_kernel_profile_summary():
    """The in-kernel profile summary (bench/profile_fp8_kernel.py) on a hand-built trace of two warpgroups: step
    period, the pipeline's gap between steps and the per-range medians, the first step skipped."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import profile_fp8_kernel

    def step(tid, t0, wait):  # issue 1 us, wait, promote 1 us, then 2 us in the pipeline before the next step
        return [{"name": "issue", "ph": "B", "ts": t0, "tid": tid}, {"name": "issue", "ph": "E", "ts": t0 + 1, "tid": tid},
                {"name": "wait0", "ph": "B", "ts": t0 + 1, "tid": tid},
                {"name": "wait0", "ph": "E", "ts": t0 + 1 + wait, "tid": tid},
                {"name": "promote0", "ph": "B", "ts": t0 + 1 + wait, "tid": tid},
                {"name": "promote0", "ph": "E", "ts": t0 + 2 + wait, "tid": tid}]
    events = []
    for tid, wait in ((1, 3.0), (2, 5.0)):
        t = 0.0
        for i in range(4):
            events += step(tid, t, 50.0 if i == 0 else wait)  # the first step waits for the pipeline fill
            t += (52.0 if i == 0 else wait + 2) + 2
    s = profile_fp8_kernel.summarise_trace(events)
    assert s["warpgroups"] == 2 and s["steps_seen"] == 4
    assert s["step_period_us"] == 8.0 and s["pipeline_gap_us"] == 2.0  # (7 + 7 + 9 + 9) / 4 periods: median 8
    assert s["range_us"]["issue"] == 1.0 and s["range_us"]["promote0"] == 1.0


def test_fp8_gemm_rows_smoke():
    """The standalone FP8 GEMM rows (the FFN path's fp8_matmul with its wrapper): one row per M with the weight
    bandwidth; on the CPU the XLA reference runs and there is no device time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import profile_block_step

    rows = profile_block_step.fp8_gemm_rows(256, 384, ms=(32, 40), name="gate_up")
    assert [(r["kind"], r["proj"], r["M"], r["K"], r["N"]) for r in rows] == [
        ("gemm_fp8", "gate_up", 32, 256, 384), ("gemm_fp8", "gate_up", 40, 256, 384)]
    assert all(r["us"] > 0 and r["us_device"] is None and r["us_kernel"] is None for r in rows)


def test_kernel_kinds_and_trace_plot(tmp_path):
    """Kernel names seen in H200 traces map to their kinds; the plot draws traced rows (and says when none)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import kernel_trace
    import profile_block_step

    names = {"gemm_fusion_dot_131": "gemm", "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT": "gemm",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
             "loop_dynamic_update_slice_fusion_32": "cache_update", "memcpy128": "copy",
             "loop_add_fusion_61": "other", "input_concatenate_fusion_31": "other",
             "fp8_matmul_kernel_mosaic_gpu_kernel": "gemm"}  # Pallas Mosaic GPU kernels carry their function's name
    assert {n: kernel_trace.kind_of(n) for n in names} == names
    # idle time before each kernel on one stream: overlapping kernels leave none; any order of events
    gaps = kernel_trace.stream_gaps([("b", 3_000, 5_000), ("a", 0, 2_000), ("c", 4_500, 6_000), ("b", 9_000, 9_500)])
    assert gaps == {"b": [pytest.approx(1e-3 + 3e-3), 2]}
    row = {"model": "m", "batch": 1, "table": "v4", "ms_floor_hbm": 3.5, "ms_floor_compute": 0.6,
           "trace_per_step": {"by_kind_ms": {"gemm": 4.0, "attention": 0.3, "other": 0.4}}}
    assert not profile_block_step.plot([{**row, "trace_per_step": {}}], tmp_path / "none.png")
    # per model and batch: the first and the newest traced tables only (a middle one and comparison twins dropped)
    tabled = [{**row, "table": t} for t in ("v4", "v12_default", "v16")] + [{**row, "table": "v16", "comparison": "x"}]
    assert [b["label"] for b in profile_block_step.plotted_bars(tabled)] == ["v4", "v16"]
    assert profile_block_step.plot([row, {**row, "batch": 8}], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    (g,) = profile_block_step.gemm_rows(64, 128, ms=(8,), name="o")  # standalone GEMM row (no device time on CPU)
    assert g["proj"] == "o" and g["us"] > 0 and g["weight_TBps"] > 0 and g["us_device"] is None


def test_bench_attention_smoke(tmp_path, monkeypatch, capsys):
    """The attention benchmark end to end at tiny interpreted shapes: every column, the kernel's error vs the
    reference, and no FA3 yardstick off the GPU."""
    monkeypatch.setenv("BENCH_SMOKE", "1")  # read at import: tiny shapes, interpreted kernel
    out = tmp_path / "attention_h200.json"
    _run("bench_attention", "--out", str(out), "--shapes", "llada_block", "--inner", "1", "--outer", "1",
         "--repeats", "1")
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["case"].startswith("llada_block") for r in rows)
    for r in rows:
        assert r["pallas_us"] > 0 and r["cudnn_contiguous_us"] > 0 and r["xla_gather_cudnn_us"] > 0
        assert r["rel_err"] < 1e-2 and r["rel_err_contiguous"] < 1e-2
        assert r["mgpu_fa3_contiguous_us"] is None and r["mgpu_fa3_config"] is None
        # no device trace on the CPU: the device columns and their ratios are None, not made up
        assert r["pallas_device_us"] is None and r["speedup_vs_cudnn_device"] is None and "run" not in r
    assert out.with_suffix(".png").stat().st_size > 0
    # --run merges into the file: earlier rows kept, a rerun of the same label replaces only its own rows
    first = len(rows)
    for _ in range(2):
        _run("bench_attention", "--out", str(out), "--shapes", rows[0]["case"], "--inner", "1",
             "--outer", "1", "--repeats", "1", "--run", "r2", "--note", "merge test")
    data = json.loads(out.read_text())
    assert len(data["rows"]) == first + 1 and data["rows"][-1]["run"] == "r2"
    summary = capsys.readouterr().out.rsplit("vs_gath\n", 1)[1]  # the last run's table: its one row
    assert summary.startswith(rows[0]["case"]) and summary.count("\n") == 2
    assert data["rows"][:first] == rows and data["meta"]["runs"]["r2"]["note"] == "merge test"


def test_check_gemm_out_dtype_smoke(tmp_path):
    """The bf16-out GEMM check: on the CPU a GEMM that emits bf16 equals fp32-out-then-round bit for bit (what
    layers.Linear relies on for the CPU exactness tests); every row is written."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import check_gemm_out_dtype

    check_gemm_out_dtype.main(["--ms", "8", "33", "--tiny", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "gemm_out_dtype_h200.json").read_text())["rows"]
    assert len(rows) == 2 * 5 and all(r["bitwise_equal"] and r["max_abs_diff"] == 0.0 for r in rows)


def test_fp8_sweep_candidates_by_regime(monkeypatch):
    """The FP8 sweeps' candidate tilings: two-CTA clusters along both axes when compute bound, along M (weights read
    once) at M = 256, none at block-step M; both epilogue widths of grouped tilings, the one-slot epilogue and the
    overlap_steps twins where they apply; bench_fp8_matmul's steps back from the large-M default."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_matmul
    import jax.numpy as jnp
    import sweep_fp8_small_m
    from pallas_kernels import fp8_matmul as F

    for flag, value in (("CLUSTER_FROM_M", 1024), ("ONE_SLOT_EPILOGUE", True), ("OVERLAP_STEPS", False),
                        ("GROUPS_PER_STEP", None), ("WIDE_SMALL_M", True)):
        monkeypatch.setattr(F, flag, value)  # the defaults, whatever FP8_* say

    def clusters(m, n, k):
        return {c.cluster_dimension for c in sweep_fp8_small_m.candidates(m, n, k)} - {None}

    assert clusters(4096, 24576, 4096) == {F.Dim.M, F.Dim.N} and clusters(256, 24576, 4096) == {F.Dim.M}
    assert clusters(32, 24576, 4096) == set()
    assert sweep_fp8_small_m.candidates(4096, 24576, 4096)[0] == F.default_config(4096, 24576, 4096)
    # every grouped tiling with both epilogue widths (3 stages on the 32-wide one, 2 on the 64-wide at M = 4096)
    grouped = [c for c in sweep_fp8_small_m.candidates(4096, 24576, 4096, grid=False) if c.groups_per_step == 2]
    stages = {(c.epi_tile_n, c.cluster_dimension): F.stages_that_fit(c, jnp.bfloat16) for c in grouped}
    assert stages == {(e, cl): 3 if e == 32 else 2 for e in (32, 64) for cl in (None, F.Dim.M, F.Dim.N)}
    # the overlap_steps twins on the GPU only (the simulator cannot run them), where 3 stages fit
    assert not any(c.overlap_steps for c in sweep_fp8_small_m.candidates(4096, 24576, 4096, overlap=False))
    twins = [c for c in sweep_fp8_small_m.candidates(4096, 24576, 4096, overlap=True) if c.overlap_steps]
    assert twins and all(F.stages_that_fit(c, jnp.bfloat16) >= 3 for c in twins)
    down256 = sweep_fp8_small_m.candidates(256, 4096, 12288, grid=False)
    assert any(c.out_slots == 1 and c.groups_per_step == 2 for c in down256)  # split-K's fp32 epilogue: one slot
    assert down256[0].out_slots == 1  # the default since v10, with the v9 default (two 64-wide slots) beside it
    assert any(c.out_slots == 2 and c.epi_tile_n == 64 and c.groups_per_step == 1 and c.cluster_dimension is None
               for c in down256)
    assert len(sweep_fp8_small_m.candidates(256, 4096, 12288, grid=False)) < len(
        sweep_fp8_small_m.candidates(256, 4096, 12288))
    # bench_fp8_matmul at large M: the default (clustered, grouped, 3 stages) and its steps back to the v8 default
    default = F.default_config(4096, 12288, 4096)
    no_cluster, v8, one_group = bench_fp8_matmul.alt_configs(4096, 12288, 4096)
    assert default.cluster_dimension == F.Dim.N and no_cluster.cluster_dimension is None
    assert (default.epi_tile_n, no_cluster.epi_tile_n, v8.epi_tile_n) == (32, 32, 64)
    assert (v8.groups_per_step, one_group.groups_per_step) == (2, 1)


def test_fp8_plot_takes_the_last_row_of_the_engines_tiling():
    """bench_fp8_matmul's plot: per shape the last row, skipping tilings timed beside the engine's (is_default False,
    v17a's column-tile rows), so an experiment appended after the default never stands in for it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_matmul

    base = dict(model="m", N=256, K=128, M=32)
    rows = [dict(base, run="old"), dict(base, run="new", is_default=True), dict(base, run="new", is_default=False),
            dict(base, M=64, run="x")]
    assert bench_fp8_matmul.latest_rows(rows) == [rows[1], rows[3]]


def test_generate_plot_takes_the_newest_row_per_bar():
    """The tokens/s plot shows each (model, mode, batch)'s newest row by date, never a comparison twin (the committed
    file keeps every run; before v15 the plot showed the first, session 4's, rows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_generate

    base = dict(model="m", mode="dual", batch=1, steps=64)
    rows = [dict(base, run="old", date="2026-11-30T00:00:00+00:00", tokens_per_s=1.0),
            dict(base, run="new", date="2026-12-01T00:00:00+00:00", tokens_per_s=2.0, comparison=None),
            dict(base, run="new", date="2026-12-01T00:00:00+00:00", tokens_per_s=9.0, comparison="same-run twin"),
            dict(base, run="other", date="2026-12-02T00:00:00+00:00", tokens_per_s=5.0, steps=256)]
    assert bench_generate.newest_rows(rows) == {("m", "dual", 1): rows[1]}


def test_fp8_sweep_v15_candidates():
    """(v15) The sweep's pingpong twins (every tiling with the other schedule, none of overlap_steps'), its --focus
    set (the default and its 1/2-group twins) and the SwiGLU quantiser's tilings (the default first, each dividing
    the padded rows and the groups)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sweep_fp8_small_m
    from pallas_kernels import fp8_matmul as F
    from pallas_kernels import fp8_quantize as Q

    plain = sweep_fp8_small_m.candidates(256, 24576, 4096, grid=False, overlap=True, pingpong=False)
    both = sweep_fp8_small_m.candidates(256, 24576, 4096, grid=False, overlap=True, pingpong=True)
    assert not any(c.pingpong for c in plain)
    twins = {c for c in both if c.pingpong}
    assert twins == {dataclasses.replace(c, pingpong=True) for c in plain if not c.overlap_steps}
    focus = sweep_fp8_small_m.candidates(256, 24576, 4096, focus=True, pingpong=True)
    assert focus[0] == F.default_config(256, 24576, 4096)
    assert {(c.groups_per_step, c.pingpong) for c in focus} == {(1, False), (2, False), (1, True), (2, True)}
    blocks = sweep_fp8_small_m.swiglu_block_candidates(256, 12288)
    assert blocks[0] == Q.QuantizeBlocks.for_swiglu(256) and len(set(blocks)) == len(blocks) > 20
    assert all(256 % b.block_m == 0 and 96 % b.groups == 0 for b in blocks)
    assert all(b.block_m <= 16 for b in sweep_fp8_small_m.swiglu_block_candidates(16, 12288))


def test_bench_fp8_matmul_row_on_cpu(monkeypatch):
    """One row of the FP8 GEMM benchmark on the CPU (the kernel in the GPU simulator): with alternatives timed, the
    row reports the DEFAULT config's times (not the fastest candidate's), keeps every candidate, and fills the
    baselines and speedups from the same (stubbed) timer; without a stub it runs end to end with rel_err checked."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_matmul
    from pallas_kernels import fp8_matmul as F

    row = bench_fp8_matmul.bench_shape("llada", 64, 256, 256, tune=False)
    assert row["candidates"][0]["is_default"] and row["fp8_us"] == row["candidates"][0]["us"] > 0
    assert row["xla_bf16_us"] > 0 and row["speedup_vs_bf16"] > 0 and row["rel_err"] < 1e-2

    times = iter(range(100, 0, -1))  # each later call is faster: the alternatives beat the default

    def fake_timeit(fn, args_list, reps=5, device=False, kernel="fp8_matmul_kernel"):
        t = float(next(times))
        return (t, t / 2, t / 4) if device else t

    monkeypatch.setattr(bench_fp8_matmul, "timeit", fake_timeit)
    # compute-bound M (alternatives: the steps back from the default); the kernel replaced by its reference so the
    # simulator does not run 4096 rows
    monkeypatch.setattr(F, "fp8_matmul", lambda xq, xs, wq, ws, **kw: F.fp8_matmul_reference(xq, xs, wq, ws))
    row = bench_fp8_matmul.bench_shape("llada", 4096, 512, 512, tune=True)
    cands = row["candidates"]
    assert len(cands) > 1 and cands[0]["is_default"] and min(c["us"] for c in cands) < cands[0]["us"]
    assert (row["fp8_us"], row["fp8_device_us"], row["fp8_kernel_us"]) == (
        cands[0]["us"], cands[0]["device_us"], cands[0]["kernel_us"])
    assert row["speedup_vs_bf16_device"] == row["xla_bf16_device_us"] / row["fp8_device_us"]


def test_dump_fp8_mlir_shows_contractible_promotion(tmp_path):
    """The MLIR dump of the FP8 GEMM (CPU, CUDA lowering): wgmma on e4m3, and every fp32 multiply / add of the
    per-group promotion carries fastmath<contract> (so LLVM fuses them into one FMA per accumulator register: the
    v9 finding that the promotion's arithmetic is already minimal)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import dump_fp8_mlir

    dump_fp8_mlir.main(["--m", "64", "--n", "256", "--k", "256", "--out", str(tmp_path)])
    lowered = (tmp_path / "lowered.mlir").read_text()
    assert "wgmma.mma_async.sync.aligned.m64n" in lowered and ".e4m3.e4m3" in lowered
    arith = [line for line in lowered.splitlines() if "arith.mulf" in line or "arith.addf" in line]
    assert arith and all("fastmath<contract>" in line for line in arith)
    assert "mosaic_gpu.broadcast_in_dim" in (tmp_path / "layouts.mlir").read_text()


def test_probe_fp8_harness_rows_and_tilings(monkeypatch, tmp_path):
    """The harness probe times every operand recipe under every harness (6 rows), and --tilings the default beside
    distinct valid neighbours, each checked against the reference; both write their JSON. The timers and the
    kernel are stubbed (the simulator would run each tiling 24 times)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_matmul
    import probe_fp8_harness as probe
    import sweep_fp8_small_m
    from pallas_kernels import fp8_matmul as F

    seen = []
    monkeypatch.setattr(bench_fp8_matmul, "timeit", lambda fn, args, device=False, **kw: (seen.append(len(args)),
                        (1.0, 2.0, 3.0))[1])
    monkeypatch.setattr(sweep_fp8_small_m, "device_us", lambda fn, args, name: (seen.append(len(args)), 4.0)[1])
    rows = probe.probe(256, 512, 256)
    assert {(r["operands"], r["harness"]) for r in rows} == {
        (o, h) for o in ("table_operands", "sweep_operands")
        for h in ("separate_calls_padded", "one_program_wrapper", "one_program_padded")}
    # every harness gets the same number of operand sets (one on the CPU, four on a GPU)
    assert seen == [bench_fp8_matmul.R] * 6 and sweep_fp8_small_m.SETS == bench_fp8_matmul.R
    assert sorted(r["kernel_us"] for r in rows) == [3.0] * 4 + [4.0] * 2

    variants = probe.tiling_variants(256, 24576, 4096)
    assert variants["default"] == F.default_config(256, 24576, 4096)
    assert len(set(variants.values())) == len(variants) and "cta_along_n" in variants
    # the kernel on its padded layouts, replaced by the reference on the same operands
    monkeypatch.setattr(F, "kernel_weight_scales", lambda ws, n, cfg: ws)
    calls = []
    monkeypatch.setattr(F, "fp8_matmul_padded", lambda xq_p, xs_t, wq, ws, cfg, **kw: (
        calls.append(cfg), F.fp8_matmul_reference(xq_p, xs_t.T, wq, ws))[1])
    out = tmp_path / "tilings.json"
    _run("probe_fp8_harness", "--shape", "256x512x256", "--tilings", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(probe.tiling_variants(256, 512, 256))
    assert all(r["rel_err"] < 1e-2 and r["kernel_us"] == 3.0 for r in rows), rows
    assert len(set(calls)) == len(rows)  # each tiling ran (once for rel_err, once per timed set)



def test_probe_fp8_m256_variants(monkeypatch, tmp_path):
    """The M = 256 probe on the simulator at a small shape: early_release's output is bit-identical to the default
    tiling's, no_mma's differs (the replaced wgmma reached the kernel), and a second run merges into the same JSON
    (rows appended, both runs in meta.runs). The timer is stubbed; each variant's kernel still runs once."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_fp8_matmul

    monkeypatch.setattr(bench_fp8_matmul, "timeit", lambda fn, args, device=False, **kw: (1.0, 2.0, 3.0))
    _run("probe_fp8_m256", "--shapes", "64x256x256", "--variants", "early", "no_mma", "--run", "a",
         "--out", str(tmp_path))
    data = json.loads((tmp_path / "fp8_m256_probe_h200.json").read_text())
    by_variant = {r["variant"]: r for r in data["rows"]}
    assert list(by_variant) == ["default", "early", "no_mma"]  # the default is always timed first
    assert by_variant["early"]["bit_identical"] is True and by_variant["early"]["config"]["early_release"]
    assert by_variant["no_mma"]["equals_default"] is False and by_variant["default"]["kernel_us"] == 3.0
    _run("probe_fp8_m256", "--shapes", "64x256x256", "--variants", "default", "--run", "b", "--out", str(tmp_path))
    data = json.loads((tmp_path / "fp8_m256_probe_h200.json").read_text())
    assert [r["run"] for r in data["rows"]] == ["a", "a", "a", "b"] and set(data["meta"]["runs"]) == {"a", "b"}

def test_sweep_block_attention_smoke(tmp_path, monkeypatch):
    """The block-step attention sweep at a tiny interpreted GQA shape: the default tiling among the timed rows, the
    split rows and the bf16-partials twin, each with the kernel's error against the fp32 reference."""
    monkeypatch.setenv("BENCH_SMOKE", "1")  # read at import: tiny shapes, interpreted kernel
    out = tmp_path / "sweep.json"
    _run("sweep_block_attention", "--out", str(out), "--shapes", "tiny_gqa")
    rows = json.loads(out.read_text())["rows"]
    assert {r["case"] for r in rows} == {"tiny_gqa_b2"}
    assert sum(1 for r in rows if r.get("is_default")) == 1
    assert {"tiles", "splits", "bf16_partials"} <= {r["kind"] for r in rows}
    for r in rows:
        assert "error" not in r and r["wall_us"] > 0 and r["rel_err"] < 1e-2


def test_profile_attention_tiling_variants_patch_the_heuristic():
    """pallas_attn_v12_tiles puts v12's tiling back for the duration (LLaDA batch 1: 64-key tiles on 2 stages, against
    the default's unpipelined 128-key one-tile splits) and pallas_attn_bf16_partials turns the bf16 partials on."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import profile_block_step as pbs
    from pallas_kernels import slot_attention as sa

    shape = dict(batch=1, q_len=32, kv_len=512, q_heads=32, kv_heads=32, head_dim=128)
    now = sa.BlockSizes.get_default(**shape)
    assert (now.block_k, now.num_stages) == (128, 1)
    with pbs.variant("pallas_attn_v12_tiles"):
        old = sa.BlockSizes.get_default(**shape)
    assert (old.block_k, old.num_stages) == (64, 2)
    assert sa.BlockSizes.get_default(**shape) == now
    with pbs.variant("pallas_attn_bf16_partials"):
        assert sa.BF16_PARTIALS is True
    assert sa.BF16_PARTIALS is False


def test_trace_generate_smoke_and_copy_search(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import trace_generate

    hlo = ("ENTRY %main {\n  %copy.1 = bf16[2,64,4,32]{3,2,1,0} copy(%p), metadata={}\n"
           "  %copy.2 = bf16[2,4,64,32]{3,2,1,0} copy(%q)\n}\n"
           "%body.3 {\n  %copy.4 = bf16[2,64,4,32]{3,2,1,0} copy(%r)\n}\n")
    found = trace_generate.cache_copies(hlo, "[2,64,4,32]")
    assert sorted((c["computation"], c["n"]) for c in found) == [("%body.3", 1), ("ENTRY", 1)]
    _run("trace_generate", "--model", "tiny", "--batch", "2", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "generate_trace_h200.json").read_text())["rows"]
    assert row["model"] == "tiny" and row["seconds"] > 0 and row["cache_shape"].startswith("[2,")
    assert row["cache_copies"] == []  # the cache is updated in place (on the CPU's compile, as on the H200's)
    # a second, labelled run appends its row and keeps the first run's meta.runs entry
    path = tmp_path / "generate_trace_h200.json"
    data = json.loads(path.read_text())
    data["meta"]["runs"] = {"old": {"note": "an earlier run"}}
    path.write_text(json.dumps(data))
    _run("trace_generate", "--model", "tiny", "--batch", "2", "--out", str(tmp_path), "--run", "new", "--note", "n")
    data = json.loads(path.read_text())
    assert [r.get("run") for r in data["rows"]] == [None, "new"]
    assert data["meta"]["runs"]["old"] == {"note": "an earlier run"} and data["meta"]["runs"]["new"]["note"] == "n"


def test_bench_acache_smoke(tmp_path):
    """bench_acache: dual and ACache rows of one batch, the same-run ratio, the shorter block-start window."""
    _run("bench_acache", "--model", "tiny", "--batches", "2", "--ratios", "0.25", "--shallow-depths", "1",
         "--affix-len", "40", "--request-len", "8", "--out", str(tmp_path))
    data = json.loads((tmp_path / "acache_cpu_smoke.json").read_text())
    dual, anchors, shallow = data["rows"]
    assert (dual["mode"], anchors["mode"], shallow["mode"]) == ("dual", "anchors_0.25", "shallow_1")
    assert dual["nfe"] == 64 and anchors["nfe"] == 65 and shallow["nfe"] == 64  # ACache's probe
    assert anchors["speedup_vs_dual"] == dual["seconds"] / anchors["seconds"]
    assert anchors["block_start_window_tokens"] == 10 + 8 + 256 < dual["block_start_window_tokens"] == 64 + 256
    assert shallow["shallow_depth"] == 1 and shallow["ms_block_start"] > 0
    assert data["meta"]["affix_length"] == 40 and min(data["meta"]["shared_build_ms"].values()) > 0
    assert (tmp_path / "acache_cpu_smoke.png").stat().st_size > 0


def test_profile_bicache_smoke(tmp_path):
    """profile_bicache on the bundled model: a table keyed from 0, per-bucket curves of one value per layer."""
    _run("profile_bicache", "--n", "2", "--gen-lengths", "8", "64", "--out", str(tmp_path / "p.json"))
    data = json.loads((tmp_path / "p.json").read_text())
    table = {int(k): v for k, v in data["table"].items()}
    assert min(table) == 0 and list(table.values()) == sorted(table.values())
    strict = {int(k): v for k, v in data["table_strict"].items()}
    assert strict[0] == table[0] - 1
    curves = data["mean_similarity_per_layer"]
    assert len(curves) >= 2 and all(len(c) == 6 and abs(c[0] - 1) < 1e-4 for c in curves.values())
    assert (tmp_path / "p.png").stat().st_size > 0
