"""The benches end to end on the CPU at tiny shapes: the GPU runs' code paths, their JSON and plots.

quality.py and train_demo.py are run by tests/test_quality_smoke.py and tests/test_demo_model.py."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import fixtures
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(script: str):
    spec = importlib.util.spec_from_file_location(script, BENCH / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(script: str, *args: str):
    mod = _load(script)
    argv = sys.argv
    sys.argv = [f"{script}.py", *args]
    try:
        mod.main()
    finally:
        sys.argv = argv
    return mod


def test_bench_generate_fp8_bf16_twin_loop_and_trace(tmp_path):
    """The FP8 row (every GEMM past layer 1) on the GPU's layer layout and its same-run bf16 twin (--twin
    FIELD=VALUE rows take the same path); the forwards per call of 8 and per step in a longer loop, the floors, the
    (empty on the CPU) trace."""
    _run(
        "bench_generate",
        "--models",
        "tiny",
        "--batches",
        "1",
        "--modes",
        "dual",
        "--layer-layout",
        "unrolled",
        "--weights",
        "fp8_all",
        "--compare-bf16",
        "--loop",
        "10",
        "--trace",
        "--run",
        "r1",
        "--out",
        str(tmp_path),
    )
    data = json.loads((tmp_path / "generate_fp8_h200.json").read_text())
    fp8, bf16 = data["rows"]
    assert [(r["weights"], r["comparison"]) for r in data["rows"]] == [("fp8_all", None), ("bf16", "same-run bf16")]
    assert fp8["speedup_vs_bf16"] == bf16["seconds"] / fp8["seconds"]
    assert fp8["block_step_speedup_vs_bf16"] == bf16["ms_block_step"] / fp8["ms_block_step"]
    for r in data["rows"]:
        assert r["nfe"] == r["steps"] == 64 and r["tokens_per_s"] > 0 and r["run"] == "r1"
        assert r["ms_block_step"] > 0 and r["ms_block_start"] > 0 and r["loop_steps"] == 10
        assert r["ms_floor_hbm"] > 0 and r["ms_floor_compute"] > 0 and "by_kind_ms" in r["trace_block_step"]
        assert (
            r["floor_ms_block_step"] == max(r["ms_floor_hbm"], r["ms_floor_compute"]) and r["floor_rates"] == "this run"
        )
        assert r["block_step_of_floor"] == r["floor_ms_block_step"] / r["ms_block_step"]
        assert r["floor_ms_block_start"] > r["floor_ms_block_step"] and r["block_start_of_floor"] > 0
    rates = data["meta"]["runs"]["r1"]["floors"]  # measured in the run: a copy and two square GEMMs
    assert rates["hbm_bytes_per_s"] > 0 and rates["bf16_flops_per_s"] > 0 and rates["e4m3_flops_per_s"] > 0
    # the e4m3 FLOPs are counted apart: fp8_all's compute floor is below its bf16 twin's only where e4m3 is faster
    assert fp8["ms_floor_compute"] != bf16["ms_floor_compute"]
    assert data["meta"]["runs"]["r1"]["command"].endswith(f"--out {tmp_path}")
    assert (tmp_path / "generate_fp8_h200.png").stat().st_size > 0


def test_bench_generate_helpers():
    """--twin parses generation options; the plot takes each (model, mode, batch)'s newest primary row."""
    bg = _load("bench_generate")
    assert bg.parse_twin("attention=cudnn") == ("attention", "cudnn")
    assert bg.parse_twin("threshold=0.9") == ("threshold", 0.9) and bg.parse_twin("stop_at_eos=false")[1] is False
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        bg.parse_twin("no_such_field=1")
    base = dict(model="m", mode="dual", batch=1, steps=64)
    rows = [
        dict(base, date="2026-11-30", tokens_per_s=1.0),
        dict(base, date="2026-12-01", comparison=None),
        dict(base, date="2026-12-02", comparison="same-run bf16"),
        dict(base, date="2026-12-03", steps=256),
    ]
    assert bg.newest_rows(rows) == {("m", "dual", 1): rows[1]}
    # one chart, one card: the rows of the GPU most rows ran on, whatever is newer elsewhere
    runs = [dict(base, date=f"2026-12-0{i}", run=run, comparison=None) for i, run in enumerate("aab", 1)]
    gpus = {"a": "NVIDIA H200", "b": "NVIDIA H100 80GB HBM3"}
    assert bg.plotted_gpu(runs, gpus) == "NVIDIA H200"
    assert (
        bg.newest_rows(runs, gpus=gpus) == {("m", "dual", 1): runs[1]}
        and bg.newest_rows(runs)[("m", "dual", 1)] == runs[2]
    )
    unnamed = dict(base, model="n", date="2026-12-09", comparison=None)  # an older row: its run names no GPU
    assert bg.newest_rows([*runs, unnamed], gpus=gpus)[("n", "dual", 1)] == unnamed


def test_results_merge_by_run_and_kernel_kinds(tmp_path):
    """Rows of other runs stay in the file, a rerun of a label replaces only its rows; kernel names map to kinds
    and a stream's idle time is given to the kernel after it."""
    sys.path.insert(0, str(BENCH))
    from tools import common, trace

    common.write_results("x.json", {"a": 1}, [{"v": 1}, {"v": 2}], tmp_path, run="old")
    for v in (3, 4):
        path = common.write_results("x.json", {"b": v}, [{"v": v}], tmp_path, run="new")
    data = json.loads(path.read_text())
    assert [(r["run"], r["v"]) for r in data["rows"]] == [("old", 1), ("old", 2), ("new", 4)]
    assert data["meta"]["runs"] == {"old": {"a": 1}, "new": {"b": 4}}
    names = {
        "gemm_fusion_dot_131": "gemm",
        "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "loop_dynamic_update_slice_fusion_32": "cache_update",
        "memcpy128": "copy",
        "loop_add_fusion_61": "other",
        "fp8_matmul_kernel_mosaic_gpu_kernel": "gemm",
    }
    assert {n: trace.kind_of(n) for n in names} == names
    gaps = trace.stream_gaps([("b", 3_000, 5_000), ("a", 0, 2_000), ("c", 4_500, 6_000), ("b", 9_000, 9_500)])
    assert gaps == {"b": [pytest.approx(1e-3 + 3e-3), 2]}


def test_bench_attention_smoke(tmp_path):
    """Every column at a tiny interpreted block-step shape, the kernel's error against the fp32 reference, no device
    columns off the GPU."""
    out = tmp_path / "attention_h200.json"
    _run(
        "bench_attention",
        "--out",
        str(out),
        "--shapes",
        "llada_block",
        "--inner",
        "1",
        "--outer",
        "1",
        "--repeats",
        "1",
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and all(r["case"].startswith("llada_block") for r in rows)
    for r in rows:
        assert r["pallas_us"] > 0 and r["pallas_contiguous_us"] > 0 and r["cudnn_contiguous_us"] > 0
        assert r["xla_gather_cudnn_us"] > 0 and r["speedup_vs_cudnn"] > 0
        assert r["rel_err"] < 1e-2 and r["rel_err_contiguous"] < 1e-2 and r["rel_err_cudnn"] < 1e-2
        assert r["pallas_device_us"] is None and r["speedup_vs_cudnn_device"] is None
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_fp8_matmul_smoke(tmp_path):
    """One row at a tiny shape with the kernel in the Mosaic GPU simulator: wall times, the baselines, the error
    against the reference, the default tiling recorded; no device times off the GPU."""
    out = tmp_path / "fp8_matmul_h200.json"
    _run("bench_fp8_matmul", "--models", "tiny", "--ms", "64", "--out", str(out))
    (r,) = json.loads(out.read_text())["rows"]
    assert (r["model"], r["M"], r["N"], r["K"]) == ("tiny", 64, 256, 256) and r["rel_err"] < 1e-2
    assert r["fp8_us"] > 0 and r["xla_bf16_us"] > 0 and r["speedup_vs_bf16"] > 0 and r["floor_bytes_us"] > 0
    assert r["fp8_kernel_us"] is None and r["speedup_vs_bf16_kernel"] is None and "split_k" in r["config"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_acache_smoke(tmp_path):
    """Dual, ACache and BiCache rows of one batch: the same-run ratio, the shorter block-start windows."""
    _run(
        "bench_acache",
        "--model",
        "tiny",
        "--batches",
        "2",
        "--ratios",
        "0.25",
        "--shallow-depths",
        "1",
        "--affix-len",
        "40",
        "--request-len",
        "8",
        "--out",
        str(tmp_path),
    )
    data = json.loads((tmp_path / "acache_cpu_smoke.json").read_text())
    dual, anchors, shallow = data["rows"]
    assert (dual["mode"], anchors["mode"], shallow["mode"]) == ("dual", "anchors_0.25", "shallow_1")
    assert dual["nfe"] == 64 and anchors["nfe"] == 65 and shallow["nfe"] == 64  # ACache's probe
    assert anchors["speedup_vs_dual"] == dual["seconds"] / anchors["seconds"]
    assert anchors["block_start_window_tokens"] == 10 + 8 + 256 < dual["block_start_window_tokens"] == 64 + 256
    assert shallow["shallow_depth"] == 1 and shallow["ms_block_start"] > 0
    (run,) = data["meta"]["runs"].values()
    assert run["affix_length"] == 40 and min(run["shared_build_ms"].values()) > 0
    assert (tmp_path / "acache_cpu_smoke.png").stat().st_size > 0


def test_convert_memory_smoke(tmp_path):
    out = tmp_path / "convert_memory.json"
    _run("convert_memory", "--d", "256", "--layers", "2", "--mlp", "512", "--vocab", "1024", "--out", str(out))
    (r,) = json.loads(out.read_text())["rows"]
    assert r["checkpoint_bytes"] > 0 and r["peak_anon_rss_bytes"] > 0 and r["ratio"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_profile_bicache_smoke(tmp_path):
    """profile_bicache on the bundled model: a table keyed from 0, per-bucket curves of one value per layer."""
    _run("profile_bicache", "--n", "2", "--gen-lengths", "64", "--out", str(tmp_path / "p.json"))
    data = json.loads((tmp_path / "p.json").read_text())
    table = {int(k): v for k, v in data["table"].items()}
    assert min(table) == 0 and list(table.values()) == sorted(table.values())
    strict = {int(k): v for k, v in data["table_strict"].items()}
    assert strict[0] == table[0] - 1
    curves = data["mean_similarity_per_layer"]
    assert len(curves) >= 2 and all(len(c) == 6 and abs(c[0] - 1) < 1e-4 for c in curves.values())
    assert (tmp_path / "p.png").stat().st_size > 0


def test_profile_serve_smoke(tmp_path):
    """profile_serve at tiny shapes: an engine block call of a full batch, and the step before it, where one new
    ACache request is probed alone (the CPU has no device plane: the kernel tables are empty there)."""
    args = ["--model", "tiny", "--rows", "acache_0.2", "--no-generate", "--affix-len", "48", "--question-len", "8"]
    args += ["--output-len", "128", "--calls", "1", "--kv-budget-gib", "0.05", "--max-model-len", "192"]
    args += ["--new-requests", "1", "--compile-cache", str(tmp_path / "xla")]
    _run("profile_serve", *args, "--out", str(tmp_path), "--run", "smoke")
    data = json.loads(next(tmp_path.glob("serve_profile_*.json")).read_text())
    block, probing = data["rows"]
    assert block["row"] == probing["row"] == "acache_0.2" and block["wall_ms"] > 0 and block["requests"] == 16
    assert probing["what"] == "engine block call probing 1 of 16 rows" and probing["new_requests"] == 1
    assert probing["probe_busy_ms_per_request"] == probing["busy_ms"] - block["busy_ms"]
    assert probing["probe_span_ms_per_request"] == probing["span_ms"] - block["span_ms"]
    assert data["meta"]["runs"]["smoke"]["serve_flags"][:2] == ["--max-batch", "16"]


def test_bench_serve_rows_through_python_and_http(tmp_path):
    """The serving bench on the tiny model: a shared-affix row through the Python API, then the same through the
    HTTP server and the openai client, with the fields issue 30 names, their ratio, the engine as `dllm-jax serve
    --weights fp8_all` builds it (warmed once: every GEMM past layer 1 in FP8) and no compilations after warm-up."""
    import jax

    bench = _load("bench_serve")
    args = ["--model", "tiny", "--requests", "4", "--concurrency", "2", "--affix-len", "64", "--question-len", "8"]
    args += ["--output-len", "32", "--placements", "suffix", "--ratios", "0.2", "--no-off", "--no-generate"]
    args += ["--kv-budget-gib", "0.01", "--max-batch", "1", "--max-model-len", "128"]  # serve flags: a CPU's sizes
    args += ["--weights", "fp8_all"]
    args += ["--compile-cache", jax.config.jax_compilation_cache_dir]  # the session's (conftest)
    assert bench.main([*args, "--http", "--run", "smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "serve_cpu_smoke.json").read_text())
    python, http = data["rows"]
    fields = "workload affix_len placement sharing technique ratio transport tokens_per_s p50_s p99_s peak_kv_bytes"
    fields += " probe_ms_per_request max_requests_16gib compiles_after_warmup ttfb_p50_s ttfb_p99_s programs warmup_s"
    for row in (python, http):
        assert set(fields.split()) <= set(row)
        assert (row["workload"], row["placement"], row["sharing"], row["technique"]) == (
            "closed16",
            "suffix",
            "on",
            "acache",
        )
        assert row["tokens"] == 4 * 32 and row["compiles_after_warmup"] == 0 and row["probe_ms_per_request"] > 0
        assert row["ttfb_p99_s"] <= row["p99_s"] and row["weights"] == "fp8_all"
        assert row["programs"] == row["warmup"]["programs"] == 3  # block, probe, affix
    assert (python["transport"], http["transport"]) == ("python", "http")
    assert http["vs_python"] == http["tokens_per_s"] / python["tokens_per_s"]
    meta = data["meta"]["runs"]["smoke"]
    assert meta["affix_len"] == 64 and meta["serve_flags"]["()"].startswith("dllm-jax serve --max-batch 1 ")
    assert "--weights fp8_all" in meta["serve_flags"]["()"]
    assert (tmp_path / "serve_cpu_smoke.png").stat().st_size > 0


def test_bench_serve_closed_rows_of_one_label_merge_across_commands(tmp_path, monkeypatch):
    """Two commands under one --run label (bf16, then fp8_all and a re-measured bf16 row): the second keeps the
    first's rows it did not re-measure, replaces the one it did, and meta lists both commands."""
    import argparse

    bench = _load("bench_serve")
    args = argparse.Namespace(out=str(tmp_path), run="two", model="tiny", affix_len=8, question_len=4, output_len=8)
    args.__dict__.update(block_len=4, steps_per_block=4, requests=2, concurrency=2, kv_budget_gib=0.01)

    def row(sharing, weights, tokens_per_s):
        return dict(workload="closed16", sharing=sharing, technique="dual", ratio=None, placement="prefix",
                    weights=weights, transport="python", tokens_per_s=tokens_per_s)  # fmt: skip

    def command(argv, rows):
        monkeypatch.setattr(sys, "argv", argv)
        earlier = bench.previous_rows(bench.closed_path(args), "two")
        for i in range(len(rows)):  # saved after each row, as the bench does
            path = bench.save_closed(args, rows[: i + 1], [], dict(serve_flags={}, earlier=earlier))
        return json.loads(path.read_text())

    command(["bench_serve.py", "--run", "two"], [row("off", "bf16", 1.0), row("on", "bf16", 2.0)])
    data = command(["bench_serve.py", "--weights", "fp8_all"], [row("off", "fp8_all", 3.0), row("off", "bf16", 4.0)])
    got = sorted((r["sharing"], r["weights"], r["tokens_per_s"]) for r in data["rows"] if r["run"] == "two")
    assert got == [("off", "bf16", 4.0), ("off", "fp8_all", 3.0), ("on", "bf16", 2.0)]
    assert [c.split()[-1] for c in data["meta"]["runs"]["two"]["commands"]] == ["two", "fp8_all"]


def test_serve_engine_with_no_compile_cache_leaves_the_cache_off(models_fp32):
    """bench_serve builds the engine `dllm-jax serve FLAGS` builds; with --no-compile-cache that is one without jax's
    persistent cache (it used to pass None on as the cache's directory and fail)."""
    import jax

    bench = _load("bench_serve")
    run_cache = jax.config.jax_compilation_cache_dir  # the suite's (conftest), put back below
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        flags = ["--max-batch", "2", "--max-model-len", "64", "--kv-budget-gib", "0.01", "--no-compile-cache"]
        engine = bench.serve_engine(models_fp32["llada"], flags)
        assert engine.config.max_batch == 2 and jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", run_cache)


def test_bench_serve_mixed_rows_take_the_starts_of_their_own_flags_only():
    """A mixed row reports the fresh-process starts of its --run label only where they ran its engine's flags: an
    fp8_all command after a bf16 one with --starts reports its own warm-up."""
    bench = _load("bench_serve")
    start = dict(start="fresh processes", load_s=None, warmup_s=71.0, warmup_s_cached=10.3, warmup={"compiles": 6})
    start["serve_flags"] = "dllm-jax serve --max-batch 16"
    info = {"seconds": 94.9, "compiles": 6}
    same = bench.row_start(start, "dllm-jax serve --max-batch 16", info, 2.5)
    assert (same["start"], same["warmup_s"], same["warmup_s_cached"], same["load_s"]) == (
        "fresh processes",
        71.0,
        10.3,
        2.5,
    )
    other = bench.row_start(start, "dllm-jax serve --max-batch 16 --weights fp8_all", info, 2.5)
    assert (other["start"], other["warmup_s"], other["warmup_s_cached"]) == ("this process", 94.9, None)
    assert same["warmup_this_process"] == other["warmup_this_process"] == info


def test_bench_serve_mixed(tmp_path):
    """Issue 39's mixed workload at tiny sizes, run as on the GPU (a fresh interpreter; its starts in two more):
    six affixes at three placements, per-request max_tokens / temperature / steps in one engine per setting set
    with no compilation after warm-up, every row's fields, a second start that loads what the first compiled, the
    BiCache engine serving its one depth, each arrival pattern through HTTP too (Poisson: an open loop)."""
    args = ["--workloads", "mixed", "--model", "tiny", "--requests", "6", "--concurrency", "2"]
    args += ["--max-batch", "2", "--max-model-len", "64", "--block-len", "16", "--kv-budget-gib", "0.01"]
    args += ["--mixed-affix-lens", "8", "8", "12", "16", "16", "20", "--mixed-question-lens", "2", "6"]
    args += ["--mixed-max-tokens", "16", "32", "--arrivals", "poisson_50", "closed", "--bicache-depth", "1"]
    args += ["--rows", "off", "acache_0.2", "bicache"]  # ACache at ratio 0 runs the same code as 0.2: the suite's time
    args += ["--starts", "--hf-dir", str(tmp_path / "hf"), "--compile-cache", str(tmp_path / "xla"), "--http"]
    args += ["--run", "smoke", "--out", str(tmp_path)]
    env = fixtures.subprocess_env()
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_serve.py"), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "serve_mixed_cpu_smoke.json").read_text())
    meta = data["meta"]["runs"]["smoke"]
    assert meta["affix_lens"] == [8, 8, 12, 16, 16, 20] and sum(meta["affix_counts"]) == 6
    assert meta["serve_flags"]["bicache"].startswith("dllm-jax serve --max-batch 2 --kv-budget-gib 0.01 ")
    start, *rows = data["rows"]
    assert start["arrival"] == "start" and start["load_s"] > 0 and start["warmup_s"] > 0 < start["warmup_s_cached"]
    assert start["warmup_cached"]["compiles"] < start["warmup"]["compiles"]  # from the persistent cache
    plan = [(a, n, "python") for a in ("poisson_50", "closed2") for n in ("off", "acache_0.2")]
    plan += [(a, n, "http") for a in ("poisson_50", "closed2") for n in ("off", "acache_0.2")]
    plan += [(a, "bicache", t) for t in ("python", "http") for a in ("poisson_50", "closed2")]
    assert [(r["arrival"], r["row"], r["transport"]) for r in rows] == plan
    fields = "tokens_per_s p50_s p99_s ttfb_p50_s ttfb_p99_s peak_kv_bytes probe_ms_per_request max_requests_16gib"
    fields += " load_s warmup_s warmup_s_cached programs compiles_after_warmup compile_s_after_warmup"
    for r in rows:
        assert set(fields.split()) <= set(r) and r["requests"] == 6 and r["compiles_after_warmup"] == 0
        assert r["ttfb_p50_s"] <= r["p50_s"] and r["ttfb_p99_s"] <= r["p99_s"] and r["max_requests_16gib"] > 0
        # python: every request runs to its max_tokens; http: the server's requests stop at EOS
        assert r["tokens"] == meta["generated_tokens"] if r["transport"] == "python" else r["tokens"] > 0
        # http: the server audits as serve does by default (2%); the engine alone has no audit
        assert (r["audit_fraction"], r["batch_invariant"]) == ((0.02 if r["transport"] == "http" else None), False)
        assert (r["probe_ms_per_request"] or 0) > 0 if r["row"] == "acache_0.2" else r["probe_ms_per_request"] is None
        if r["row"] != "off":
            off = next(
                o for o in rows if (o["row"], o["arrival"], o["transport"]) == ("off", r["arrival"], r["transport"])
            )
            assert r["speedup_vs_off"] == r["tokens_per_s"] / off["tokens_per_s"] and r["baseline"] == "this command"
        if r["row"] == "bicache":
            assert (r["depth"], r["start"], r["warmup_s_cached"]) == (1, "this process", None)
            assert r["programs"] > start["programs"]  # its depth's programs on top of serve's default set
        else:
            assert (r["start"], r["warmup_s"], r["programs"]) == (
                "fresh processes",
                start["warmup_s"],
                start["programs"],
            )
    for arrival in ("poisson_50", "closed2"):  # each HTTP row against its Python twin
        pair = {r["transport"]: r for r in rows if (r["row"], r["arrival"]) == ("acache_0.2", arrival)}
        assert pair["http"]["vs_python"] == pair["http"]["tokens_per_s"] / pair["python"]["tokens_per_s"]
    assert (tmp_path / "serve_mixed_cpu_smoke.png").stat().st_size > 0


def test_bench_tp_smoke(tmp_path):
    """The tensor-parallel bench on 2 host devices (a fresh interpreter: XLA_FLAGS is read at jax's start): the
    fields issue 34 names, tp 2 against tp 1 in the same run, a plot."""
    env = fixtures.subprocess_env(host_devices=2)
    args = ["--model", "tiny", "--batches", "1", "--prompt-len", "16", "--gen-len", "8", "--block-len", "4"]
    args += ["--steps-per-block", "2", "--run", "smoke", "--out", str(tmp_path)]
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_tp.py"), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "tp_cpu_smoke.json").read_text())
    one, two = data["rows"]
    for row in (one, two):
        assert {"model", "tp", "batch", "mode", "tokens_per_s", "ms_block_step"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["nfe"] == 4  # 2 blocks of 2 steps
    assert (one["tp"], two["tp"]) == (1, 2) and two["vs_tp1"] == two["tokens_per_s"] / one["tokens_per_s"]
    assert data["meta"]["runs"]["smoke"]["devices"] == 2 and (tmp_path / "tp_cpu_smoke.png").stat().st_size > 0


def test_cond_sync_smoke(tmp_path):
    """The conditional-cost bench at CPU sizes: a chain alone and with a conditional after each GEMM, and the
    difference per conditional."""
    bench = _load("cond_sync")
    assert bench.main(["--run", "smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cond_sync_cpu.json").read_text())["rows"]
    assert [(r["options"], r["branch"]) for r in rows] == [
        ("default", "none"),
        ("default", "cond"),
        ("default", "per_cond_us"),
    ]
    assert rows[0]["ms"] > 0 < rows[1]["ms"] and rows[2]["us"] == (rows[1]["ms"] - rows[0]["ms"]) / rows[0]["n"] * 1e3


def test_bench_pool_kernels_smoke(tmp_path):
    """The pool-kernel bench at CPU sizes (interpreted): the probe-weights kernel against its XLA path for both
    models, agreeing with the XLA probe's, no device times off the GPU."""
    bench = _load("bench_pool_kernels")
    assert bench.main(["--run", "smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "pool_kernels_cpu.json").read_text())["rows"]
    assert [(r["kernel"], r["model"]) for r in rows] == [("key_weights", "llada-8b"), ("key_weights", "dream-7b")]
    for r in rows:
        assert r["xla_us"] > 0 < r["pallas_us"] and r["speedup"] == r["xla_us"] / r["pallas_us"]
        assert r["xla_device_us"] is None and r["pallas_device_us"] is None
    assert all(r["rel_err"] < 1e-5 for r in rows)


def test_the_commands_in_performance_md_run_as_written(monkeypatch):
    """Every bench command PERFORMANCE.md gives (its placeholders W and L filled in) is accepted by that bench's
    own argument parser: the reproduction commands name no option that no longer exists."""
    import argparse
    import re
    import shlex

    text = (BENCH / "PERFORMANCE.md").read_text()
    found = re.findall(r"`([a-z_]+\.py(?: [^`\[\]]*)?)`", text)
    commands = {c for c in found if (BENCH / c.split()[0]).is_file()}
    assert len(commands) >= 20, sorted(commands)

    class Parsed(Exception):
        pass

    def parse_only(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for command in sorted(commands):
        script, *argv = shlex.split(command)
        argv = [{"W": "0.1", "L": "label", "NAME": "label"}.get(a, a) for a in argv]
        monkeypatch.setattr(sys, "argv", [script, *argv])  # for the mains that take no argv
        main = _load(script.removesuffix(".py")).main
        with pytest.raises(Parsed):
            main(argv) if main.__code__.co_argcount else main()
