"""bench/bench_generate.py end to end on the CPU with the tiny model: the GPU run's code path, its JSON and plot."""

import importlib.util
import json
import sys
from pathlib import Path


def test_bench_generate_smoke_both_layer_layouts(tmp_path):
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = sys.argv
    sys.argv = ["bench_generate.py", "--models", "tiny", "--batches", "1", "--modes", "dual",
                "--layer-layout", "unrolled", "--compare-stacked", "--out", str(tmp_path)]
    try:
        mod.main()
    finally:
        sys.argv = argv
    rows = json.loads((tmp_path / "generate_h200.json").read_text())["rows"]
    # the stacked comparison row, the dual steps-64 row and the fixed steps-256 row
    assert [(r["layer_layout"], r["steps"]) for r in rows] == [("stacked", 64), ("unrolled", 64), ("unrolled", 256)]
    for r in rows:
        assert r["nfe"] == r["steps"] and r["tokens_per_s"] > 0 and r["ms_block_step"] > 0
    assert (tmp_path / "generate_h200.png").stat().st_size > 0
