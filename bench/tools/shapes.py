"""Attention shapes of the slot-attention benchmark (bench/bench_attention.py)."""

from __future__ import annotations

from typing import NamedTuple


class AttnShape(NamedTuple):
    case: str
    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int


# GPU benchmark: LLaDA-8B (32/32 heads) and Dream-7B (28/4 heads), head_dim 128.
_BENCH = [
    ("full", 8, 512, 512),
    ("full", 4, 512, 2048),
    ("block", 1, 32, 512),
    ("block", 1, 32, 2048),
    ("block", 16, 32, 512),
    ("block", 16, 32, 2048),
]
ATTENTION_BENCH_SHAPES = [
    AttnShape(f"{model}_{kind}_b{b}_q{tq}_kv{s}", b, tq, s, hq, hkv, 128)
    for model, hq, hkv in (("llada", 32, 32), ("dream", 28, 4))
    for kind, b, tq, s in _BENCH
]
