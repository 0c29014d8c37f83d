"""Per-kernel GPU time of one call, from a jax.profiler trace (no TensorBoard needed: jax.profiler.ProfileData).

`kernel_breakdown(fn)` runs fn once under the profiler and sums the device events by kind (GEMM, attention,
cache update, copy, other fusions), with the busy time, the span from the first kernel's start to the last one's
end (busy / span says how much of the span is launch gaps), the top kernels by total time, and the streams' idle
time between kernels attributed to the kernel that follows it (`gaps_before`: where the launch gaps are). Used by
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


def stream_gaps(events: list[tuple[str, int, int]]) -> dict[str, list]:
    """{kernel name: [ms the stream sat idle right before it, how often]} for one stream's (name, start_ns,
    end_ns) events, in any order (kernels that overlap, e.g. under programmatic dependent launch, leave no gap)."""
    gaps: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    last_end = None
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if last_end is not None and start > last_end:
            gaps[name][0] += (start - last_end) / 1e6
            gaps[name][1] += 1
        last_end = end if last_end is None else max(last_end, end)
    return dict(gaps)


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
        gap_before: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        lines = _device_lines(data)
        line_names = sorted({line.name for line in lines})
        for line in lines:
            events = [(ev.name, ev.start_ns, ev.end_ns) for ev in line.events]
            for name, start, end in events:
                ms = (end - start) / 1e6
                by_kind[kind_of(name)] += ms
                by_name[name][0] += ms
                by_name[name][1] += 1
                starts.append(start)
                ends.append(end)
                count += 1
            for name, (ms, n) in stream_gaps(events).items():
                gap_before[name][0] += ms
                gap_before[name][1] += n
    if not count:
        return {"kernels_per_call": 0, "busy_ms": 0.0, "span_ms": 0.0, "by_kind_ms": {}, "top": [],
                "idle_ms": 0.0, "gaps_before": [], "lines": line_names}
    busy = sum(by_kind.values())
    top_names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    top_gaps = sorted(gap_before.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        # idle time of the streams between kernels, and which kernels it precedes (launch gaps, host syncs)
        "idle_ms": sum(g for g, _ in gap_before.values()) / calls,
        "gaps_before": [{"name": n[:120], "kind": kind_of(n), "ms": g / calls, "count": c / calls}
                        for n, (g, c) in top_gaps],
        "kernels_per_call": count / calls,
        "busy_ms": busy / calls,
        "span_ms": (max(ends) - min(starts)) / 1e6 / calls,
        "by_kind_ms": {k: v / calls for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "lines": line_names,
        "top": [{"name": n[:120], "kind": kind_of(n), "ms": t / calls, "count": c / calls}
                for n, (t, c) in top_names],
    }
