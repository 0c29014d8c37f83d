"""AffixIndex: automatic discovery of shared spans at any offsets (k-gram hashes, verified and extended), a span at
the prompt's start preferred as a prefix, registered affixes, memory bounds, determinism, no false positives."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_invariants import check_affix_index
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


def find(ix, prompt):
    """match's (start, end), or None."""
    m = ix.match(prompt)
    return None if m is None else (m.start, m.end)


def contains(hay, needle):
    return any(hay[i : i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))


# ---- prefixes ---------------------------------------------------------------------------------------------------
def test_shared_prefix():
    t = Tokens()
    ix = AffixIndex(min_tokens=32, k=8)
    system = t(70)
    ix.observe(system + t(50))
    p = system + t(40)
    assert ix.match(p) == AffixMatch(0, 70, "prefix")  # not rounded to whole pages: the copy is computed alone
    # Too short: 20 shared tokens, under min_tokens.
    short = t(20)
    ix.observe(short + t(40))
    assert ix.match(short + t(60)) is None
    # Not at the start: a span.
    assert ix.match(t(1) + system + t(10)) == AffixMatch(1, 71, "span")
    # At the start of this prompt, anywhere in the other one: a prefix.
    assert ix.match(system[5:] + t(10)) == AffixMatch(0, 65, "prefix")
    check_affix_index(ix)


def test_longest_prefix_among_several_prompts():
    t = Tokens(1)
    ix = AffixIndex(min_tokens=16, k=4)
    base = t(100)
    ix.observe(base[:40] + t(30))
    ix.observe(base[:90] + t(30))
    ix.observe(base[:60] + t(30))
    assert ix.match(base + t(5)) == AffixMatch(0, 90, "prefix")
    assert ix.match(base[:59] + t(40)) == AffixMatch(0, 59, "prefix")
    check_affix_index(ix)


def test_prefix_is_preferred_unless_told_otherwise():
    t = Tokens(2)
    system, doc = t(40), t(300)
    for prefer, want in [(True, "prefix"), (False, "span")]:
        ix = AffixIndex(min_tokens=32, k=8, prefer_prefix=prefer)
        ix.observe(system + t(20) + doc + t(20))
        m = ix.match(system + t(7) + doc + t(9))
        assert m.kind == want
        assert (m.start, m.end) == ((0, 40) if prefer else (47, 347))
    # A longer prefix wins over a shorter span either way.
    ix = AffixIndex(min_tokens=32, k=8, prefer_prefix=False)
    ix.observe(doc + t(5) + system + t(5))
    assert ix.match(doc[:200] + t(3) + system) == AffixMatch(0, 200, "prefix")
    # And an equally long one too (ties go to the earliest start).
    ix.observe(t(9) + system + t(9))
    assert ix.match(system + t(3) + system) == AffixMatch(0, 40, "prefix")


# ---- spans at any offsets ---------------------------------------------------------------------------------------
def test_infix_and_suffix_spans_at_different_offsets():
    t = Tokens(3)
    ix = AffixIndex(min_tokens=48, k=16)
    doc = t(200)
    ix.observe(t(37) + doc + t(23))  # the document inside a question
    assert find(ix, t(5) + doc + t(80)) == (5, 205)  # infix at another offset
    assert find(ix, t(120) + doc) == (120, 320)  # suffix
    assert ix.match(doc[50:150] + t(9)) == AffixMatch(0, 100, "prefix")  # at the start, from inside the other
    m = ix.match(t(64) + doc[50:150] + t(9))  # part of it
    assert m == AffixMatch(64, 164, "span")
    check_affix_index(ix)


def test_span_is_extended_maximally_both_ways():
    t = Tokens(4)
    ix = AffixIndex(min_tokens=32, k=8)
    doc, left, right = t(100), t(3), t(5)
    ix.observe([1] * 10 + left + doc + right + [2] * 10)
    q = [3] * 20 + left + doc + right + [4] * 20
    assert find(ix, q) == (20, 128)  # the tokens around doc match too, and are included
    assert find(ix, [3] * 20 + left[1:] + doc + right[:-1] + [4] * 20) == (20, 126)


def test_every_shared_run_of_min_tokens_is_found_at_any_offsets():
    """Stored prompts are indexed every `stride` positions only; that must still catch a run of exactly min_tokens
    tokens wherever it sits in either prompt."""
    t = Tokens(16)
    ix = AffixIndex(min_tokens=24, k=8)
    assert ix.stride == 17
    run = t(24)
    for off in range(ix.stride + 1):
        ix.observe(t(off) + run + t(5))
    for off in range(ix.stride + 1):
        q = t(off + 3) + run[:23] + t(4)  # one token short: nothing
        assert ix.match(q) is None
        q = t(off + 3) + run + t(4)
        assert ix.match(q) == AffixMatch(off + 3, off + 27, "span")
        assert ix.match(run + t(4)) == AffixMatch(0, 24, "prefix")
        check_affix_index(ix)


def test_a_long_shared_run_is_extended_once(monkeypatch):
    """O(prompt length): the k-gram hits along one shared run (one per stride) are skipped once it is extended."""
    t = Tokens(17)
    ix = AffixIndex(min_tokens=32, k=16)
    doc = t(3000)
    ix.observe(t(11) + doc + t(11))
    calls = []
    lcp = ai._lcp
    monkeypatch.setattr(ai, "_lcp", lambda *a: calls.append(a) or lcp(*a))
    assert ix.match(t(7) + doc + t(7)) == AffixMatch(7, 3007, "span")
    assert len(calls) == 1


def test_longest_span_wins_ties_go_to_the_earliest_start():
    t = Tokens(5)
    ix = AffixIndex(min_tokens=32, k=8)
    a, b, c = t(60), t(90), t(60)
    ix.observe(t(10) + a + t(10))
    ix.observe(t(10) + b + t(10))
    ix.observe(t(10) + c + t(10))
    assert find(ix, t(3) + a + t(3) + b + t(3) + c) == (66, 156)
    assert find(ix, t(3) + c + t(3) + a) == (3, 63)
    assert find(ix, t(3) + a + t(3) + c) == (3, 63)


def test_equal_spans_tie_to_the_earliest_start_not_the_first_found():
    t = Tokens(18)
    ix = AffixIndex(min_tokens=24, k=8)  # stride 17
    q = t(60)
    ix.observe(t(1) + q[0:40] + t(5))  # its first indexed k-gram inside q[0:40] is at q[16]
    ix.observe(q[10:50] + t(5))  # its first one at q[10]: found first
    assert ix.match(t(3) + q) == AffixMatch(3, 43, "span")


def test_nothing_shared_gives_nothing():
    t = Tokens(6)
    ix = AffixIndex(min_tokens=16, k=4)
    for _ in range(20):
        p = t(100)
        assert ix.match(p) is None and ix.observe(p) is None
    doc = t(50)
    assert ix.match(doc + doc) is None  # repetition inside one prompt is not sharing
    ix.observe(t(10) + doc[:15] + t(10))  # 15 shared tokens < min_tokens
    assert ix.match(doc) is None
    assert AffixIndex(min_tokens=16, k=4).match(t(100)) is None


def test_hash_collisions_never_give_false_spans(monkeypatch):
    """With every hash constant, every k-gram collides: all candidates are false except true matches, and the
    tokens decide."""
    monkeypatch.setattr(ai, "_kgram_hashes", lambda tokens, k: [0] * max(0, len(tokens) - k + 1))
    t = Tokens(7)
    ix = AffixIndex(min_tokens=16, k=4)
    system, doc = t(30), t(40)
    for _ in range(6):
        ix.observe(t(60))
    assert list(ix._kgrams) == [0]  # everything collides
    for _ in range(10):
        assert ix.match(t(80)) is None
    # The verified length is the true one.
    ix.observe(system + t(50))
    assert ix.match(system + t(50)) == AffixMatch(0, 30, "prefix")
    ix.register(doc)
    assert ix.match(t(9) + doc + t(9)) == AffixMatch(9, 49, "registered")
    assert ix.match(t(80)) is None
    check_affix_index(ix)


def test_short_registered_affixes_are_matched_token_aligned():
    ix = AffixIndex(min_tokens=16, k=4)
    ix.register([0x200, 0x300])  # shorter than k: searched for as int32 bytes
    # Little-endian bytes 01 00 02 00 | 00 00 03 00 hold the affix's bytes 00 02 00 00 00 03 00 00 at offset 1.
    assert ix.match([0x20001, 0x30000, 0]) is None
    assert ix.match([0x20001, 0x30000, 0, 0x200, 0x300]) == AffixMatch(3, 5, "registered")
    assert ix.match([0x200, 0x301]) is None


def test_no_false_spans_random_small_vocab():
    """Small vocabularies make natural k-gram repeats: every reported span is checked against the prompts."""
    rng = random.Random(8)
    ix = AffixIndex(min_tokens=8, k=4, max_prompts=20)
    remembered = []
    for _ in range(60):
        p = [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
        m = ix.observe(p)
        if m is not None:
            span = p[m.start : m.end]
            assert m.end - m.start >= 8 and any(contains(r, span) for r in remembered)
            assert (m.kind == "prefix") == (m.start == 0) and m.kind != "registered"
        remembered = [r.tokens.tolist() for r in ix._prompts.values()]
    check_affix_index(ix)


def test_pathological_repetition_stays_fast_and_exact():
    ix = AffixIndex(min_tokens=64, k=16)
    ix.observe([7] * 4000)
    t0 = time.perf_counter()
    m = ix.match([1] + [7] * 3999)
    assert m == AffixMatch(1, 4000, "span")
    m = ix.match(([7] * 20 + [8]) * 200)  # runs of 20 shared tokens only
    assert m is None
    stored = ([7] * 70 + [8]) * 50
    ix.observe(stored)
    q = ([7] * 69 + [8]) * 50
    m = ix.match(q)
    assert m is not None and m.end - m.start >= 69 and contains(stored, q[m.start : m.end])
    assert time.perf_counter() - t0 < 2.0


# ---- registered affixes -----------------------------------------------------------------------------------------
def test_registered_affixes_are_reported_first():
    t = Tokens(9)
    ix = AffixIndex(min_tokens=16, k=8)
    system, doc, doc2 = t(64), t(40), t(60)
    ix.observe(system + t(100))
    key = ix.register(doc)
    assert ix.register(list(doc)) == key and list(ix._registered) == [key]  # idempotent
    q = system + t(5) + doc + t(5)
    assert ix.match(q) == AffixMatch(69, 109, "registered")  # before the (longer) shared prefix
    assert ix.match(system + t(5)) == AffixMatch(0, 64, "prefix")
    ix.register(doc2)
    assert find(ix, t(3) + doc + doc2) == (43, 103)  # the longest registered one
    assert find(ix, t(3) + doc + t(3) + doc) == (3, 43)  # leftmost occurrence
    assert ix.match(t(3) + doc[:-1] + t(3)).kind == "span"  # all of it, or not as registered
    short = ix.register(t(3))  # shorter than k: searched for directly
    p = t(4) + ix._registered[short].tokens.tolist() + t(4)
    assert ix.match(p) == AffixMatch(4, 7, "registered")
    # the span finder sees registered affixes too
    assert ix.match(t(3) + doc[:30] + t(3)) == AffixMatch(3, 33, "span")
    assert ix.match(doc[5:35] + t(3)) == AffixMatch(0, 30, "prefix")
    assert ix.unregister(key) and not ix.unregister(key)
    assert ix.match(t(3) + doc + t(3)) is None  # its k-grams are gone too
    assert ix.match(doc[5:35] + t(3)) is None
    check_affix_index(ix)
    assert ix.unregister(short) and list(ix._registered) == [ix.register(doc2)]
    check_affix_index(ix)
    with pytest.raises(ValueError):
        ix.register([])


def test_registered_affix_feeds_the_span_finder():
    t = Tokens(10)
    ix = AffixIndex(min_tokens=16, k=8)
    aff = t(50)
    ix.register(aff)
    assert ix.match(aff[:30] + t(40)) == AffixMatch(0, 30, "prefix")  # part of a stored entry
    assert ix.match(t(7) + aff[10:45] + t(40)) == AffixMatch(7, 42, "span")


def test_equal_length_registered_ties_go_to_the_earliest_start():
    t = Tokens(11)
    a, b = t(20), t(20)
    for order in [(a, b), (b, a)]:
        ix = AffixIndex(min_tokens=16, k=4)
        for r in order:
            ix.register(r)
        assert ix.match(t(2) + a + b) == AffixMatch(2, 22, "registered")
        assert ix.match(b + t(2) + a) == AffixMatch(0, 20, "registered")


# ---- memory bounds ----------------------------------------------------------------------------------------------
def test_old_prompts_are_forgotten():
    t = Tokens(12)
    ix = AffixIndex(min_tokens=16, k=8, max_prompts=3)
    docs = [t(40) for _ in range(5)]
    for d in docs:
        ix.observe(t(10) + d + t(10))
    assert len(ix._prompts) == 3 and ix._num_tokens == 180
    assert [find(ix, t(5) + d + t(5)) for d in docs] == [None, None, (5, 45), (5, 45), (5, 45)]
    check_affix_index(ix)


def test_token_bound_and_identical_prompts():
    t = Tokens(13)
    ix = AffixIndex(min_tokens=16, k=8, max_prompts=100, max_tokens=200)
    a, b, c = t(90), t(90), t(90)
    ix.observe(a)
    ix.observe(b)
    ix.observe(a)  # identical: stored once, now the most recent
    assert len(ix._prompts) == 2 and ix._num_tokens == 180
    ix.observe(c)  # 270 > 200: the least recently added (b) goes
    assert len(ix._prompts) == 2 and ix.match(b) is None and ix.match(a) == AffixMatch(0, 90, "prefix")
    ix.observe(t(201))  # longer than the whole bound: not remembered, nothing forgotten
    assert len(ix._prompts) == 2 and ix.match(c) == AffixMatch(0, 90, "prefix")
    check_affix_index(ix)
    assert AffixIndex(min_tokens=16, k=8, max_prompts=0).observe(a) is None


def test_index_size_is_bounded():
    t = Tokens(14)
    ix = AffixIndex(min_tokens=32, k=8, max_prompts=8)
    for _ in range(300):
        ix.observe(t(t.rng.randrange(50, 200)))
    assert len(ix._prompts) == 8
    assert ix._num_tokens <= 8 * 200
    assert len(ix._kgrams) <= ix._num_tokens // ix.stride + 8
    check_affix_index(ix)


def test_kgram_lists_keep_the_most_recent_prompts():
    t = Tokens(19)
    ix = AffixIndex(min_tokens=16, k=8, max_hits=2)
    common = t(40)
    for _ in range(5):
        ix.observe(common + t(20))
    recs = list(ix._prompts.values())
    h = ai._kgram_hashes(recs[4].tokens, 8)[0]  # common's first k-gram
    assert [rec for rec, _ in ix._kgrams[h]] == recs[3:]
    check_affix_index(ix)


def test_check_affix_index_detects_corruption():
    def make():
        t = Tokens(20)
        ix = AffixIndex(min_tokens=16, k=8, max_prompts=3)
        for _ in range(3):
            ix.observe(t(40))
        ix.register(t(30))
        ix.register(t(3))
        return ix

    check_affix_index(make())
    first = lambda ix: next(iter(ix._prompts.values()))  # noqa: E731
    corruptions = [
        lambda ix: setattr(ix, "_num_tokens", ix._num_tokens + 1),  # token count off
        lambda ix: setattr(ix, "max_prompts", 2),  # over the bounds
        lambda ix: ix._prompts.pop(next(iter(ix._prompts))),  # a forgotten prompt still indexed
        lambda ix: ix._registered.popitem(),  # an unregistered affix still anchored
        lambda ix: ix._anchors.setdefault(None, []).append("0:x"),  # an anchor of nothing
        lambda ix: ix._kgrams[next(iter(ix._kgrams))].append((first(ix), 1)),  # an unindexed position
        lambda ix: ix._kgrams.__setitem__(123, [(first(ix), 0)]),  # a position under another hash
        lambda ix: ix._prompts.__setitem__("0:x", ix._prompts.pop(next(iter(ix._prompts)))),  # under a wrong key
    ]
    for corrupt in corruptions:
        ix = make()
        corrupt(ix)
        with pytest.raises(AssertionError):
            check_affix_index(ix)


def test_constructor_validates():
    for kw in [
        dict(k=0),
        dict(min_tokens=8, k=16),
        dict(max_prompts=-1),
        dict(max_hits=0),
        dict(max_tokens=-1),
        dict(work_factor=0),
    ]:
        with pytest.raises(ValueError):
            AffixIndex(**kw)


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
ix = AffixIndex(min_tokens=8, k=4, max_prompts=6, max_hits=2)
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
        ix = AffixIndex(min_tokens=16, k=8, max_prompts=5)
        return [ix.observe([x for b in rng.sample(blocks, 3) for x in b]) for _ in range(40)]

    assert run() == run()


# ---- against a brute-force oracle -------------------------------------------------------------------------------
def longest_common_span(q, prompts, min_len, at_start=False):
    """(length, start) of the longest run of q found in any prompt (starting at q[0] if at_start), earliest start on
    ties; by dynamic programming."""
    best = (0, 0)
    for p in prompts:
        prev = [0] * (len(p) + 1)
        for i in range(1, len(q) + 1):
            cur = [0] * (len(p) + 1)
            for j in range(1, len(p) + 1):
                if q[i - 1] == p[j - 1]:
                    cur[j] = prev[j - 1] + 1
                    n = cur[j]
                    if (n > best[0] or (n == best[0] and i - n < best[1])) and (i == n or not at_start):
                        best = (n, i - n)
            prev = cur
    return best if best[0] >= min_len else None


BLOCKS = [[1000 * b + i for i in range(n)] for b, n in enumerate([3, 5, 6, 9, 11, 14, 17, 20])]


@settings(max_examples=60, deadline=None, database=None)
@given(
    prompts=st.lists(st.permutations(range(len(BLOCKS))).map(lambda p: p[:5]), min_size=1, max_size=4),
    query=st.permutations(range(len(BLOCKS))),
    cut=st.integers(0, 4),
    prefer_prefix=st.booleans(),
)
def test_match_agrees_with_the_oracle(prompts, query, cut, prefer_prefix):
    """No k-gram repeats within a prompt and no more prompts than max_hits: the answers must be exact."""
    prompts = [[t for b in p for t in BLOCKS[b]][cut:] for p in prompts]
    q = [t for b in query[:5] for t in BLOCKS[b]]
    ix = AffixIndex(min_tokens=8, k=3, max_hits=4, work_factor=100, prefer_prefix=prefer_prefix)
    for p in prompts:
        ix.observe(p)
    check_affix_index(ix)
    want = longest_common_span(q, prompts, 8)
    prefix = longest_common_span(q, prompts, 8, at_start=True)
    if prefer_prefix and prefix is not None:
        want = prefix
    got = ix.match(q)
    assert got == (None if want is None else AffixMatch(want[1], want[1] + want[0], "span" if want[1] else "prefix"))


@settings(max_examples=60, deadline=None, database=None)
@given(
    reg=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), max_size=5),
    q=st.lists(st.integers(0, 4), max_size=30),
)
def test_registered_affixes_match_the_oracle(reg, q):
    ix = AffixIndex(min_tokens=4, k=3)
    for r in reg:
        ix.register(r)
    order = list(dict.fromkeys(map(tuple, reg)))  # registration order, duplicates once
    found = []
    for n, r in enumerate(order):
        s = next((i for i in range(len(q) - len(r) + 1) if tuple(q[i : i + len(r)]) == r), None)
        if s is not None:
            found.append((-len(r), s, n))
    m = ix.match(q)
    if found:
        assert m == AffixMatch(min(found)[1], min(found)[1] - min(found)[0], "registered")
    else:
        assert m is None or m.kind != "registered"
