"""How long an engine at serve's defaults takes to warm up on the CPU, cold and from the persistent cache, with the
code of several trees in the same run (a change's start-up against its baseline's, before a GPU can say it).

A tiny LLaDA (the tests' fixture, 32 layers, max_sequence_length 4096) in an engine with max_batch 16 and
max_model_len 4096: `Engine.warmup()` in a fresh process on an empty compilation cache, then in a second fresh
process on that cache. Timings are the CPU's own, not the H200's (compiling there takes ~5x longer a program);
the program counts and the ratios between trees are the point. Writes bench/results/startup_cpu.json (rows merged
by --run).

    PYTHONPATH=. python bench/startup_cpu.py --run NAME --trees . /path/to/baseline-worktree
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

CHILD = """
import json, sys, time
sys.path.insert(0, {tests!r})
import fixtures
from dllm_jax import load
from dllm_jax.compilation import enable_compile_cache
from dllm_jax.engine import Engine, EngineConfig
enable_compile_cache(sys.argv[1])
engine = Engine(load(sys.argv[2]), EngineConfig(max_batch=16, max_model_len=4096))
t0 = time.perf_counter()
info = engine.warmup(progress=False)
print(json.dumps(dict(info, wall_s=time.perf_counter() - t0)))
"""


def checkpoint(out: Path, tests: Path) -> Path:
    """The fixture LLaDA with 32 layers and a 4096-token maximum, written once."""
    sys.path.insert(0, str(tests))
    import fixtures

    fixtures.SPECS["llada32"] = dict(fixtures.SPECS["llada"], layers=32)
    fixtures.write_checkpoint("llada32", out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, max_sequence_length=4096)))
    return out


def start(tree: Path, cache: Path, ckpt: Path, tests: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = CHILD.format(tests=str(tests))
    command = [sys.executable, "-c", code, str(cache), str(ckpt)]  # run in the tree: `-c` puts the cwd first
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="source trees to start (the first: this change)")
    common.output_args(ap)
    args = ap.parse_args(argv)
    tests = Path(__file__).resolve().parent.parent / "tests"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(Path(tmp) / "ckpt", tests)
        for i, tree in enumerate(map(Path, args.trees)):
            commit = subprocess.run(
                ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            cache = Path(tmp) / f"cache{i}"
            cold, cached = start(tree, cache, ckpt, tests), start(tree, cache, ckpt, tests)
            rows.append(
                dict(
                    tree=commit,
                    programs=cold["programs"],
                    warmup_s=cold["wall_s"],
                    warmup_s_cached=cached["wall_s"],
                    compiles=cold["compiles"],
                    loaded=cached["loaded"],
                )
            )
            print(
                f"{commit}: {cold['programs']} programs, {cold['wall_s']:.1f} s cold, {cached['wall_s']:.1f} s cached"
            )
            meta = common.meta(model="tiny llada, 32 layers", max_batch=16, max_model_len=4096, trees=args.trees)
            common.write_results("startup_cpu.json", meta, rows, args.out, args.run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
