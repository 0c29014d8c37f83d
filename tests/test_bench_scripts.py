"""GPU benchmark scripts end to end on the CPU with the tiny model: the GPU runs' code paths, their JSON and plots."""

import importlib.util
import json
import sys
from pathlib import Path


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
         "--compare-stacked", "--fp8-ffn", "--compare-bf16", "--no-steps256", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "generate_fp8_h200.json").read_text())["rows"]
    # the same-run stacked comparison, the FP8 row on the layout asked for, and its same-run bf16 twin
    assert [(r["layer_layout"], r["fp8_ffn"], r.get("comparison")) for r in rows] == [
        ("stacked", True, "same-run stacked baseline"), ("unrolled", True, None),
        ("unrolled", False, "same-run bf16 baseline")]
    for r in rows:
        assert r["nfe"] == r["steps"] == 64 and r["tokens_per_s"] > 0 and r["ms_block_step"] > 0
    assert rows[1]["speedup_vs_bf16"] == rows[2]["seconds"] / rows[1]["seconds"]
    assert (tmp_path / "generate_fp8_h200.png").stat().st_size > 0


def test_profile_block_step_smoke(tmp_path):
    _run("profile_block_step", "--models", "tiny", "--batches", "1", "--backends", "xla", "--variants",
         "--layer-layout", "unrolled", "--no-stages", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "block_step_h200.json").read_text())["rows"]
    assert row["layer_layout"] == "unrolled" and row["ms_block_step"] > 0 and row["xla_baseline_ms"] > 0
    assert row["ms_floor_hbm"] > 0 and not any(k.startswith("error") for k in row)
