"""Device time of a call by kernel kind, from a jax.profiler trace (no TensorBoard: jax.profiler.ProfileData).

`kernel_breakdown(fn)` runs fn under the profiler and sums the GPU kernels by kind (GEMM, attention, cache update,
copy, other), with the busy time, the span from the first kernel's start to the last one's end, the top kernels,
and the streams' idle time (what a launch gap or a host sync leaves, attributed to the kernel that follows it). On
a backend without a device plane (the CPU) the breakdown is empty.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from typing import Any, Callable

import jax

# first match wins; names are XLA's fusion / custom-call names or the CUDA kernel names
KINDS = (
    ("attention", re.compile(r"fmha|flash|attention|cudnn|slot_attention|softmax", re.I)),
    ("gemm", re.compile(r"gemm|dot|matmul|cublas|nvjet|cutlass|xmma|wgmma", re.I)),
    ("cache_update", re.compile(r"dynamic.update.slice|dynamic_update|scatter", re.I)),
    ("copy", re.compile(r"copy|transpose|memcpy|memset", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def stream_gaps(events: list[tuple[str, int, int]]) -> dict[str, list]:
    """{kernel name: [ms the stream sat idle right before it, how often]} for one stream's (name, start_ns,
    end_ns) events in any order (kernels that overlap, e.g. under programmatic dependent launch, leave no gap)."""
    gaps: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    last_end = None
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if last_end is not None and start > last_end:
            gaps[name][0] += (start - last_end) / 1e6
            gaps[name][1] += 1
        last_end = end if last_end is None else max(last_end, end)
    return dict(gaps)


def kernel_breakdown(fn: Callable[[], Any], calls: int = 1, top: int = 15, per: int = 1) -> dict:
    """Run fn `calls` times under the profiler; device ms and kernel counts per call, divided by `per` (e.g. the
    forwards one call fuses)."""
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
        lines = []
        for plane in data.planes:  # the "Stream #" lines (XLA's derived "XLA Ops" line repeats them)
            if plane.name.startswith("/device:GPU"):
                lines += [ln for ln in plane.lines if ln.name.startswith("Stream")] or [
                    ln for ln in plane.lines if ln.name not in ("XLA Modules", "XLA Ops")
                ]
        streams = [[(ev.name, ev.start_ns, ev.end_ns) for ev in line.events] for line in lines]
    scale = calls * per
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    gap_before: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for events in streams:
        for name, start, end in events:
            by_name[name][0] += (end - start) / 1e6
            by_name[name][1] += 1
        for name, (ms, n) in stream_gaps(events).items():
            gap_before[name][0] += ms
            gap_before[name][1] += n
    every = [e for events in streams for e in events]
    if not every:
        return {
            "kernels": 0,
            "busy_ms": 0.0,
            "span_ms": 0.0,
            "idle_ms": 0.0,
            "by_kind_ms": {},
            "top": [],
            "gaps_before": [],
        }
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, (ms, _) in by_name.items():
        by_kind[kind_of(name)] += ms / scale

    def ranked(table):
        return [
            {"name": n[:120], "kind": kind_of(n), "ms": t / scale, "count": c / scale}
            for n, (t, c) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        ]

    return {
        "kernels": len(every) / scale,
        "busy_ms": sum(by_kind.values()),
        "span_ms": (max(e[2] for e in every) - min(e[1] for e in every)) / 1e6 / scale,
        "idle_ms": sum(g for g, _ in gap_before.values()) / scale,
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": ranked(by_name),
        "gaps_before": ranked(gap_before),
    }
