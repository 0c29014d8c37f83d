"""AffixIndex: automatic discovery of shared prefixes (chained page hashes) and shared spans at any offsets
(k-gram hashes, verified and extended), registered affixes, memory bounds, determinism, no false positives."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm_jax.engine import affix_index as ai
from dllm_jax.engine.affix_index import AffixIndex, AffixMatch

ENGINE_DIR = Path(ai.__file__).parent


class Tokens:
    """Fresh random token runs: no two calls share a k-gram (vocab 10^6), so every shared span is planted."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def __call__(self, n):
        return [self.rng.randrange(1, 10**6) for _ in range(n)]


def contains(hay, needle):
    return any(hay[i : i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))


# ---- prefixes ---------------------------------------------------------------------------------------------------
def test_shared_prefix_by_chained_page_hashes():
    t = Tokens()
    ix = AffixIndex(page_size=16, min_tokens=32, k=8)
    system = t(70)
    ix.add(system + t(50))
    p = system + t(40)
    assert ix.find_prefix(p) == (0, 64)  # whole pages only: 70 shared tokens -> 4 pages
    assert ix.match(p) == AffixMatch(0, 64, "prefix")
    assert ix.find(p) == (0, 64)
    # Too short: 20 shared tokens is 1 page, under min_tokens (and no span of 32 either).
    short = t(20)
    ix.add(short + t(40))
    assert ix.find(short + t(60)) is None
    # Not at the start: the chain does not match, the span finder does.
    q = t(1) + system + t(10)
    assert ix.find_prefix(q) is None and ix.match(q) == AffixMatch(1, 71, "span")


def test_longest_prefix_among_several_prompts():
    t = Tokens(1)
    ix = AffixIndex(page_size=8, min_tokens=16, k=4)
    base = t(100)
    ix.add(base[:40] + t(30))
    ix.add(base[:90] + t(30))
    ix.add(base[:60] + t(30))
    assert ix.find_prefix(base + t(5)) == (0, 88)
    assert ix.find_prefix(base[:59] + t(40)) == (0, 56)
    ix.check_invariants()


def test_prefix_is_preferred_unless_told_otherwise():
    t = Tokens(2)
    system, doc = t(40), t(300)
    for prefer, want in [(True, "prefix"), (False, "span")]:
        ix = AffixIndex(page_size=8, min_tokens=32, k=8, prefer_prefix=prefer)
        ix.add(system + t(20) + doc + t(20))
        m = ix.match(system + t(7) + doc + t(9))
        assert m.kind == want
        assert (m.start, m.end) == ((0, 40) if prefer else (47, 347))
    # A longer prefix wins over a shorter span either way.
    ix = AffixIndex(page_size=8, min_tokens=32, k=8, prefer_prefix=False)
    ix.add(doc + t(5) + system + t(5))
    assert ix.match(doc[:200] + t(3) + system) == AffixMatch(0, 200, "prefix")


# ---- spans at any offsets ---------------------------------------------------------------------------------------
def test_infix_and_suffix_spans_at_different_offsets():
    t = Tokens(3)
    ix = AffixIndex(page_size=16, min_tokens=48, k=16)
    doc = t(200)
    ix.add(t(37) + doc + t(23))  # the document inside a question
    assert ix.find(t(5) + doc + t(80)) == (5, 205)  # infix at another offset
    assert ix.find(t(120) + doc) == (120, 320)  # suffix
    assert ix.match(doc[50:150] + t(9)) == AffixMatch(0, 100, "span")  # at the start, but not a shared prefix
    m = ix.match(t(64) + doc[50:150] + t(9))  # part of it
    assert m == AffixMatch(64, 164, "span")
    ix.check_invariants()


def test_span_is_extended_maximally_both_ways():
    t = Tokens(4)
    ix = AffixIndex(page_size=16, min_tokens=32, k=8)
    doc, left, right = t(100), t(3), t(5)
    ix.add([1] * 10 + left + doc + right + [2] * 10)
    q = [3] * 20 + left + doc + right + [4] * 20
    assert ix.find(q) == (20, 128)  # the tokens around doc match too, and are included
    assert ix.find([3] * 20 + left[1:] + doc + right[:-1] + [4] * 20) == (20, 126)


def test_every_shared_run_of_min_tokens_is_found_at_any_offsets():
    """Stored prompts are indexed every `stride` positions only; that must still catch a run of exactly min_tokens
    tokens wherever it sits in either prompt."""
    t = Tokens(16)
    ix = AffixIndex(page_size=16, min_tokens=24, k=8)
    assert ix.stride == 17
    run = t(24)
    for off in range(ix.stride + 1):
        ix.add(t(off) + run + t(5))
    for off in range(ix.stride + 1):
        q = t(off + 3) + run[:23] + t(4)  # one token short: nothing
        assert ix.find_span(q) is None
        q = t(off + 3) + run + t(4)
        assert ix.find_span(q) == (off + 3, off + 27)
        ix.check_invariants()


def test_a_long_shared_run_is_extended_once(monkeypatch):
    """O(prompt length): the k-gram hits along one shared run (one per stride) are skipped once it is extended."""
    t = Tokens(17)
    ix = AffixIndex(page_size=16, min_tokens=32, k=16)
    doc = t(3000)
    ix.add(t(11) + doc + t(11))
    calls = []
    lcp = ai._lcp
    monkeypatch.setattr(ai, "_lcp", lambda *a: calls.append(a) or lcp(*a))
    assert ix.find_span(t(7) + doc + t(7)) == (7, 3007)
    assert len(calls) == 1


def test_longest_span_wins_ties_go_to_the_earliest_start():
    t = Tokens(5)
    ix = AffixIndex(page_size=16, min_tokens=32, k=8)
    a, b, c = t(60), t(90), t(60)
    ix.add(t(10) + a + t(10))
    ix.add(t(10) + b + t(10))
    ix.add(t(10) + c + t(10))
    assert ix.find(t(3) + a + t(3) + b + t(3) + c) == (66, 156)
    assert ix.find(t(3) + c + t(3) + a) == (3, 63)
    assert ix.find(t(3) + a + t(3) + c) == (3, 63)


def test_equal_spans_tie_to_the_earliest_start_not_the_first_found():
    t = Tokens(18)
    ix = AffixIndex(page_size=16, min_tokens=24, k=8)  # stride 17
    q = t(60)
    ix.add(t(1) + q[0:40] + t(5))  # its first indexed k-gram inside q[0:40] is at q[16]
    ix.add(q[10:50] + t(5))  # its first one at q[10]: found first
    assert ix.find_span(q) == (0, 40)


def test_nothing_shared_gives_nothing():
    t = Tokens(6)
    ix = AffixIndex(page_size=8, min_tokens=16, k=4)
    for _ in range(20):
        p = t(100)
        assert ix.find(p) is None and ix.observe(p) is None
    doc = t(50)
    assert ix.find(doc + doc) is None  # repetition inside one prompt is not sharing
    ix.add(t(10) + doc[:15] + t(10))  # 15 shared tokens < min_tokens
    assert ix.find(doc) is None
    assert AffixIndex(page_size=8, min_tokens=16, k=4).find(t(100)) is None


def test_hash_collisions_never_give_false_spans(monkeypatch):
    """With every hash constant, every k-gram and every page chain collides: all candidates are false except true
    matches, and the tokens decide."""
    monkeypatch.setattr(ai, "_kgram_hashes", lambda tokens, k: [0] * max(0, len(tokens) - k + 1))
    monkeypatch.setattr(ai, "_chain_hash", lambda prev, chunk: b"\0" * 16)
    t = Tokens(7)
    ix = AffixIndex(page_size=8, min_tokens=16, k=4)
    system, doc = t(30), t(40)
    for _ in range(6):
        ix.add(t(60))
    assert list(ix._kgrams) == [0] and list(ix._chains) == [b"\0" * 16]  # everything collides
    for _ in range(10):
        q = t(80)
        assert ix.find(q) is None and ix.find_prefix(q) is None and ix.find_span(q) is None
    # The verified length is the true one, not the depth the (colliding) hashes suggest.
    ix.add(system + t(50))
    assert ix.find_prefix(system + t(50)) == (0, 24)
    ix.register(doc)
    q = t(9) + doc + t(9)
    assert ix.find_registered(q) == (9, 49)
    assert ix.find_registered(t(80)) is None


def test_short_registered_affixes_are_matched_token_aligned():
    ix = AffixIndex(page_size=8, min_tokens=16, k=4)
    ix.register([0x200, 0x300])  # shorter than k: searched for as int32 bytes
    # Little-endian bytes 01 00 02 00 | 00 00 03 00 hold the affix's bytes 00 02 00 00 00 03 00 00 at offset 1.
    assert ix.find_registered([0x20001, 0x30000, 0]) is None
    assert ix.find_registered([0x20001, 0x30000, 0, 0x200, 0x300]) == (3, 5)
    assert ix.find_registered([0x200, 0x301]) is None


def test_no_false_spans_random_small_vocab():
    """Small vocabularies make natural k-gram repeats: every reported span is checked against the prompts."""
    rng = random.Random(8)
    ix = AffixIndex(page_size=4, min_tokens=8, k=4, max_prompts=20)
    remembered = []
    for _ in range(60):
        p = [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        m = ix.match(p)
        if m is not None:
            span = p[m.start : m.end]
            assert m.end - m.start >= 8 and any(contains(r, span) for r in remembered)
            if m.kind == "prefix":
                assert m.start == 0 and m.end % 4 == 0 and any(r[: m.end] == span for r in remembered)
        ix.add(p)
        remembered = [r.tokens.tolist() for r in ix._prompts.values()]
    ix.check_invariants()


def test_pathological_repetition_stays_fast_and_exact():
    ix = AffixIndex(page_size=16, min_tokens=64, k=16)
    ix.add([7] * 4000)
    t0 = time.perf_counter()
    m = ix.match([1] + [7] * 3999)
    assert m == AffixMatch(1, 4000, "span")
    m = ix.match(([7] * 20 + [8]) * 200)  # runs of 20 shared tokens only
    assert m is None
    stored = ([7] * 70 + [8]) * 50
    ix.add(stored)
    q = ([7] * 69 + [8]) * 50
    s = ix.find_span(q)
    assert s is not None and s[1] - s[0] >= 69 and contains(stored, q[s[0] : s[1]])
    assert time.perf_counter() - t0 < 2.0


# ---- registered affixes -----------------------------------------------------------------------------------------
def test_registered_affixes_are_reported_first():
    t = Tokens(9)
    ix = AffixIndex(page_size=8, min_tokens=16, k=8)
    system, doc, doc2 = t(64), t(40), t(60)
    ix.add(system + t(100))
    key = ix.register(doc)
    assert ix.register(list(doc)) == key and ix.registered_keys() == [key]  # idempotent
    q = system + t(5) + doc + t(5)
    assert ix.match(q) == AffixMatch(69, 109, "registered")  # before the (longer) shared prefix
    assert ix.find_prefix(q) == (0, 64)
    ix.register(doc2)
    assert ix.find(t(3) + doc + doc2) == (43, 103)  # the longest registered one
    assert ix.find(t(3) + doc + t(3) + doc) == (3, 43)  # leftmost occurrence
    assert ix.find_registered(t(3) + doc[:-1] + t(3)) is None  # all of it, or nothing
    short = ix.register(t(3))  # shorter than k: searched for directly
    p = t(4) + ix._registered[short].tokens.tolist() + t(4)
    assert ix.match(p) == AffixMatch(4, 7, "registered")
    q = t(3) + doc + t(3)
    assert ix.find_span(q) == (3, 43) and ix.find_prefix(doc + t(3)) == (0, 40)  # the finders see it too
    assert ix.unregister(key) and not ix.unregister(key)
    assert ix.find_registered(q) is None
    assert ix.match(q) is None and ix.find_prefix(doc + t(3)) is None  # its chains and k-grams are gone
    assert ix.unregister(short) and ix.registered_keys() == [ix.register(doc2)]
    ix.check_invariants()
    with pytest.raises(ValueError):
        ix.register([])


def test_registered_affix_feeds_the_prefix_and_span_finders():
    t = Tokens(10)
    ix = AffixIndex(page_size=8, min_tokens=16, k=8)
    aff = t(50)
    ix.register(aff)
    assert ix.match(aff[:30] + t(40)) == AffixMatch(0, 24, "prefix")  # part of a stored entry, page-aligned
    assert ix.match(t(7) + aff[10:45] + t(40)) == AffixMatch(7, 42, "span")


def test_equal_length_registered_ties_go_to_the_earliest_start():
    t = Tokens(11)
    a, b = t(20), t(20)
    for order in [(a, b), (b, a)]:
        ix = AffixIndex(page_size=8, min_tokens=16, k=4)
        for r in order:
            ix.register(r)
        assert ix.match(t(2) + a + b) == AffixMatch(2, 22, "registered")
        assert ix.match(b + t(2) + a) == AffixMatch(0, 20, "registered")


# ---- memory bounds ----------------------------------------------------------------------------------------------
def test_old_prompts_are_forgotten():
    t = Tokens(12)
    ix = AffixIndex(page_size=8, min_tokens=16, k=8, max_prompts=3)
    docs = [t(40) for _ in range(5)]
    for d in docs:
        ix.add(t(10) + d + t(10))
    assert ix.num_prompts == 3 and ix.num_tokens == 180
    assert [ix.find(t(5) + d + t(5)) for d in docs] == [None, None, (5, 45), (5, 45), (5, 45)]
    ix.check_invariants()


def test_token_bound_and_identical_prompts():
    t = Tokens(13)
    ix = AffixIndex(page_size=8, min_tokens=16, k=8, max_prompts=100, max_tokens=200)
    a, b, c = t(90), t(90), t(90)
    ix.add(a)
    ix.add(b)
    ix.add(a)  # identical: stored once, now the most recent
    assert ix.num_prompts == 2 and ix.num_tokens == 180
    ix.add(c)  # 270 > 200: the least recently added (b) goes
    assert ix.num_prompts == 2 and ix.find_prefix(b) is None and ix.find_prefix(a) == (0, 88)
    ix.add(t(201))  # longer than the whole bound: not remembered, nothing forgotten
    assert ix.num_prompts == 2 and ix.find_prefix(c) == (0, 88)
    ix.check_invariants()
    assert AffixIndex(page_size=8, min_tokens=16, k=8, max_prompts=0).observe(a) is None


def test_index_size_is_bounded():
    t = Tokens(14)
    ix = AffixIndex(page_size=8, min_tokens=32, k=8, max_prompts=8)
    for _ in range(300):
        ix.add(t(t.rng.randrange(50, 200)))
    assert ix.num_prompts == 8 and len(ix._stored) == 8
    assert ix.num_tokens <= 8 * 200
    assert len(ix._kgrams) <= ix.num_tokens // ix.stride + 8
    assert len(ix._chains) <= ix.num_tokens // 8
    ix.check_invariants()


def test_kgram_lists_keep_the_most_recent_prompts():
    t = Tokens(19)
    ix = AffixIndex(page_size=8, min_tokens=16, k=8, max_hits=2)
    common = t(40)
    for _ in range(5):
        ix.add(common + t(20))
    h = ai._kgram_hashes(ix._stored[0 + 4].tokens, 8)[0]  # common's first k-gram
    assert [sid for sid, _ in ix._kgrams[h]] == [3, 4]
    ix.check_invariants()


def test_constructor_validates():
    for kw in [
        dict(page_size=0),
        dict(k=0),
        dict(min_tokens=8, k=16),
        dict(max_prompts=-1),
        dict(max_hits=0),
        dict(max_tokens=-1),
        dict(work_factor=0),
    ]:
        with pytest.raises(ValueError):
            AffixIndex(**{"page_size": 16, **kw})


# ---- determinism ------------------------------------------------------------------------------------------------
SCRIPT = """
import json, random, sys, types
# An empty package over the engine folder: the package __init__ exports Engine (jax); the host modules must not.
mod = types.ModuleType("engine")
mod.__path__ = [sys.argv[1]]
sys.modules["engine"] = mod
import engine.block_manager  # noqa: F401  (the other host module: pages and hashes)
from engine.affix_index import AffixIndex
rng = random.Random(0)
blocks = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(12)]
ix = AffixIndex(page_size=4, min_tokens=8, k=4, max_prompts=6, max_hits=2)
out = []
for i in range(80):
    p = [t for b in rng.sample(blocks, rng.randrange(1, 5)) for t in b]
    if i % 17 == 0:
        ix.register(p[:rng.randrange(1, 30)])
    m = ix.observe(p)
    out.append(None if m is None else list(m))
print(json.dumps({"out": out, "jax": "jax" in sys.modules}))
"""


def test_deterministic_across_processes():
    """Same calls, same answers, whatever Python's hash seed; and the host bookkeeping modules load without jax."""
    runs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(ENGINE_DIR)], capture_output=True, text=True, env=env, check=True
        )
        runs.append(json.loads(r.stdout))
    assert runs[0] == runs[1] and not runs[0]["jax"]
    assert sum(m is not None for m in runs[0]["out"]) >= 20  # the run exercises real matches
    assert {m[2] for m in runs[0]["out"] if m} == {"registered", "prefix", "span"}


def test_deterministic_in_process():
    def run():
        t = Tokens(15)
        blocks = [t(30) for _ in range(6)]
        rng = random.Random(15)
        ix = AffixIndex(page_size=8, min_tokens=16, k=8, max_prompts=5)
        return [ix.observe([x for b in rng.sample(blocks, 3) for x in b]) for _ in range(40)]

    assert run() == run()


# ---- against a brute-force oracle -------------------------------------------------------------------------------
def longest_common_span(q, prompts, min_len):
    """(length, start) of the longest run of q found in any prompt, earliest start on ties; by dynamic programming."""
    best = (0, 0)
    for p in prompts:
        prev = [0] * (len(p) + 1)
        for i in range(1, len(q) + 1):
            cur = [0] * (len(p) + 1)
            for j in range(1, len(p) + 1):
                if q[i - 1] == p[j - 1]:
                    cur[j] = prev[j - 1] + 1
                    n = cur[j]
                    if n > best[0] or (n == best[0] and i - n < best[1]):
                        best = (n, i - n)
            prev = cur
    return best if best[0] >= min_len else None


BLOCKS = [[1000 * b + i for i in range(n)] for b, n in enumerate([3, 5, 6, 9, 11, 14, 17, 20])]


@settings(max_examples=60, deadline=None, database=None)
@given(
    prompts=st.lists(st.permutations(range(len(BLOCKS))).map(lambda p: p[:5]), min_size=1, max_size=4),
    query=st.permutations(range(len(BLOCKS))),
    cut=st.integers(0, 4),
    page_size=st.sampled_from([1, 3, 4]),
)
def test_finders_match_the_oracle(prompts, query, cut, page_size):
    """No k-gram repeats within a prompt and no more prompts than max_hits: the finders must be exact."""
    prompts = [[t for b in p for t in BLOCKS[b]][cut:] for p in prompts]
    q = [t for b in query[:5] for t in BLOCKS[b]]
    ix = AffixIndex(page_size=page_size, min_tokens=8, k=3, max_hits=4, work_factor=100)
    for p in prompts:
        ix.add(p)
    ix.check_invariants()
    want = longest_common_span(q, prompts, 8)
    got = ix.find_span(q)
    assert got == (None if want is None else (want[1], want[1] + want[0]))
    lcp = max(next((i for i, (a, b) in enumerate(zip(q, p)) if a != b), min(len(q), len(p))) for p in prompts)
    lcp -= lcp % page_size
    assert ix.find_prefix(q) == ((0, lcp) if lcp >= 8 else None)


@settings(max_examples=60, deadline=None, database=None)
@given(
    reg=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), max_size=5),
    q=st.lists(st.integers(0, 4), max_size=30),
)
def test_find_registered_matches_the_oracle(reg, q):
    ix = AffixIndex(page_size=4, min_tokens=4, k=3)
    for r in reg:
        ix.register(r)
    order = list(dict.fromkeys(map(tuple, reg)))  # registration order, duplicates once
    found = []
    for n, r in enumerate(order):
        s = next((i for i in range(len(q) - len(r) + 1) if tuple(q[i : i + len(r)]) == r), None)
        if s is not None:
            found.append((-len(r), s, n))
    want = None if not found else (min(found)[1], min(found)[1] - min(found)[0])
    assert ix.find_registered(q) == want
