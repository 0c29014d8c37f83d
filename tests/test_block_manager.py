"""BlockManager: page accounting of the paged KV pool (private pages, shared affix entries, LRU eviction)."""

import dataclasses
import hashlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dllm_jax.engine import block_manager as bm_mod
from dllm_jax.engine.block_manager import AffixEntry, BlockManager, OutOfPages, affix_key, pages_for


def snap(bm: BlockManager):
    """Everything observable about the manager's state (for "an error changed nothing")."""
    entries = {k: (e.tokens, list(e.pages), e.holders, e.last_used, e.ready) for k, e in bm._entries.items()}
    return (
        list(bm._free),
        bytes(bm._kind),
        list(bm._tag),
        entries,
        list(bm._lru),
        bm._clock,
        bm._num_private,
        bm._num_cached,
        bm._num_shared,
        list(bm._evicted),
        dataclasses.asdict(bm.stats),
    )


def ready(bm, tokens):
    """Acquire an affix, mark it computed, release it: a cached (unheld, evictable) entry."""
    e, _ = bm.acquire_affix(tokens)
    bm.mark_ready(e)
    bm.release_affix(e)
    return e


# ---- helpers ----------------------------------------------------------------------------------------------------
def test_pages_for():
    assert [pages_for(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert pages_for(7, 1) == 7
    for bad in [(-1, 4), (3, 0)]:
        with pytest.raises(ValueError):
            pages_for(*bad)


def test_affix_key_is_stable_and_content_addressed():
    # Pinned value: the key must not change across processes, machines or versions (it names stored K/V).
    want = hashlib.blake2b(b"\x01\0\0\0\x02\0\0\0\x03\0\0\0", digest_size=16).hexdigest()
    assert affix_key([1, 2, 3]) == "3:" + want == "3:b30a3c159d7e8193559a42a84f1fcae1"
    assert affix_key((1, 2, 3)) == affix_key([1, 2, 3]) == affix_key(range(1, 4))
    keys = {affix_key(t) for t in [[1, 2, 3], [3, 2, 1], [1, 2], [1, 2, 3, 0], [0], [], [2**31 - 1], [-1]]}
    assert len(keys) == 8
    assert affix_key([5] * 7).startswith("7:")
    with pytest.raises(ValueError):
        affix_key([2**31])


def test_constructor_validates():
    for bad in [(0, 4), (4, 0), (-1, 1)]:
        with pytest.raises(ValueError):
            BlockManager(*bad)


# ---- private pages ----------------------------------------------------------------------------------------------
def test_allocate_free_accounting_and_determinism():
    bm = BlockManager(8, 4)
    assert (bm.num_free_pages, bm.num_used_pages, bm.num_cached_pages, bm.num_shared_pages) == (8, 0, 0, 0)
    a = bm.allocate(3)
    assert a == [0, 1, 2]  # low pages first on a fresh pool
    b = bm.allocate(2, owner="r1")
    assert b == [3, 4]
    assert (bm.num_free_pages, bm.num_private_pages, bm.num_used_pages) == (3, 5, 5)
    assert bm.allocate(0) == []
    bm.free(a)
    assert bm.num_free_pages == 6 and bm.num_private_pages == 2
    assert sorted(bm.allocate(3)) == [0, 1, 2]  # freed pages are reused first
    bm.check_invariants()
    assert BlockManager(8, 4).allocate(5) == BlockManager(8, 4).allocate(5)


def test_free_errors_change_nothing():
    bm = BlockManager(6, 2)
    a = bm.allocate(2, owner="a")
    e = ready(bm, [9, 9, 9])  # an entry of 2 pages
    held, _ = bm.acquire_affix([7])  # a held entry of 1 page
    cases = [  # (message, pages, owner)
        ("already free", [5], None),
        ("not in the pool", [6], None),
        ("not in the pool", [-1], None),
        ("belongs to affix", [e.pages[0]], None),
        ("belongs to affix", [held.pages[0]], None),
        ("listed twice", [a[0], a[0]], "a"),
        ("allocated to 'a', not None", [a[0]], None),  # the wrong owner
        ("allocated to 'a', not 'b'", [a[1]], "b"),
    ]
    for msg, pages, owner in cases:
        before = snap(bm)
        with pytest.raises(ValueError, match=msg):
            bm.free(pages, owner)
        assert snap(bm) == before
    # a bad page anywhere in the list frees none of them
    before = snap(bm)
    with pytest.raises(ValueError):
        bm.free([a[0], 5], owner="a")
    assert snap(bm) == before
    bm.free(a, owner="a")
    with pytest.raises(ValueError, match="double free"):
        bm.free(a, owner="a")
    bm.check_invariants()


def test_count_arguments_validated():
    bm = BlockManager(4, 2)
    for f in (bm.allocate, bm.can_allocate):
        with pytest.raises(ValueError):
            f(-1)
    with pytest.raises(TypeError):
        bm.allocate(1.5)


def test_out_of_pages_is_atomic():
    bm = BlockManager(6, 2)
    c1 = ready(bm, [1, 1, 1])  # 2 cached pages
    c2 = ready(bm, [2])  # 1 cached page
    held, _ = bm.acquire_affix([3, 3])  # 1 held page
    bm.allocate(1)
    assert bm.num_free_pages == 1 and bm.num_available_pages == 4
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    before = snap(bm)
    with pytest.raises(OutOfPages):
        bm.allocate(5)  # evicting both cached entries would still not be enough: evict none
    assert snap(bm) == before
    with pytest.raises(OutOfPages):
        bm.acquire_affix([4] * 9)  # 5 pages
    assert snap(bm) == before and bm.get_affix(c1.key) is c1 and bm.get_affix(c2.key) is c2
    assert bm.evictions() == []
    assert bm.allocate(4) and bm.evictions() == [c1.key, c2.key]
    assert bm.get_affix(held.key) is held
    bm.check_invariants()


# ---- affix entries ----------------------------------------------------------------------------------------------
def test_acquire_miss_then_hit():
    bm = BlockManager(8, 4)
    toks = list(range(10))
    e, hit = bm.acquire_affix(toks)
    assert not hit and not e.ready and e.holders == 1 and e.tokens == tuple(toks) and len(e.pages) == 3
    assert e.key == affix_key(toks) and bm.get_affix(e.key) is e
    assert (bm.num_shared_pages, bm.num_used_pages, bm.num_cached_pages) == (3, 3, 0)
    e2, hit2 = bm.acquire_affix(tuple(toks))
    assert hit2 and e2 is e and e.holders == 2 and not e.ready  # a hit can still be waiting for the K/V
    assert (bm.stats.hits, bm.stats.misses) == (1, 1)
    bm.mark_ready(e)
    assert e.ready
    bm.release_affix(e)
    assert e.holders == 1 and bm.num_shared_pages == 3 and bm.lru_keys() == []
    bm.release_affix(e)
    assert e.holders == 0 and bm.num_shared_pages == 0 and bm.num_cached_pages == 3 and bm.lru_keys() == [e.key]
    assert bm.num_used_pages == 0 and bm.num_available_pages == 8
    e3, hit3 = bm.acquire_affix(toks)  # from the cache
    assert hit3 and e3 is e and e.ready and bm.num_cached_pages == 0
    bm.check_invariants()
    with pytest.raises(ValueError):
        bm.acquire_affix([])


def test_release_errors():
    bm = BlockManager(4, 2)
    e = ready(bm, [1, 2])
    before = snap(bm)
    with pytest.raises(ValueError, match="released more often"):
        bm.release_affix(e)  # holders would go below zero
    assert snap(bm) == before and e.holders == 0
    foreign = AffixEntry(key=e.key, tokens=e.tokens, pages=list(e.pages), holders=1, ready=True)
    with pytest.raises(ValueError, match="not stored here"):
        bm.release_affix(foreign)
    with pytest.raises(ValueError, match="not held"):
        bm.mark_ready(e)
    bm.allocate(4)  # evicts e
    assert bm.evictions() == [e.key] and bm.get_affix(e.key) is None
    with pytest.raises(ValueError, match="not stored here"):
        bm.release_affix(e)  # a stale reference to an evicted entry
    bm.check_invariants()


def test_unready_entry_is_dropped_on_last_release():
    bm = BlockManager(4, 2)
    e, _ = bm.acquire_affix([5, 6, 7])
    bm.acquire_affix([5, 6, 7])
    bm.release_affix(e)
    assert bm.get_affix(e.key) is e and bm.evictions() == []  # still held by the second request
    bm.release_affix(e)
    assert bm.get_affix(e.key) is None and bm.num_free_pages == 4 and bm.lru_keys() == []
    assert bm.evictions() == [e.key] and bm.stats.dropped == 1 and bm.stats.evictions == 0
    assert e.pages == []
    e2, hit = bm.acquire_affix([5, 6, 7])
    assert not hit and e2 is not e and not e2.ready
    bm.check_invariants()


def test_lru_order_follows_last_use_and_evictions_are_drained():
    bm = BlockManager(6, 1)
    a, b, c = ([10 + i] for i in range(3))
    ea, eb, ec = (bm.acquire_affix(t)[0] for t in (a, b, c))
    for e in (ea, eb, ec):
        bm.mark_ready(e)
    for e in (eb, ea, ec):  # release order is last-use order
        bm.release_affix(e)
    assert bm.lru_keys() == [eb.key, ea.key, ec.key]
    assert eb.last_used < ea.last_used < ec.last_used
    bm.release_affix(bm.acquire_affix(b)[0])  # using b again makes it most recent
    assert bm.lru_keys() == [ea.key, ec.key, eb.key]
    assert bm.get_affix(ea.key) is ea and bm.lru_keys()[0] == ea.key  # get_affix does not touch the order
    bm.allocate(4)  # 3 free pages: one eviction, the least recently used
    assert bm.evictions() == [ea.key] and ea.pages == []
    assert bm.evictions() == []  # drained
    x = bm.allocate(2)
    assert bm.evictions() == [ec.key, eb.key] and bm.stats.evictions == 3
    bm.free(x)
    e, hit = bm.acquire_affix(a)  # re-acquiring an evicted affix: a miss, a new entry
    assert bm.stats.misses == 4  # (3 + this one; the hit on b was a hit)
    assert not hit and e is not ea and not e.ready
    bm.check_invariants()


def test_held_entry_is_never_evicted():
    bm = BlockManager(4, 2)
    held, _ = bm.acquire_affix([1, 2, 3])  # 2 pages
    bm.mark_ready(held)
    assert not bm.can_allocate(3)
    with pytest.raises(OutOfPages):
        bm.allocate(3)
    with pytest.raises(OutOfPages):
        bm.acquire_affix([4, 5, 6, 7, 8])
    assert bm.get_affix(held.key) is held and held.ready and bm.evictions() == []
    bm.allocate(2)
    bm.check_invariants()


def test_key_collision_is_refused(monkeypatch):
    bm = BlockManager(8, 2)
    monkeypatch.setattr(bm_mod, "affix_key", lambda tokens: "0:same")
    e, _ = bm.acquire_affix([1, 2])
    before = snap(bm)
    with pytest.raises(ValueError, match="collision"):
        bm.acquire_affix([3, 4])
    with pytest.raises(ValueError, match="collision"):
        bm.plan_admission(1, [3, 4])
    assert snap(bm) == before and e.tokens == (1, 2)


def test_slots_layout():
    bm = BlockManager(8, 4)
    assert bm.slots([5, 2], 6) == [20, 21, 22, 23, 8, 9]
    assert bm.slots([5, 2], 3, start=3) == [23, 8, 9]
    assert bm.slots([5, 2], 0, start=8) == []
    assert bm.slots([5, 2], 8) == [20, 21, 22, 23, 8, 9, 10, 11]
    for n, start in [(9, 0), (2, 7), (1, -1)]:
        with pytest.raises(ValueError):
            bm.slots([5, 2], n, start)
    # An entry's token j lives where the docs say.
    e, _ = bm.acquire_affix(list(range(11)))
    assert bm.slots(e.pages, 11) == [e.pages[j // 4] * 4 + j % 4 for j in range(11)]


@settings(max_examples=60, deadline=None, database=None)
@given(
    page_size=st.integers(1, 8), pages=st.lists(st.integers(0, 63), min_size=1, max_size=8, unique=True), data=st.data()
)
def test_slots_are_a_bijection_onto_the_pages(page_size, pages, data):
    bm = BlockManager(64, page_size)
    cap = len(pages) * page_size
    start = data.draw(st.integers(0, cap))
    n = data.draw(st.integers(0, cap - start))
    s = bm.slots(pages, n, start)
    assert len(set(s)) == n
    assert all(x // page_size in pages for x in s)
    assert s == bm.slots(pages, cap)[start : start + n]


# ---- admission --------------------------------------------------------------------------------------------------
def test_plan_admission():
    bm = BlockManager(10, 4)
    bm.allocate(4)  # 6 left
    assert bm.plan_admission(6) and not bm.plan_admission(7)
    aff = list(range(8))  # 2 pages
    assert bm.plan_admission(4, aff) and not bm.plan_admission(5, aff)  # miss: its 2 pages come on top
    e = ready(bm, aff)  # cached: 4 free + 2 evictable
    assert bm.can_allocate(6)  # the private pages alone would fit by evicting it...
    assert not bm.plan_admission(6, aff)  # ...but acquiring it makes it unevictable
    assert bm.plan_admission(4, aff)
    other = ready(bm, [99] * 5)  # 2 more cached pages (2 free + 4 evictable)
    assert bm.plan_admission(4, aff) and not bm.plan_admission(5, aff)
    held, _ = bm.acquire_affix(aff)  # held: not evictable by anyone, and needs nothing more
    assert bm.plan_admission(4, aff) and not bm.plan_admission(5, aff) and bm.plan_admission(4, [99] * 5) is False
    bm.release_affix(held)
    before = snap(bm)
    for args in [(0,), (3, aff), (9,), (8, [1])]:
        bm.plan_admission(*args)
    assert snap(bm) == before  # no side effects
    assert other.holders == 0 and e.holders == 0


def test_admit_acquires_the_affix_before_allocating():
    bm = BlockManager(6, 2)
    aff = [1, 2, 3, 4]  # 2 pages
    e = ready(bm, aff)
    ready(bm, [8, 8])  # 1 more cached page, more recent: `e` is the first to evict
    bm.allocate(1)  # 2 free, 3 evictable
    before = snap(bm)
    with pytest.raises(OutOfPages):
        bm.admit(4, aff)
    assert snap(bm) == before
    pages, entry, hit = bm.admit(3, aff, owner="req")
    assert entry is e and hit and e.holders == 1 and len(pages) == 3  # e survived; the other entry was evicted
    assert bm.evictions() == [affix_key([8, 8])]
    bm.free(pages, owner="req")
    pages, entry, hit = bm.admit(2)
    assert entry is None and not hit and len(pages) == 2
    bm.check_invariants()


def test_check_invariants_detects_corruption():
    def make():
        bm = BlockManager(4, 2)
        bm.allocate(1)
        return bm, ready(bm, [1, 2, 3])

    bm, _ = make()
    bm.check_invariants()
    corruptions = [
        lambda bm, e: bm._free.append(bm._free[-1]),  # a page free twice
        lambda bm, e: bm._free.pop(),  # a leaked page
        lambda bm, e: setattr(e, "holders", 1),  # held but in the LRU list
        lambda bm, e: setattr(bm, "_num_cached", 0),  # counter off
        lambda bm, e: e.pages.append(bm._free[-1]),  # a free page in an entry
        lambda bm, e: setattr(e, "ready", False),  # cached but never computed
        lambda bm, e: bm._kind.__setitem__(e.pages[0], 1),  # an entry's page marked private
    ]
    for corrupt in corruptions:
        bm, e = make()
        corrupt(bm, e)
        with pytest.raises(AssertionError):
            bm.check_invariants()


# ---- random sequences -------------------------------------------------------------------------------------------
AFFIXES = [tuple(range(100 * i, 100 * i + n)) for i, n in enumerate([1, 2, 3, 4, 5, 7, 9, 12])]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / free / acquire / release / eviction pressure / bad calls against a model of who holds
    what; the invariants run after every step."""

    @initialize(num_pages=st.integers(1, 12), page_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_pages, page_size):
        self.bm = BlockManager(num_pages, page_size)
        self.allocs: dict[int, list[int]] = {}  # owner -> private pages
        self.freed: list[tuple[int, list[int]]] = []  # (owner, pages) already freed
        self.next_owner = 0
        self.held: list[AffixEntry] = []  # one item per hold the model has
        self.stale: list[AffixEntry] = []  # entry objects no longer stored
        self.acquires = self.removed = 0

    def _entries(self):
        return dict(self.bm._entries)

    def _removal(self, before, lru_before, evicting: bool):
        """The removed entries are exactly those reported, none held, and (eviction) the least recently used."""
        ev = self.bm.evictions()
        held_keys = {e.key for e in self.held}
        assert set(ev) == set(before) - set(self.bm._entries) and len(ev) == len(set(ev))
        assert not set(ev) & held_keys
        if evicting:
            assert ev == lru_before[: len(ev)]
        self.stale += [before[k] for k in ev]
        self.removed += len(ev)
        return ev

    def _new_owner(self):
        self.next_owner += 1
        return self.next_owner

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        bm = self.bm
        before, entries, lru, fits = snap(bm), self._entries(), bm.lru_keys(), bm.can_allocate(n)
        owner = self._new_owner()
        try:
            pages = bm.allocate(n, owner)
        except OutOfPages:
            assert not fits and snap(bm) == before
            return
        assert fits and len(pages) == n
        self.allocs[owner] = pages
        self._removal(entries, lru, evicting=True)

    @rule()
    def pressure(self):
        """Take every page that can be taken: every unheld entry goes, in LRU order; then give them back."""
        bm = self.bm
        entries, lru, n = self._entries(), bm.lru_keys(), bm.num_available_pages
        pages = bm.allocate(n, "pressure")
        assert self._removal(entries, lru, evicting=True) == lru
        assert bm.num_free_pages == 0 and bm.num_cached_pages == 0 and bm.num_used_pages == bm.num_pages
        bm.free(pages, "pressure")

    @precondition(lambda self: self.allocs)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        owner = sorted(self.allocs)[i % len(self.allocs)]
        pages = self.allocs.pop(owner)
        self.bm.free(pages, owner)
        self.freed.append((owner, pages))

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(0, 99))
    def double_free(self, i):
        """Freeing pages again is refused whether they are still free or were handed to someone else since."""
        owner, pages = self.freed[i % len(self.freed)]
        if not pages:
            return
        before = snap(self.bm)
        with pytest.raises(ValueError):
            self.bm.free(pages, owner)
        assert snap(self.bm) == before

    @rule(page=st.integers(-2, 13))
    def free_foreign(self, page):
        """No page can be freed by an owner that does not hold it (free, private to another, or an entry's)."""
        before = snap(self.bm)
        with pytest.raises(ValueError):
            self.bm.free([page], owner="nobody")
        assert snap(self.bm) == before

    @rule(i=st.integers(0, len(AFFIXES) - 1))
    def acquire(self, i):
        bm, toks = self.bm, AFFIXES[i]
        before, entries, lru = snap(bm), self._entries(), bm.lru_keys()
        existing = bm.get_affix(affix_key(toks))
        fits = existing is not None or bm.can_allocate(pages_for(len(toks), bm.page_size))
        try:
            e, hit = bm.acquire_affix(toks)
        except OutOfPages:
            assert not fits and snap(bm) == before
            return
        assert fits and hit == (existing is not None) and (e is existing or not hit)
        assert e.last_used == bm._clock  # the latest use, hit or miss
        assert hit or (not e.ready and e.holders == 1)
        self.acquires += 1
        self.held.append(e)
        ev = self._removal(entries, lru, evicting=True)
        assert not (hit and ev)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def mark_ready(self, i):
        e = self.held[i % len(self.held)]
        self.bm.mark_ready(e)
        assert e.ready

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        bm = self.bm
        e = self.held.pop(i % len(self.held))
        entries, was_ready = self._entries(), e.ready
        bm.release_affix(e)
        ev = self._removal(entries, [], evicting=False)
        last = all(h is not e for h in self.held)
        if last and not was_ready:  # dropped: its pages never held K/V
            assert ev == [e.key] and e.pages == []
        else:
            assert ev == [] and bm.get_affix(e.key) is e
            assert (e.key in bm.lru_keys()) == last and (not last or bm.lru_keys()[-1] == e.key)

    @rule(i=st.integers(0, 99))
    def release_unheld(self, i):
        """Releasing an entry nobody holds (cached, or a stale object) is refused and changes nothing."""
        cands = [e for e in self.bm._entries.values() if e.holders == 0] + self.stale
        if not cands:
            return
        before = snap(self.bm)
        with pytest.raises(ValueError):
            self.bm.release_affix(cands[i % len(cands)])
        assert snap(self.bm) == before

    @rule(n=st.integers(0, 14), i=st.integers(-1, len(AFFIXES) - 1))
    def admit(self, n, i):
        bm = self.bm
        toks = None if i < 0 else AFFIXES[i]
        entries, lru, before = self._entries(), bm.lru_keys(), snap(bm)
        planned = bm.plan_admission(n, toks)
        assert snap(bm) == before
        owner = self._new_owner()
        try:
            pages, e, hit = bm.admit(n, toks, owner)
        except OutOfPages:
            assert not planned and snap(bm) == before
            return
        assert planned and len(pages) == n
        self.allocs[owner] = pages
        if e is not None:
            self.acquires += 1
            self.held.append(e)
            assert bm.get_affix(e.key) is e
            lru = [k for k in lru if k != e.key]  # a hit is held before the private pages evict: never evicted
        self._removal(entries, lru, evicting=True)

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants()
        # Every page in exactly one place: the free list, one owner's allocation, or one entry.
        places = Counter(bm._free)
        for pages in self.allocs.values():
            places.update(pages)
        for e in bm._entries.values():
            places.update(e.pages)
        assert places == Counter(range(bm.num_pages))
        assert bm.num_private_pages == sum(map(len, self.allocs.values()))
        for owner, pages in self.allocs.items():
            assert all(bm._tag[p] == owner for p in pages)
        # The holders the model has are the entries' holders, and held entries are stored.
        holds = Counter(id(e) for e in self.held)
        for e in self.held:
            assert bm.get_affix(e.key) is e and e.holders == holds[id(e)]
        assert all(e.holders == 0 for e in bm._entries.values() if id(e) not in holds)
        assert bm.num_shared_pages == sum(len(e.pages) for e in bm._entries.values() if e.holders)
        assert bm.num_free_pages + bm.num_cached_pages + bm.num_used_pages == bm.num_pages
        assert bm.num_used_pages == bm.num_private_pages + bm.num_shared_pages
        assert bm.stats.hits + bm.stats.misses == self.acquires
        assert bm.stats.evictions + bm.stats.dropped == self.removed
        assert all(e.pages == [] for e in self.stale)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
