"""Host-side page bookkeeping of the engine's paged KV pool (pure Python: never touches device arrays).

The pool holds `num_pages` pages of `page_size` consecutive slots (page p: slots p*page_size ..). Every page is in
exactly one place: the free list; one running request's private allocation (`allocate` / `free`, reserved at
admission so that a request never runs out midway); or one shared affix entry (`acquire_affix` / `release_affix`):
one stored copy of an affix's K/V, computed alone at positions 0..A-1 and keyed by `affix_key`. Held entries are
never evicted; unheld ones stay cached and are evicted least recently used first when pages are needed. Every
operation that can fail checks first, so an error (`OutOfPages`, `ValueError`) leaves everything unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import sys
from array import array
from collections import OrderedDict
from typing import Any, Hashable, Sequence

__all__ = ["AffixEntry", "BlockManager", "BlockStats", "OutOfPages", "affix_key", "pages_for", "token_bytes"]
_FREE, _PRIVATE, _AFFIX = 0, 1, 2  # page kinds (one byte per page): where the page is now


class OutOfPages(RuntimeError):
    """Not enough free plus evictable pages. Raised before anything changed: the manager's state is as before."""


def token_array(tokens: Sequence[int]) -> array:
    """`tokens` as an int32 array (4 bytes a token; slices compare in C). Raises ValueError outside int32."""
    try:
        return array("i", tokens)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None


def token_bytes(tokens: Sequence[int] | array) -> bytes:
    """The tokens as little-endian int32 bytes: the same on every machine, so hashes of them are stable."""
    a = tokens if isinstance(tokens, array) and tokens.typecode == "i" else token_array(tokens)
    if sys.byteorder == "big":
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def affix_key(tokens: Sequence[int]) -> str:
    """Content key of an affix: its length and a 128-bit BLAKE2b of its int32 tokens ("<len>:<hex>"). Stable across
    processes and machines (unlike Python's `hash`); callers still compare tokens, never trusting a hash alone."""
    data = token_bytes(tokens)
    return f"{len(data) // 4}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def pages_for(n_tokens: int, page_size: int) -> int:
    """Pages needed to hold `n_tokens` slots: ceil(n_tokens / page_size)."""
    n_tokens, page_size = operator.index(n_tokens), operator.index(page_size)
    if n_tokens < 0 or page_size < 1:
        raise ValueError(f"pages_for needs n_tokens >= 0 and page_size >= 1, got {n_tokens}, {page_size}")
    return -(-n_tokens // page_size)


@dataclasses.dataclass(eq=False)  # identity semantics: an entry is one stored copy, not a value
class AffixEntry:
    """One stored copy of an affix's K/V. Read its fields; change it only through the BlockManager."""

    key: str  # affix_key(tokens)
    tokens: tuple[int, ...]
    pages: list[int]  # token j lives in slot pages[j // page_size] * page_size + j % page_size
    holders: int = 0  # running requests using it; > 0 means it can never be evicted
    last_used: int = 0  # logical clock of the last acquire or release (LRU order of unheld entries)
    ready: bool = False  # its K/V has been computed (mark_ready); only held entries can be not ready


@dataclasses.dataclass
class BlockStats:
    """Counters since construction (metrics)."""

    hits: int = 0  # acquire_affix found the entry stored
    misses: int = 0  # acquire_affix created a new entry
    evictions: int = 0  # unheld entries evicted for their pages (LRU)
    dropped: int = 0  # entries released by their last holder before they were ready (their pages held no K/V)


class BlockManager:
    """Pages of one preallocated KV pool: private allocations of requests and shared, reference-counted affix
    entries with LRU eviction of unheld ones. Deterministic: the same calls always give the same pages."""

    def __init__(self, num_pages: int, page_size: int):
        num_pages, page_size = operator.index(num_pages), operator.index(page_size)
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        # A stack: pop() hands out low page numbers first on a fresh pool; a freed page is reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._kind = bytearray(num_pages)  # _FREE / _PRIVATE / _AFFIX per page
        self._tag: list[Any] = [None] * num_pages  # a private page's owner tag, or an affix page's entry key
        self._entries: dict[str, AffixEntry] = {}
        self._lru: OrderedDict[str, AffixEntry] = OrderedDict()  # unheld entries, least recently used first
        self._clock = self._num_private = 0
        self._num_cached = self._num_shared = 0  # pages of unheld (evictable) and of held entries
        self._evicted: list[str] = []
        self.stats = BlockStats()

    @property
    def num_free_pages(self) -> int:  # on the free list
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:  # of unheld affix entries: cached for reuse, evictable on demand
        return self._num_cached

    @property
    def num_shared_pages(self) -> int:  # of affix entries with at least one holder
        return self._num_shared

    @property
    def num_private_pages(self) -> int:  # allocated to requests
        return self._num_private

    @property
    def num_used_pages(self) -> int:  # that cannot be taken now: private pages plus held entries' pages
        return self._num_private + self._num_shared

    @property
    def num_available_pages(self) -> int:  # an allocation may take now: free plus evictable
        return len(self._free) + self._num_cached

    def lru_keys(self) -> list[str]:
        """Keys of the unheld entries in eviction order (least recently used first)."""
        return list(self._lru)

    def can_allocate(self, n_pages: int) -> bool:
        """Whether `allocate(n_pages)` would succeed now (counting evictable entries' pages). No side effects."""
        return _count(n_pages) <= self.num_available_pages

    def allocate(self, n_pages: int, owner: Hashable = None) -> list[int]:
        """`n_pages` private pages, tagged with `owner` (free must name the same owner), evicting unheld entries if
        the free list is short (OutOfPages, changing nothing, if even that is not enough)."""
        pages = self._take(_count(n_pages), _PRIVATE, owner, "need")
        self._num_private += len(pages)
        return pages

    def _take(self, n: int, kind: int, tag: Hashable, needs: str) -> list[int]:
        """`n` pages off the free list (evicting unheld entries, least recently used first, if it is short) marked
        `kind` and `tag`; OutOfPages ("`needs` n pages, ..."), changing nothing, if even evicting is not enough."""
        if n > self.num_available_pages:
            raise OutOfPages(
                f"{needs} {n} pages, {len(self._free)} free + {self._num_cached} evictable of {self.num_pages}"
            )
        while len(self._free) < n:
            self._drop_lru()
            self.stats.evictions += 1
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._kind[p], self._tag[p] = kind, tag
        return pages

    def free(self, pages: Sequence[int], owner: Hashable = None) -> None:
        """Return private pages to the free list. ValueError, changing nothing, if any page is out of range, free
        (double free), part of an affix entry, allocated to another owner, or listed twice."""
        pages = [operator.index(p) for p in pages]
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not in the pool (0..{self.num_pages - 1})")
            if p in seen:
                raise ValueError(f"page {p} listed twice")
            seen.add(p)
            kind = self._kind[p]
            if kind == _FREE:
                raise ValueError(f"page {p} is already free (double free)")
            if kind == _AFFIX:
                raise ValueError(f"page {p} belongs to affix entry {self._tag[p]}: release the entry instead")
            if self._tag[p] != owner:
                raise ValueError(f"page {p} is allocated to {self._tag[p]!r}, not {owner!r}")
        self._to_free(pages)
        self._num_private -= len(pages)

    def get_affix(self, key: str) -> AffixEntry | None:
        """The stored entry of `key` (held or cached), without acquiring it or touching its LRU position."""
        return self._entries.get(key)

    def acquire_affix(self, tokens: Sequence[int]) -> tuple[AffixEntry, bool]:
        """Take a hold on the entry of `tokens`: (entry, True) if stored (a hit, maybe not ready yet), else (a new
        unready entry, False) whose K/V the caller computes, then mark_ready. OutOfPages, changing nothing, if it
        does not fit even after evicting every unheld entry."""
        toks = _tokens(tokens)
        key = affix_key(toks)
        entry = self._entries.get(key)
        if entry is not None:
            _check_same(entry, toks)
            if entry.holders == 0:  # leaves the evictable set
                del self._lru[key]
                self._num_cached -= len(entry.pages)
                self._num_shared += len(entry.pages)
            entry.holders += 1
            entry.last_used = self._tick()
            self.stats.hits += 1
            return entry, True
        pages = self._take(pages_for(len(toks), self.page_size), _AFFIX, key, f"affix of {len(toks)} tokens needs")
        entry = AffixEntry(key=key, tokens=toks, pages=pages, holders=1, last_used=self._tick())
        self._entries[key] = entry
        self._num_shared += len(pages)
        self.stats.misses += 1
        return entry, False

    def mark_ready(self, entry: AffixEntry) -> None:
        """Record that the entry's K/V has been written (only a holder can: an unheld entry is always ready)."""
        self._check_stored(entry)
        if entry.holders < 1:
            raise ValueError(f"affix entry {entry.key} is not held")
        entry.ready = True

    def release_affix(self, entry: AffixEntry) -> None:
        """Drop one hold (ValueError, changing nothing, if it has none). The last makes it evictable, most recently
        used; an entry never made ready is dropped at once instead (reported by evictions() like an evicted one)."""
        self._check_stored(entry)
        if entry.holders < 1:
            raise ValueError(f"affix entry {entry.key} released more often than acquired")
        entry.holders -= 1
        entry.last_used = self._tick()
        if entry.holders:
            return
        n = len(entry.pages)
        self._num_shared -= n
        if entry.ready:
            self._lru[entry.key] = entry  # appended: most recently used
            self._num_cached += n
        else:
            self._remove(entry)
            self.stats.dropped += 1

    def drop_cached(self) -> int:
        """Remove every entry no request holds (their K/V were lost with the pool): how many. Held entries stay."""
        n = len(self._lru)
        while self._lru:
            self._drop_lru()
        return n

    def evictions(self) -> list[str]:
        """Keys of the entries removed (evicted, or dropped unready) since the last call, in order (a key twice if
        stored and removed again), then forgets them: the engine releases what it keeps for those keys."""
        out, self._evicted = self._evicted, []
        return out

    def plan_admission(self, private_pages: int, affix_tokens: Sequence[int] | None = None) -> bool:
        """Whether `admit(private_pages, affix_tokens)` would succeed now. No side effects. The affix's own pages
        are not counted as evictable for the private allocation, since acquiring it makes it unevictable."""
        n = _count(private_pages)
        available = self.num_available_pages
        if affix_tokens is None:
            return n <= available
        toks = _tokens(affix_tokens)
        entry = self._entries.get(affix_key(toks))
        if entry is None:
            return n + pages_for(len(toks), self.page_size) <= available
        _check_same(entry, toks)
        if entry.holders == 0:
            available -= len(entry.pages)
        return n <= available

    def admit(
        self, private_pages: int, affix_tokens: Sequence[int] | None = None, owner: Hashable = None
    ) -> tuple[list[int], AffixEntry | None, bool]:
        """(private pages, affix entry or None, hit): the affix acquired first, so that the private allocation
        cannot evict it. All or nothing: OutOfPages, changing nothing, unless plan_admission holds."""
        if not self.plan_admission(private_pages, affix_tokens):
            raise OutOfPages(
                f"cannot admit {private_pages} private pages"
                + ("" if affix_tokens is None else f" plus an affix of {len(affix_tokens)} tokens")
            )
        entry, hit = (None, False) if affix_tokens is None else self.acquire_affix(affix_tokens)
        return self.allocate(private_pages, owner), entry, hit

    def slots(self, pages: Sequence[int], n_tokens: int, start: int = 0) -> list[int]:
        """Slot numbers of tokens start .. start+n_tokens-1 laid out consecutively in `pages` (token j in slot
        pages[j // page_size] * page_size + j % page_size). ValueError if they run past the pages."""
        n, start, ps = _count(n_tokens), _count(start), self.page_size
        if start + n > len(pages) * ps:
            raise ValueError(f"tokens {start}..{start + n - 1} do not fit in {len(pages)} pages of {ps}")
        return [pages[j // ps] * ps + j % ps for j in range(start, start + n)]

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (every page in exactly one place, counters equal
        to recounts, unheld entries exactly the LRU list, in last_used order, and ready)."""
        n = self.num_pages
        _check(len(self._kind) == n and len(self._tag) == n, "per-page arrays have the wrong length")
        _check(len(set(self._free)) == len(self._free), "a page is on the free list twice")
        for p in self._free:
            _check(0 <= p < n and self._kind[p] == _FREE, f"free-list page {p} is not marked free")
        _check(self._kind.count(_FREE) == len(self._free), "a page marked free is not on the free list")
        _check(self._kind.count(_PRIVATE) == self._num_private, "private page count is off")
        affix_pages = cached = shared = 0
        for key, e in self._entries.items():
            _check(e.key == key and key == affix_key(e.tokens), f"entry {key} is stored under the wrong key")
            _check(len(e.pages) == pages_for(len(e.tokens), self.page_size), f"entry {key} has the wrong page count")
            for p in e.pages:
                _check(self._kind[p] == _AFFIX and self._tag[p] == key, f"page {p} of entry {key} is not marked")
            _check(e.holders >= 0, f"entry {key} has {e.holders} holders")
            _check((e.holders == 0) == (key in self._lru), f"entry {key}: unheld iff in the LRU list")
            _check(e.holders > 0 or e.ready, f"unheld entry {key} is not ready")
            affix_pages += len(e.pages)
            cached += len(e.pages) if e.holders == 0 else 0
            shared += len(e.pages) if e.holders > 0 else 0
        _check(self._kind.count(_AFFIX) == affix_pages, "a page marked affix belongs to no entry (or to two)")
        _check(len(self._free) + self._num_private + affix_pages == n, "pages leaked")
        _check((cached, shared) == (self._num_cached, self._num_shared), "cached/shared page counts are off")
        _check(all(self._entries.get(k) is e for k, e in self._lru.items()), "LRU list holds a removed entry")
        times = [e.last_used for e in self._lru.values()]
        _check(all(a < b for a, b in zip(times, times[1:])), "LRU list is not in last_used order")
        _check(all(e.last_used <= self._clock for e in self._entries.values()), "entry from the future")

    def _to_free(self, pages) -> None:
        for p in pages:
            self._kind[p], self._tag[p] = _FREE, None
            self._free.append(p)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_stored(self, entry: AffixEntry) -> None:
        if self._entries.get(entry.key) is not entry:
            raise ValueError(f"affix entry {entry.key} is not stored here (evicted, dropped or foreign)")

    def _drop_lru(self) -> None:
        _, entry = self._lru.popitem(last=False)  # the least recently used unheld entry
        self._num_cached -= len(entry.pages)
        self._remove(entry)

    def _remove(self, entry: AffixEntry) -> None:
        """Return an unheld entry's pages to the free list and forget it (already out of the LRU list)."""
        del self._entries[entry.key]
        self._to_free(reversed(entry.pages))  # so that pop() hands them out in their old order
        entry.pages = []  # a stale reference must not point at pages now reused
        self._evicted.append(entry.key)


def _count(n: int) -> int:
    n = operator.index(n)
    if n < 0:
        raise ValueError(f"expected a count >= 0, got {n}")
    return n


def _tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    toks = tuple(operator.index(t) for t in tokens)
    if not toks:
        raise ValueError("an affix needs at least one token")
    return toks


def _check_same(entry: AffixEntry, toks: tuple[int, ...]) -> None:
    # A 128-bit hash collision is astronomically unlikely, but stored K/V must never be served for other tokens.
    if entry.tokens != toks:
        raise ValueError(f"affix key collision on {entry.key}: stored tokens differ")


def _check(cond: bool, msg: str) -> None:
    if not cond:  # not `assert`: must hold under python -O too
        raise AssertionError(msg)
