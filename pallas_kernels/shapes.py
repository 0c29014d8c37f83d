"""Shape lists shared by the slot-attention tests and benchmarks."""
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


class AttnTestCase(NamedTuple):
  name: str
  batch: int
  q_len: int
  kv_len: int      # S (table width)
  q_heads: int
  kv_heads: int
  head_dim: int
  q_lens: tuple
  kv_lens: tuple
  block_q: int
  block_k: int
  kv_splits: int | None


# Small CPU-interpretable cases: GQA 1/4/7, head_dim 64/128, ragged lengths (0, 1, not a multiple
# of the block), single and split KV.
ATTENTION_TEST_SHAPES = [
    AttnTestCase("mha_d128", 3, 24, 80, 2, 2, 128, (24, 5, 24), (80, 1, 0), 32, 64, 1),
    AttnTestCase("gqa4_d64_split2", 2, 40, 100, 8, 2, 64, (40, 17), (100, 37), 16, 32, 2),
    AttnTestCase("gqa7_d128_split3", 2, 16, 160, 14, 2, 128, (16, 9), (130, 64), 16, 64, 3),
]
