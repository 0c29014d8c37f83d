"""Per-kernel GPU time of one call, from a jax.profiler trace (no TensorBoard needed: jax.profiler.ProfileData).

`kernel_breakdown(fn)` runs fn once under the profiler and sums the device events by kind (GEMM, attention,
cache update, copy, other fusions), with the busy time, the span from the first kernel's start to the last one's
end (busy / span says how much of the span is launch gaps) and the top kernels by total time. Used by
profile_block_step.py --trace (issue 7: where a block step's time goes). On a backend without a device plane (the
CPU) the breakdown is empty.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from typing import Any, Callable

import jax

# first match wins; names are XLA's HLO fusion / custom-call names or the CUDA kernel names
KINDS = (
    ("attention", re.compile(r"fmha|flash|attention|cudnn|slot_attention|softmax", re.I)),
    ("gemm", re.compile(r"gemm|dot|matmul|cublas|nvjet|cutlass|xmma|wgmma|skinny|stream", re.I)),
    ("cache_update", re.compile(r"dynamic.update.slice|dynamic_update|scatter", re.I)),
    ("copy", re.compile(r"copy|transpose|memcpy|memset", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def _device_lines(data) -> list:
    """The kernel timelines of GPU planes: "Stream #..." lines (XLA's derived "XLA Ops" line repeats them)."""
    lines = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            streams = [line for line in plane.lines if line.name.startswith("Stream")]
            lines += streams or [line for line in plane.lines if line.name not in ("XLA Modules", "XLA Ops")]
    return lines


def kernel_breakdown(fn: Callable[[], Any], calls: int = 1, top: int = 25) -> dict:
    """Run fn `calls` times under the profiler; per-kind device milliseconds per call, kernel count, span."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(calls):
                fn()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return {"error": "no trace written"}
        data = ProfileData.from_file(files[-1])
        by_kind: dict[str, float] = collections.defaultdict(float)
        by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        starts, ends, count = [], [], 0
        lines = _device_lines(data)
        line_names = sorted({line.name for line in lines})
        for line in lines:
            for ev in line.events:
                ms = ev.duration_ns / 1e6
                by_kind[kind_of(ev.name)] += ms
                by_name[ev.name][0] += ms
                by_name[ev.name][1] += 1
                starts.append(ev.start_ns)
                ends.append(ev.end_ns)
                count += 1
    if not count:
        return {"kernels_per_call": 0, "busy_ms": 0.0, "span_ms": 0.0, "by_kind_ms": {}, "top": [],
                "lines": line_names}
    busy = sum(by_kind.values())
    top_names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "kernels_per_call": count / calls,
        "busy_ms": busy / calls,
        "span_ms": (max(ends) - min(starts)) / 1e6 / calls,
        "by_kind_ms": {k: v / calls for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "lines": line_names,
        "top": [{"name": n[:120], "kind": kind_of(n), "ms": t / calls, "count": c / calls}
                for n, (t, c) in top_names],
    }
