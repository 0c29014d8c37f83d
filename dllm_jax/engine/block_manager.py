"""Host-side page bookkeeping of the engine's paged KV pool (pure Python: never touches device arrays).

The pool holds `num_pages` pages of `page_size` consecutive slots (page p: slots p*page_size ..). Every page is in
exactly one place: the free list; one running request's private allocation (reserved at admission, so that a
request never runs out midway); or one shared affix entry: one stored copy of an affix's K/V, computed alone at
positions 0..A-1 and keyed by `affix_key`. Held entries are never evicted; unheld ones stay cached and are evicted
least recently used first when pages are needed. Every operation that can fail checks first, so an error
(`OutOfPages`, `ValueError`) leaves everything unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import sys
from array import array
from collections import OrderedDict
from typing import Hashable, Sequence

__all__ = ["AffixEntry", "BlockManager", "OutOfPages", "affix_key", "pages_for", "token_array", "token_bytes"]


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
    a = token_array(tokens)  # a copy, even of an int32 array: byteswap must not change the caller's
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def affix_key(tokens: Sequence[int]) -> str:
    """Content key of an affix: its length and a 128-bit BLAKE2b of its int32 tokens ("<len>:<hex>"). Stable across
    processes and machines (unlike Python's `hash`); callers still compare tokens, never trusting a hash alone."""
    data = token_bytes(tokens)
    return f"{len(data) // 4}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def pages_for(n_tokens: int, page_size: int) -> int:
    """Pages needed to hold `n_tokens` slots: ceil(n_tokens / page_size)."""
    return -(-_count(n_tokens, "n_tokens") // _count(page_size, "page_size", 1))


@dataclasses.dataclass(eq=False)  # identity semantics: an entry is one stored copy, not a value
class AffixEntry:
    """One stored copy of an affix's K/V. Read its fields; change it only through the BlockManager."""

    key: str  # affix_key(tokens)
    tokens: tuple[int, ...]
    pages: list[int]  # token j lives in slot pages[j // page_size] * page_size + j % page_size; [] once removed
    holders: int = 0  # running requests using it; > 0 means it can never be evicted
    ready: bool = False  # its K/V has been computed (mark_ready); only held entries can be not ready


class BlockManager:
    """Pages of one preallocated KV pool. Deterministic: the same calls always give the same pages."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = _count(num_pages, "num_pages", 1), _count(page_size, "page_size", 1)
        # A stack: pop() hands out low page numbers first on a fresh pool; a freed page is reused first.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._owners: dict[int, Hashable] = {}  # private page -> the owner it was admitted for
        self._entries: dict[str, AffixEntry] = {}  # key -> entry, held or cached
        self._lru: OrderedDict[str, AffixEntry] = OrderedDict()  # unheld entries, least recently released first
        self._num_cached = 0  # pages of the unheld entries
        self._evicted: list[str] = []  # keys removed since the last evictions()

    # pages: on the free list; of unheld affix entries (cached for reuse, evictable on demand); that cannot be taken
    # now (private pages and held entries' pages); of entries with at least one holder; an admission may take now
    num_free_pages = property(lambda self: len(self._free))
    num_cached_pages = property(lambda self: self._num_cached)
    num_used_pages = property(lambda self: self.num_pages - len(self._free) - self._num_cached)
    num_shared_pages = property(lambda self: self.num_used_pages - len(self._owners))
    num_available_pages = property(lambda self: len(self._free) + self._num_cached)

    def plan_admission(self, private_pages: int, affix_tokens: Sequence[int] | None = None) -> bool:
        """Whether `admit(private_pages, affix_tokens)` would succeed now. No side effects. The affix's own pages
        are not counted as evictable for the private allocation, since acquiring it makes it unevictable."""
        n, available = _count(private_pages, "private_pages"), self.num_available_pages
        if affix_tokens is not None:
            toks, _, entry = self._lookup(affix_tokens)
            if entry is None:
                n += pages_for(len(toks), self.page_size)
            elif entry.holders == 0:
                available -= len(entry.pages)
        return n <= available

    def admit(
        self, private_pages: int, affix_tokens: Sequence[int] | None = None, owner: Hashable = None
    ) -> tuple[list[int], AffixEntry | None, bool]:
        """(private pages for `owner`, a hold on the affix's entry or None, hit: whether it was stored). A new entry
        is not ready: the caller computes its K/V, then mark_ready. The affix comes first, so that the private
        allocation cannot evict it. All or nothing: OutOfPages, changing nothing, unless plan_admission holds."""
        if not self.plan_admission(private_pages, affix_tokens):
            affix = "" if affix_tokens is None else f" + an affix of {len(affix_tokens)} tokens"
            raise OutOfPages(f"{private_pages} pages{affix}: {len(self._free)} free + {self._num_cached} evictable")
        entry, hit = None, False
        if affix_tokens is not None:
            toks, key, entry = self._lookup(affix_tokens)
            hit = entry is not None
            if entry is None:
                entry = self._entries[key] = AffixEntry(key, toks, self._take(pages_for(len(toks), self.page_size)))
            elif entry.holders == 0:  # leaves the evictable set
                del self._lru[key]
                self._num_cached -= len(entry.pages)
            entry.holders += 1
        pages = self._take(_count(private_pages, "private_pages"))
        self._owners.update(dict.fromkeys(pages, owner))
        return pages, entry, hit

    def free(self, pages: Sequence[int], owner: Hashable = None) -> None:
        """Return private pages to the free list. ValueError, changing nothing, if any page is out of range, free
        (double free), part of an affix entry, allocated to another owner, or listed twice."""
        pages = [operator.index(p) for p in pages]
        if len(set(pages)) < len(pages):
            raise ValueError(f"a page is listed twice in {pages}")
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not in the pool (0..{self.num_pages - 1})")
            if p not in self._owners:  # free, or an entry's (the error path may search the free list)
                where = "already free (double free)" if p in self._free else "part of an affix entry: release it"
                raise ValueError(f"page {p} is {where}")
            if self._owners[p] != owner:
                raise ValueError(f"page {p} is allocated to {self._owners[p]!r}, not {owner!r}")
        for p in pages:
            del self._owners[p]
        self._free.extend(pages)

    def mark_ready(self, entry: AffixEntry) -> None:
        """Record that the entry's K/V has been written (only a holder can: an unheld entry is always ready)."""
        self._check_held(entry)
        entry.ready = True

    def release_affix(self, entry: AffixEntry) -> None:
        """Drop one hold (ValueError, changing nothing, if it has none). The last makes it evictable, most recently
        used; an entry never made ready is dropped at once instead (reported by evictions() like an evicted one)."""
        self._check_held(entry)
        entry.holders -= 1
        if entry.holders == 0 and entry.ready:
            self._lru[entry.key] = entry  # appended: most recently used
            self._num_cached += len(entry.pages)
        elif entry.holders == 0:
            self._remove(entry)

    def drop_cached(self) -> int:
        """Remove every entry no request holds (their K/V were lost with the pool): how many. Held entries stay."""
        n = len(self._lru)
        while self._lru:
            self._evict_lru()
        return n

    def evictions(self) -> list[str]:
        """Keys of the entries removed (evicted, or dropped unready) since the last call, in order (a key twice if
        stored and removed again), then forgets them: the engine releases what it keeps for those keys."""
        out, self._evicted = self._evicted, []
        return out

    def slots(self, pages: Sequence[int], n_tokens: int, start: int = 0) -> list[int]:
        """Slots of tokens start .. start+n_tokens-1 laid out consecutively in `pages` (ValueError past their end)."""
        n, start, ps = _count(n_tokens, "n_tokens"), _count(start, "start"), self.page_size
        if start + n > len(pages) * ps:
            raise ValueError(f"tokens {start}..{start + n - 1} do not fit in {len(pages)} pages of {ps}")
        return [pages[j // ps] * ps + j % ps for j in range(start, start + n)]

    def _lookup(self, tokens: Sequence[int]) -> tuple[tuple[int, ...], str, AffixEntry | None]:
        """The affix's tokens (checked), key and entry (None if not stored)."""
        if not (toks := tuple(operator.index(t) for t in tokens)):
            raise ValueError("an affix needs at least one token")
        entry = self._entries.get(key := affix_key(toks))
        # A 128-bit hash collision is astronomically unlikely, but stored K/V must never be served for other tokens.
        if entry is not None and entry.tokens != toks:
            raise ValueError(f"affix key collision on {key}: stored tokens differ")
        return toks, key, entry

    def _take(self, n: int) -> list[int]:
        """`n` pages off the free list, evicting unheld entries (LRU) while it is short (the caller checked)."""
        while len(self._free) < n:
            self._evict_lru()
        return [self._free.pop() for _ in range(n)]

    def _check_held(self, entry: AffixEntry) -> None:
        if self._entries.get(entry.key) is not entry:
            raise ValueError(f"affix entry {entry.key} is not stored here (evicted, dropped or foreign)")
        if entry.holders < 1:
            raise ValueError(f"affix entry {entry.key} is not held")

    def _evict_lru(self) -> None:
        _, entry = self._lru.popitem(last=False)  # the least recently used unheld entry
        self._num_cached -= len(entry.pages)
        self._remove(entry)

    def _remove(self, entry: AffixEntry) -> None:
        """Return an unheld entry's pages to the free list and forget it (already out of the LRU list)."""
        del self._entries[entry.key]
        self._free.extend(reversed(entry.pages))  # so that pop() hands them out in their old order
        entry.pages = []  # a stale reference must not point at pages now reused
        self._evicted.append(entry.key)


def _count(n: int, name: str, least: int = 0) -> int:
    if (n := operator.index(n)) < least:
        raise ValueError(f"{name} must be >= {least}, got {n}")
    return n
