"""Shared benchmark helpers: model shapes of the real checkpoints, random params on device, timing, results."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dllm_jax.config import ModelConfig  # noqa: E402
from dllm_jax.modeling import param_shapes  # noqa: E402

RESULTS = Path(__file__).parent / "results"

LLADA_8B = ModelConfig(family="llada", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       head_dim=128, mlp_hidden=12288, rms_eps=1e-5, rope_theta=500000.0, rope_fp32=True,
                       qkv_bias=False, tie_embeddings=False, max_seq_len=4096, mask_token_id=126336,
                       eos_token_id=126081, pad_token_id=126081, bos_token_id=126080)
DREAM_7B = ModelConfig(family="dream", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       head_dim=128, mlp_hidden=18944, rms_eps=1e-6, rope_theta=1e6, rope_fp32=False,
                       qkv_bias=True, tie_embeddings=False, max_seq_len=4096, mask_token_id=151666,
                       eos_token_id=151643, pad_token_id=151643)
MODELS = {"llada-8b": LLADA_8B, "dream-7b": DREAM_7B}


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random bf16 params built directly on the device (speed does not depend on the values)."""
    shapes = param_shapes(config)
    leaves, tree = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    @jax.jit
    def make(keys):
        return [(0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype) if len(s.shape) > 1
                else jnp.ones(s.shape, s.dtype) for k, s in zip(keys, leaves)]

    return jax.tree_util.tree_unflatten(tree, make(keys))


def param_bytes(params: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


# On the CPU the benchmarks run only as smoke tests (tests/test_bench_scripts.py: the GPU runs' code paths, JSON and
# plots). Their timings mean nothing there, and a Pallas kernel in the simulator takes seconds a call, so every
# repeat count collapses to one call.
SMOKE_ON_CPU = jax.default_backend() == "cpu"


def repeats(n: int) -> int:
    """n on an accelerator, 1 on the CPU (see SMOKE_ON_CPU)."""
    return 1 if SMOKE_ON_CPU else n


def time_call(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> tuple[float, float]:
    """(median seconds, first-call seconds incl. compile). fn must block until its result is ready. reps and warmup
    are one each on the CPU (`repeats`)."""
    reps, warmup = repeats(reps), repeats(warmup)
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def meta(**extra) -> dict:
    dev = jax.devices()[0]
    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or None
        except OSError:
            commit = None
    return {"gpu": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": commit, **extra}


def grouped_bars(ax, xlabels: list[str], series: list[tuple[str, list[float]]], ref: tuple[float, str],
                 ylabel: str, title: str, log: bool = False, fontsize: int = 8) -> None:
    """One group of bars per x label, one bar per series, and a dashed reference line (the benchmark plots)."""
    import numpy as np

    x = np.arange(len(xlabels))
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series):
        ax.bar(x + width * (i - (len(series) - 1) / 2), ys, width, label=label)
    ax.axhline(ref[0], color="gray", ls="--", lw=1, label=ref[1])
    ax.set_xticks(x, xlabels, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=fontsize)


def write_results(name: str, meta_: dict, rows: list[dict], out_dir: str | os.PathLike | None = None) -> Path:
    out = Path(out_dir or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    tmp = path.with_name(f".{name}.tmp")  # written after every row: a kill mid-write must not truncate the file
    tmp.write_text(json.dumps({"meta": meta_, "rows": rows}, indent=2))
    os.replace(tmp, path)
    return path

# a CPU smoke-test size (same code paths)
TINY = LLADA_8B.replace(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=32,
                        mlp_hidden=256, mask_token_id=511, eos_token_id=510, pad_token_id=510, bos_token_id=509)
MODELS["tiny"] = TINY
