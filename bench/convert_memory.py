"""How much host memory does `dllm-convert` need? Peak RSS on a synthetic LLaDA-layout checkpoint (CPU only).

The converter must fit LLaDA-8B (16 GB of bf16) in 24 GB of RAM. This writes a sharded checkpoint of the real
layout at a smaller size, converts it in a child process and reports peak anonymous RSS / checkpoint bytes; the
ratio carries over to 8B (streaming: one leaf at a time + interpreter/JAX overhead). Writes
bench/results/convert_memory.json (rows merged by --run label) and a bar plot beside it.

    PYTHONPATH=. python bench/convert_memory.py [--layers 12] [--d 2048] --run NAME
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fixtures  # noqa: E402  (tests/fixtures.py: the HF config of a checkpoint spec)
from tools import common  # noqa: E402


def write_synthetic(out: Path, d: int, layers: int, mlp: int, vocab: int, shard_bytes: int) -> int:
    spec = dict(
        family="llada",
        vocab=vocab,
        d=d,
        heads=d // 128,
        kv=d // 128,
        layers=layers,
        mlp=mlp,
        tied=False,
        theta=500000.0,
        eps=1e-5,
    )
    out.mkdir(parents=True, exist_ok=True)
    names = [
        ("model.transformer.wte.weight", (vocab, d)),
        ("model.transformer.ln_f.weight", (d,)),
        ("model.transformer.ff_out.weight", (vocab, d)),
    ]
    for i in range(layers):
        b = f"model.transformer.blocks.{i}."
        names += [
            (b + "attn_norm.weight", (d,)),
            (b + "q_proj.weight", (d, d)),
            (b + "k_proj.weight", (d, d)),
            (b + "v_proj.weight", (d, d)),
            (b + "attn_out.weight", (d, d)),
            (b + "ff_norm.weight", (d,)),
            (b + "ff_proj.weight", (mlp, d)),
            (b + "up_proj.weight", (mlp, d)),
            (b + "ff_out.weight", (d, mlp)),
        ]
    rng = np.random.default_rng(0)
    shard, size, n, total, weight_map = {}, 0, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        fname = f"model-{n + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        shard, size, n = {}, 0, n + 1

    for name, shape in names:
        t = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        if size + t.nbytes > shard_bytes and shard:
            flush()
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(json.dumps(fixtures.hf_config(spec)))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--mlp", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    common.output_args(ap, common.RESULTS / "convert_memory.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "hf", Path(tmp) / "converted"
        total = write_synthetic(src, args.d, args.layers, args.mlp, args.vocab, 512 << 20)
        t0 = time.perf_counter()
        # the child samples its own anonymous RSS (file-backed pages of the memory-mapped shards are clean page
        # cache the kernel can drop; anonymous memory is what must fit)
        probe = (
            "import re, sys, threading, time\n"
            "peak = [0]\n"
            "def sample():\n"
            "    while True:\n"
            "        s = open('/proc/self/status').read()\n"
            "        peak[0] = max(peak[0], int(re.search(r'RssAnon:\\s+(\\d+)', s).group(1)))\n"
            "        time.sleep(0.01)\n"
            "threading.Thread(target=sample, daemon=True).start()\n"
            "from convert.cli import main\n"
            "code = main(sys.argv[1:])\n"
            "print('PEAK_ANON_KB', peak[0])\n"
            "sys.exit(code)\n"
        )
        res = subprocess.run(
            [sys.executable, "-c", probe, str(src), str(dst), "--quiet"],
            check=True,
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
        )
        secs = time.perf_counter() - t0
        peak_total = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        peak = int(res.stdout.split("PEAK_ANON_KB")[1].split()[0]) * 1024
    row = {
        "checkpoint_bytes": total,
        "peak_anon_rss_bytes": peak,
        "peak_total_rss_bytes": peak_total,
        "ratio": peak / total,
        "seconds": secs,
        "projected_llada_8b_peak_gb": 16.03 * peak / total,
        "shape": dict(d=args.d, layers=args.layers, mlp=args.mlp, vocab=args.vocab),
    }
    out = Path(args.out)
    common.write_results(out.name, common.meta(what="dllm-convert peak RSS, CPU"), [row], out.parent, args.run)
    common.grouped_bars(
        out.with_suffix(".png"),
        ["checkpoint", "peak anonymous RSS", "peak total RSS"],
        [("GB", [total / 1e9, peak / 1e9, peak_total / 1e9])],
        "GB",
        f"dllm-convert on a {total / 1e9:.2f} GB synthetic LLaDA-layout checkpoint",
    )
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
