"""BlockManager: page accounting of the paged KV pool (private pages, shared affix entries, LRU eviction)."""

import hashlib
from collections import Counter

import pytest
from engine_invariants import check_block_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dllm_jax.engine import block_manager as bm_mod
from dllm_jax.engine.block_manager import AffixEntry, BlockManager, OutOfPages, affix_key, pages_for


def snap(bm: BlockManager):
    """Everything observable about the manager's state (for "an error changed nothing")."""
    entries = {k: (e.tokens, list(e.pages), e.holders, e.ready) for k, e in bm._entries.items()}
    return list(bm._free), dict(bm._owners), entries, list(bm._lru), bm._num_cached, list(bm._evicted)


def allocate(bm, n, owner=None):
    """Private pages only: admit without an affix."""
    return bm.admit(n, owner=owner)[0]


def acquire(bm, tokens):
    """A hold on the entry of `tokens` and no private pages: (entry, hit)."""
    _, e, hit = bm.admit(0, tokens)
    return e, hit


def ready(bm, tokens):
    """Acquire an affix, mark it computed, release it: a cached (unheld, evictable) entry."""
    e, _ = acquire(bm, tokens)
    bm.mark_ready(e)
    bm.release_affix(e)
    return e


def stored(bm, key):
    return bm._entries.get(key)


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
    a = allocate(bm, 3)
    assert a == [0, 1, 2]  # low pages first on a fresh pool
    b = allocate(bm, 2, owner="r1")
    assert b == [3, 4]
    assert (bm.num_free_pages, bm.num_used_pages, bm.num_shared_pages, bm.num_available_pages) == (3, 5, 0, 3)
    assert allocate(bm, 0) == []
    bm.free(a)
    assert bm.num_free_pages == 6 and bm.num_used_pages == 2
    assert sorted(allocate(bm, 3)) == [0, 1, 2]  # freed pages are reused first
    check_block_manager(bm)
    assert allocate(BlockManager(8, 4), 5) == allocate(BlockManager(8, 4), 5)


def test_free_errors_change_nothing():
    bm = BlockManager(6, 2)
    a = allocate(bm, 2, owner="a")
    e = ready(bm, [9, 9, 9])  # an entry of 2 pages
    held, _ = acquire(bm, [7])  # a held entry of 1 page
    cases = [  # (message, pages, owner)
        ("already free", [5], None),
        ("not in the pool", [6], None),
        ("not in the pool", [-1], None),
        ("part of an affix entry", [e.pages[0]], None),
        ("part of an affix entry", [held.pages[0]], None),
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
    check_block_manager(bm)


def test_count_arguments_validated():
    bm = BlockManager(4, 2)
    for f in (bm.admit, bm.plan_admission):
        with pytest.raises(ValueError):
            f(-1)
        with pytest.raises(TypeError):
            f(1.5)


def test_out_of_pages_is_atomic():
    bm = BlockManager(6, 2)
    c1 = ready(bm, [1, 1, 1])  # 2 cached pages
    c2 = ready(bm, [2])  # 1 cached page
    held, _ = acquire(bm, [3, 3])  # 1 held page
    allocate(bm, 1)
    assert bm.num_free_pages == 1 and bm.num_available_pages == 4
    assert bm.plan_admission(4) and not bm.plan_admission(5)
    before = snap(bm)
    with pytest.raises(OutOfPages):
        allocate(bm, 5)  # evicting both cached entries would still not be enough: evict none
    assert snap(bm) == before
    with pytest.raises(OutOfPages):
        acquire(bm, [4] * 9)  # 5 pages
    assert snap(bm) == before and stored(bm, c1.key) is c1 and stored(bm, c2.key) is c2
    assert bm.evictions() == []
    assert allocate(bm, 4) and bm.evictions() == [c1.key, c2.key]
    assert stored(bm, held.key) is held
    check_block_manager(bm)


# ---- affix entries ----------------------------------------------------------------------------------------------
def test_acquire_miss_then_hit():
    bm = BlockManager(8, 4)
    toks = list(range(10))
    e, hit = acquire(bm, toks)
    assert not hit and not e.ready and e.holders == 1 and e.tokens == tuple(toks) and len(e.pages) == 3
    assert e.key == affix_key(toks) and stored(bm, e.key) is e
    assert (bm.num_shared_pages, bm.num_used_pages, bm.num_cached_pages) == (3, 3, 0)
    e2, hit2 = acquire(bm, tuple(toks))
    assert hit2 and e2 is e and e.holders == 2 and not e.ready  # a hit can still be waiting for the K/V
    bm.mark_ready(e)
    assert e.ready
    bm.release_affix(e)
    assert e.holders == 1 and bm.num_shared_pages == 3 and list(bm._lru) == []
    bm.release_affix(e)
    assert e.holders == 0 and bm.num_shared_pages == 0 and bm.num_cached_pages == 3 and list(bm._lru) == [e.key]
    assert bm.num_used_pages == 0 and bm.num_available_pages == 8
    e3, hit3 = acquire(bm, toks)  # from the cache
    assert hit3 and e3 is e and e.ready and bm.num_cached_pages == 0
    check_block_manager(bm)
    for f in (bm.admit, bm.plan_admission):
        with pytest.raises(ValueError):
            f(0, [])


def test_release_errors():
    bm = BlockManager(4, 2)
    e = ready(bm, [1, 2])
    before = snap(bm)
    with pytest.raises(ValueError, match="not held"):
        bm.release_affix(e)  # holders would go below zero
    assert snap(bm) == before and e.holders == 0
    foreign = AffixEntry(key=e.key, tokens=e.tokens, pages=list(e.pages), holders=1, ready=True)
    with pytest.raises(ValueError, match="not stored here"):
        bm.release_affix(foreign)
    with pytest.raises(ValueError, match="not stored here"):
        bm.mark_ready(foreign)
    with pytest.raises(ValueError, match="not held"):
        bm.mark_ready(e)
    assert snap(bm) == before
    allocate(bm, 4)  # evicts e
    assert bm.evictions() == [e.key] and stored(bm, e.key) is None
    with pytest.raises(ValueError, match="not stored here"):
        bm.release_affix(e)  # a stale reference to an evicted entry
    check_block_manager(bm)


def test_unready_entry_is_dropped_on_last_release():
    bm = BlockManager(4, 2)
    e, _ = acquire(bm, [5, 6, 7])
    acquire(bm, [5, 6, 7])
    bm.release_affix(e)
    assert stored(bm, e.key) is e and bm.evictions() == []  # still held by the second request
    pages = list(e.pages)
    bm.release_affix(e)  # dropped at once, not cached (nothing was allocated: no eviction)
    assert stored(bm, e.key) is None and bm.num_free_pages == 4 and list(bm._lru) == []
    assert bm.evictions() == [e.key] and e.pages == []
    e2, hit = acquire(bm, [5, 6, 7])
    assert not hit and e2 is not e and not e2.ready
    assert e2.pages == pages  # a removed entry's pages are handed out again in their old order
    check_block_manager(bm)


def test_lru_order_follows_last_use_and_evictions_are_drained():
    bm = BlockManager(6, 1)
    a, b, c = ([10 + i] for i in range(3))
    ea, eb, ec = (acquire(bm, t)[0] for t in (a, b, c))
    for e in (ea, eb, ec):
        bm.mark_ready(e)
    for e in (eb, ea, ec):  # release order is last-use order
        bm.release_affix(e)
    assert list(bm._lru) == [eb.key, ea.key, ec.key]
    e, hit = acquire(bm, b)  # using b again makes it most recent
    assert hit and e is eb
    bm.release_affix(eb)
    assert list(bm._lru) == [ea.key, ec.key, eb.key]
    allocate(bm, 4)  # 3 free pages: one eviction, the least recently used
    assert bm.evictions() == [ea.key] and ea.pages == []
    assert bm.evictions() == []  # drained
    x = allocate(bm, 2)
    assert bm.evictions() == [ec.key, eb.key]
    bm.free(x)
    e, hit = acquire(bm, a)  # re-acquiring an evicted affix: a miss, a new entry
    assert not hit and e is not ea and not e.ready
    check_block_manager(bm)


def test_drop_cached_removes_unheld_entries_only():
    bm = BlockManager(8, 2)
    c1, c2 = ready(bm, [1, 2, 3]), ready(bm, [4])
    held, _ = acquire(bm, [5, 6])
    bm.mark_ready(held)
    assert bm.drop_cached() == 2 and bm.evictions() == [c1.key, c2.key] and c1.pages == c2.pages == []
    assert stored(bm, held.key) is held and bm.num_cached_pages == 0 and bm.num_free_pages == 7
    assert bm.drop_cached() == 0 and bm.evictions() == []
    check_block_manager(bm)


def test_held_entry_is_never_evicted():
    bm = BlockManager(4, 2)
    held, _ = acquire(bm, [1, 2, 3])  # 2 pages
    bm.mark_ready(held)
    assert not bm.plan_admission(3)
    with pytest.raises(OutOfPages):
        allocate(bm, 3)
    with pytest.raises(OutOfPages):
        acquire(bm, [4, 5, 6, 7, 8])
    assert stored(bm, held.key) is held and held.ready and bm.evictions() == []
    allocate(bm, 2)
    check_block_manager(bm)


def test_key_collision_is_refused(monkeypatch):
    bm = BlockManager(8, 2)
    monkeypatch.setattr(bm_mod, "affix_key", lambda tokens: "0:same")
    e, _ = acquire(bm, [1, 2])
    before = snap(bm)
    with pytest.raises(ValueError, match="collision"):
        acquire(bm, [3, 4])
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
    e, _ = acquire(bm, list(range(11)))
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
    allocate(bm, 4)  # 6 left
    assert bm.plan_admission(6) and not bm.plan_admission(7)
    aff = list(range(8))  # 2 pages
    assert bm.plan_admission(4, aff) and not bm.plan_admission(5, aff)  # miss: its 2 pages come on top
    e = ready(bm, aff)  # cached: 4 free + 2 evictable
    assert bm.plan_admission(6)  # the private pages alone would fit by evicting it...
    assert not bm.plan_admission(6, aff)  # ...but acquiring it makes it unevictable
    assert bm.plan_admission(4, aff)
    other = ready(bm, [99] * 5)  # 2 more cached pages (2 free + 4 evictable)
    assert bm.plan_admission(4, aff) and not bm.plan_admission(5, aff)
    held, _ = acquire(bm, aff)  # held: not evictable by anyone, and needs nothing more
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
    allocate(bm, 1)  # 2 free, 3 evictable
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
    check_block_manager(bm)


def test_check_block_manager_detects_corruption():
    def make():
        bm = BlockManager(4, 2)
        allocate(bm, 1)
        return bm, ready(bm, [1, 2, 3])

    bm, _ = make()
    check_block_manager(bm)
    corruptions = [
        lambda bm, e: bm._free.append(bm._free[-1]),  # a page free twice
        lambda bm, e: bm._free.pop(),  # a leaked page
        lambda bm, e: setattr(e, "holders", 1),  # held but in the LRU list
        lambda bm, e: setattr(bm, "_num_cached", 0),  # counter off
        lambda bm, e: e.pages.append(bm._free[-1]),  # a free page in an entry
        lambda bm, e: setattr(e, "ready", False),  # cached but never computed
        lambda bm, e: bm._owners.__setitem__(e.pages[0], None),  # an entry's page also private
        lambda bm, e: setattr(e, "key", "0:other"),  # stored under another key
        lambda bm, e: setattr(e, "holders", -1),  # released more often than acquired
        lambda bm, e: bm._lru.__setitem__("0:gone", AffixEntry("0:gone", (1,), [], ready=True)),  # a removed entry
    ]
    for corrupt in corruptions:
        bm, e = make()
        corrupt(bm, e)
        with pytest.raises(AssertionError):
            check_block_manager(bm)


# ---- random sequences -------------------------------------------------------------------------------------------
AFFIXES = [tuple(range(100 * i, 100 * i + n)) for i, n in enumerate([1, 2, 3, 4, 5, 7, 9, 12])]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocations / frees / affix holds / releases / eviction pressure / bad calls against a model of who
    holds what and of the LRU order; the invariants run after every step."""

    @initialize(num_pages=st.integers(1, 12), page_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_pages, page_size):
        self.bm = BlockManager(num_pages, page_size)
        self.allocs: dict[int, list[int]] = {}  # owner -> private pages
        self.freed: list[tuple[int, list[int]]] = []  # (owner, pages) already freed
        self.next_owner = 0
        self.held: list[AffixEntry] = []  # one item per hold the model has
        self.lru: list[str] = []  # the model's unheld entries, least recently released first
        self.stale: list[AffixEntry] = []  # entry objects no longer stored

    def _removal(self, before, evicting: bool):
        """The removed entries are exactly those reported, none held, and (eviction) the least recently used."""
        ev = self.bm.evictions()
        assert set(ev) == set(before) - set(self.bm._entries) and len(ev) == len(set(ev))
        assert not set(ev) & {e.key for e in self.held}
        if evicting:
            assert ev == self.lru[: len(ev)]
        self.lru = [k for k in self.lru if k not in ev]
        self.stale += [before[k] for k in ev]
        return ev

    def _admit(self, n, toks):
        """admit against the model: plan_admission's answer, no change on OutOfPages, hit or a new unready entry."""
        bm = self.bm
        existing = None if toks is None else stored(bm, affix_key(toks))
        need = n + (pages_for(len(toks), bm.page_size) if toks is not None and existing is None else 0)
        pinned = len(existing.pages) if existing is not None and existing.holders == 0 else 0
        entries, before = dict(bm._entries), snap(bm)
        planned = bm.plan_admission(n, toks)
        assert planned == (need <= bm.num_available_pages - pinned) and snap(bm) == before
        self.next_owner += 1
        owner = self.next_owner
        try:
            pages, e, hit = bm.admit(n, toks, owner)
        except OutOfPages:
            assert not planned and snap(bm) == before
            return
        assert planned and len(pages) == n and hit == (existing is not None)
        self.allocs[owner] = pages
        if e is not None:
            assert e is existing if hit else (not e.ready and e.holders == 1 and e.tokens == toks)
            self.held.append(e)
            if e.key in self.lru:  # a hit is held before the private pages evict: never evicted
                self.lru.remove(e.key)
        ev = self._removal(entries, evicting=True)
        assert not (hit and n == 0 and ev)

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        self._admit(n, None)

    @rule(i=st.integers(0, len(AFFIXES) - 1))
    def acquire(self, i):
        self._admit(0, AFFIXES[i])

    @rule(n=st.integers(0, 14), i=st.integers(-1, len(AFFIXES) - 1))
    def admit(self, n, i):
        self._admit(n, None if i < 0 else AFFIXES[i])

    @rule()
    def pressure(self):
        """Take every page that can be taken: every unheld entry goes, in LRU order; then give them back."""
        bm = self.bm
        entries, lru = dict(bm._entries), list(self.lru)
        pages = allocate(bm, bm.num_available_pages, "pressure")
        assert self._removal(entries, evicting=True) == lru
        assert bm.num_free_pages == 0 and bm.num_cached_pages == 0 and bm.num_used_pages == bm.num_pages
        bm.free(pages, "pressure")

    @rule()
    def drop_cached(self):
        entries, lru = dict(self.bm._entries), list(self.lru)
        assert self.bm.drop_cached() == len(lru)
        assert self._removal(entries, evicting=True) == lru

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

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def mark_ready(self, i):
        e = self.held[i % len(self.held)]
        self.bm.mark_ready(e)
        assert e.ready

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        e = self.held.pop(i % len(self.held))
        entries, was_ready = dict(self.bm._entries), e.ready
        self.bm.release_affix(e)
        last = all(h is not e for h in self.held)
        if last and was_ready:  # cached: the most recently used
            self.lru.append(e.key)
        ev = self._removal(entries, evicting=False)
        if last and not was_ready:  # dropped: its pages never held K/V
            assert ev == [e.key] and e.pages == []
        else:
            assert ev == [] and stored(self.bm, e.key) is e

    @rule(i=st.integers(0, 99))
    def release_unheld(self, i):
        """Releasing or readying an entry nobody holds (cached, or a stale object) is refused and changes nothing."""
        cands = [e for e in self.bm._entries.values() if e.holders == 0] + self.stale
        if not cands:
            return
        before = snap(self.bm)
        for f in (self.bm.release_affix, self.bm.mark_ready):
            with pytest.raises(ValueError):
                f(cands[i % len(cands)])
        assert snap(self.bm) == before

    @invariant()
    def consistent(self):
        bm = self.bm
        check_block_manager(bm)
        # Private pages are exactly the model's allocations, each with its owner.
        assert bm._owners == {p: owner for owner, pages in self.allocs.items() for p in pages}
        # The holders the model has are the entries' holders, held entries are stored, the LRU order is the model's.
        holds = Counter(id(e) for e in self.held)
        for e in self.held:
            assert stored(bm, e.key) is e and e.holders == holds[id(e)]
        assert all(e.holders == 0 for e in bm._entries.values() if id(e) not in holds)
        assert list(bm._lru) == self.lru
        assert bm.num_shared_pages == sum(len(e.pages) for e in bm._entries.values() if e.holders)
        assert bm.num_cached_pages == sum(len(bm._entries[k].pages) for k in self.lru)
        assert bm.num_free_pages + bm.num_cached_pages + bm.num_used_pages == bm.num_pages
        assert bm.num_used_pages == sum(map(len, self.allocs.values())) + bm.num_shared_pages
        assert all(e.pages == [] for e in self.stale)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
