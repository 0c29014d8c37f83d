"""Automatic discovery of affixes that requests share without saying so (host-only, bounded memory).

For a new prompt, `AffixIndex` reports the span worth storing once: the longest registered affix it contains; else
the longest whole-page prefix shared with a recent prompt (chained page hashes, as vLLM's prefix caching; preferred
by default, `prefer_prefix`: no RoPE shift); else the longest span shared at any offsets (k-grams of stored prompts
indexed every min_tokens - k + 1 positions, so any shared span of min_tokens holds one; hits extended both ways).
Spans are verified token by token (hashes only propose), answers are the same in every process (fixed hashes, ordered
dicts; ties to the earliest start), work is O(prompt length) (`max_hits`, `work_factor`) and memory is bounded
(`max_prompts`, `max_tokens`; registered affixes stay until unregistered). The engine calls `observe` per request.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple, Sequence

from .block_manager import _check, affix_key, token_array, token_bytes

__all__ = ["AffixIndex", "AffixMatch", "find_aligned"]

_MOD = (1 << 61) - 1  # a Mersenne prime: a 61-bit polynomial hash, collisions ~ 2^-61 per pair
_BASE = 0x5DEECE66D  # fixed, so that hashes (and tie-breaks) are the same in every process


def _kgram_hashes(tokens: array, k: int) -> list[int]:
    """Hash of every k-token window, h[i] of tokens[i:i+k], rolling in O(len(tokens))."""
    n = len(tokens)
    if n < k:
        return []
    drop = pow(_BASE, k, _MOD)  # weight of the token that leaves the window
    h = 0
    for t in tokens[:k]:
        h = (h * _BASE + t) % _MOD
    out = [h]
    append = out.append
    for t_in, t_out in zip(tokens[k:], tokens):
        h = (h * _BASE + t_in - t_out * drop) % _MOD
        append(h)
    return out


def _chain_hash(prev: bytes, chunk: bytes) -> bytes:
    """Chained page hash: identifies a page-aligned prefix by all the pages up to this one."""
    return hashlib.blake2b(prev + chunk, digest_size=16).digest()


def _run(same, limit: int) -> int:
    """The longest n <= limit with same(0, n) (slices compare in C): the step grows, and halves at a mismatch."""
    n, step = 0, 8
    while n < limit:
        s = min(step, limit - n)
        if same(n, s):
            n, step = n + s, s * 2
        elif s == 1:
            break
        else:
            step = s // 2  # the mismatch is in this chunk: narrow down
    return n


def _lcp(a: array, i: int, b: array, j: int, limit: int) -> int:
    """Length of the common run a[i:] / b[j:], at most `limit`."""
    return _run(lambda n, s: a[i + n : i + n + s] == b[j + n : j + n + s], limit)


def _lcs(a: array, i: int, b: array, j: int, limit: int) -> int:
    """Length of the common run ending before a[i] / b[j], at most `limit` (<= min(i, j))."""
    return _run(lambda n, s: a[i - n - s : i - n] == b[j - n - s : j - n], limit)


def find_aligned(hay: bytes, needle: bytes, start: int = 0) -> int | None:
    """First token position >= start/4 where the int32 `needle` occurs in `hay` (C search; token-aligned only)."""
    pos = hay.find(needle, start)
    while pos != -1 and pos % 4:
        pos = hay.find(needle, pos + 4 - pos % 4)
    return None if pos == -1 else pos // 4


class AffixMatch(NamedTuple):
    """A span [start, end) of the prompt and why it was chosen: "registered", "prefix" or "span"."""

    start: int
    end: int
    kind: str


class _Query:
    """A prompt's tokens and hashes, computed once per find/add."""

    __slots__ = ("tokens", "data", "kgrams", "chain")

    def __init__(self, prompt: Sequence[int], k: int, page_size: int):
        self.tokens = token_array(prompt)
        self.data = token_bytes(self.tokens)
        self.kgrams = _kgram_hashes(self.tokens, k)
        chain, prev, step = [], b"", 4 * page_size
        for c in range(len(self.tokens) // page_size):  # full pages only
            prev = _chain_hash(prev, self.data[c * step : (c + 1) * step])
            chain.append(prev)
        self.chain = chain


class _Stored:
    """A remembered prompt or registered affix and the index keys it added (to remove them when forgotten)."""

    __slots__ = ("id", "key", "tokens", "data", "kgrams", "chain", "pinned")

    def __init__(self, id: int, key: str, q: _Query, pinned: bool):
        self.id, self.key, self.tokens, self.pinned = id, key, q.tokens, pinned
        self.data = q.data if pinned else None  # registered affixes are searched for as bytes
        self.kgrams: list[int] = []
        self.chain = q.chain


@dataclasses.dataclass(eq=False)
class AffixIndex:
    """Finds the span of a prompt worth sharing, from recent prompts and registered affixes (see the module doc)."""

    page_size: int  # the KV pool's: prefixes are whole pages
    min_tokens: int = 64  # the shortest prefix or span worth reporting (>= k)
    max_prompts: int = 256  # the memory bound on remembered prompts ...
    max_tokens: int = 1 << 20  # ... and on their tokens
    k: int = 16  # the k-gram length of the span finder
    max_hits: int = 4  # remembered occurrences per k-gram (the most recent prompts')
    work_factor: int = 8  # the extension budget per prompt token
    prefer_prefix: bool = True  # a shared prefix wins over any span, else only over spans no longer than it

    def __post_init__(self) -> None:
        k = self.k
        small = min(self.page_size, k, self.max_hits, self.work_factor) < 1 or self.min_tokens < k
        if small or min(self.max_prompts, self.max_tokens) < 0:
            raise ValueError(
                "need page_size >= 1, k >= 1, min_tokens >= k, max_prompts >= 0, max_tokens >= 0, "
                "max_hits >= 1, work_factor >= 1"
            )
        self.stride = self.min_tokens - k + 1  # any shared run of min_tokens tokens covers an indexed k-gram
        self._stored: dict[int, _Stored] = {}  # id -> prompt or registered affix
        self._prompts: OrderedDict[int, _Stored] = OrderedDict()  # remembered prompts, least recently added first
        self._prompt_ids: dict[str, int] = {}  # affix_key(prompt) -> id: an identical prompt is stored once
        self._registered: dict[str, _Stored] = {}  # key -> registered affix, in registration order
        self._kgrams: dict[int, list[tuple[int, int]]] = {}  # k-gram hash -> [(id, position)], oldest first
        self._chains: dict[bytes, dict[int, None]] = {}  # chain hash -> ids holding that prefix (ordered set)
        self._anchors: dict[int, list[str]] = {}  # first k-gram hash -> registered keys (affixes of >= k tokens)
        self._short: list[str] = []  # registered affixes shorter than k: searched for directly
        self._next_id = 0
        self._num_tokens = 0

    def find(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """[start, end) of the best affix of this prompt (see the module doc), or None."""
        m = self.match(prompt)
        return None if m is None else (m.start, m.end)

    def match(self, prompt: Sequence[int]) -> AffixMatch | None:
        """Like find, also saying which rule chose the span."""
        return self._match(self._query(prompt))

    def observe(self, prompt: Sequence[int]) -> AffixMatch | None:
        """match(prompt), then add(prompt), hashing the prompt once: the call the engine makes per request."""
        q = self._query(prompt)
        m = self._match(q)
        self._add(q)
        return m

    def find_registered(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """Leftmost span of the longest registered affix the prompt contains (ties: registered first), or None."""
        return self._find_registered(self._query(prompt))

    def find_prefix(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """(0, end) of the longest whole-page prefix of >= min_tokens shared with a stored prompt or affix, or None."""
        return self._find_prefix(self._query(prompt))

    def find_span(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """The longest span of >= min_tokens shared with a stored prompt or affix (ties: earliest start), or None."""
        return self._find_span(self._query(prompt))

    def add(self, prompt: Sequence[int]) -> None:
        """Remember the prompt (forgetting the least recently added ones beyond max_prompts / max_tokens). A prompt
        longer than max_tokens is not remembered; an identical prompt becomes the most recent instead of a copy."""
        self._add(self._query(prompt))

    def register(self, tokens: Sequence[int]) -> str:
        """Pin an affix: prompts containing it report it first, and the other finders match against it too. Returns
        its key (affix_key); registering twice is a no-op."""
        q = self._query(tokens)
        if not len(q.tokens):
            raise ValueError("an affix needs at least one token")
        key = affix_key(q.tokens)
        old = self._registered.get(key)
        if old is not None:
            if old.tokens != q.tokens:
                raise ValueError(f"affix key collision on {key}")
            return key
        rec = self._store(q, key, pinned=True)
        self._registered[key] = rec
        if len(q.tokens) >= self.k:
            self._anchors.setdefault(q.kgrams[0], []).append(key)
        else:
            self._short.append(key)
        return key

    def unregister(self, key: str) -> bool:
        """Unpin a registered affix (e.g. its entry was evicted); False if it was not registered."""
        rec = self._registered.pop(key, None)
        if rec is None:
            return False
        if len(rec.tokens) >= self.k:
            h = rec.kgrams[0]  # position 0 is always indexed, and it is the anchor
            keys = self._anchors[h]
            keys.remove(key)
            if not keys:
                del self._anchors[h]
        else:
            self._short.remove(key)
        self._unindex(rec)
        return True

    @property
    def num_prompts(self) -> int:  # remembered prompts (registered affixes not counted)
        return len(self._prompts)

    @property
    def num_tokens(self) -> int:  # tokens of the remembered prompts
        return self._num_tokens

    def registered_keys(self) -> list[str]:
        """Keys of the registered affixes, in registration order."""
        return list(self._registered)

    def check_invariants(self) -> None:
        """Raise AssertionError if the index is inconsistent or over its bounds (for tests)."""
        _check(len(self._prompts) <= self.max_prompts and self._num_tokens <= self.max_tokens, "over the bounds")
        _check(self._num_tokens == sum(len(r.tokens) for r in self._prompts.values()), "token count is off")
        records = set(self._prompts) | {r.id for r in self._registered.values()}
        _check(set(self._stored) == records, "stored records are not exactly the prompts and registered affixes")
        _check(self._prompt_ids == {r.key: i for i, r in self._prompts.items()}, "prompt keys are off")
        for h, occ in self._kgrams.items():
            _check(0 < len(occ) <= self.max_hits, f"k-gram list of length {len(occ)}")
            for sid, pos in occ:
                rec = self._stored.get(sid)
                _check(rec is not None and h in rec.kgrams and pos % self.stride == 0, "stale k-gram entry")
        for h, ids in self._chains.items():
            live = all(sid in self._stored and h in self._stored[sid].chain for sid in ids)
            _check(bool(ids) and live, "stale chain entry")
        for rec in self._stored.values():
            _check(all(rec.id in self._chains.get(h, ()) for h in rec.chain), "missing chain entry")
        n_anchored = sum(len(v) for v in self._anchors.values())
        _check(n_anchored + len(self._short) == len(self._registered), "anchors are off")

    def _query(self, prompt: Sequence[int]) -> _Query:
        return _Query(prompt, self.k, self.page_size)

    def _match(self, q: _Query) -> AffixMatch | None:
        span = self._find_registered(q)
        if span is not None:
            return AffixMatch(span[0], span[1], "registered")
        prefix = self._find_prefix(q)
        if prefix is not None and self.prefer_prefix:
            return AffixMatch(0, prefix[1], "prefix")
        span = self._find_span(q)
        if prefix is not None and (span is None or span[1] - span[0] <= prefix[1]):
            return AffixMatch(0, prefix[1], "prefix")
        return None if span is None else AffixMatch(span[0], span[1], "span")

    def _find_registered(self, q: _Query) -> tuple[int, int] | None:
        if not self._registered:
            return None
        starts: dict[str, int | None] = {}  # key -> leftmost occurrence (None: absent), once resolved
        for i, h in enumerate(q.kgrams):
            for key in self._anchors.get(h, ()):
                if key not in starts:
                    # An occurrence at p has its anchor hit at p, so the first hit is the earliest possible start;
                    # one C search from there decides this affix (linear, however repetitive the prompt).
                    starts[key] = find_aligned(q.data, self._registered[key].data, 4 * i)
        for key in self._short:
            starts[key] = find_aligned(q.data, self._registered[key].data, 0)
        found = [  # (length, -start, -registration order)
            (len(rec.tokens), -starts[key], -order)
            for order, (key, rec) in enumerate(self._registered.items())
            if starts.get(key) is not None
        ]
        if not found:
            return None
        n, s, _ = max(found)
        return -s, n - s

    def _find_prefix(self, q: _Query) -> tuple[int, int] | None:
        ps = self.page_size
        deepest, ids = 0, None
        for depth, h in enumerate(q.chain, 1):  # chains are prefix-closed: stop at the first unseen depth
            found = self._chains.get(h)
            if found is None:
                break
            deepest, ids = depth, found
        if deepest * ps < self.min_tokens:
            return None
        other = self._stored[next(reversed(ids))]  # the most recent holder of the deepest chain hash
        # Verify: the hash only proposed it. Under a collision the verified part is shorter, never wrong.
        n = _lcp(q.tokens, 0, other.tokens, 0, min(deepest * ps, len(other.tokens)))
        n -= n % ps
        return (0, n) if n >= self.min_tokens else None

    def _find_span(self, q: _Query) -> tuple[int, int] | None:
        toks, n, k = q.tokens, len(q.tokens), self.k
        if n < self.min_tokens or not self._kgrams:
            return None
        budget = self.work_factor * n
        work = 0
        reached: dict[tuple[int, int], int] = {}  # (id, diagonal) -> end of the last extension on it
        best = None  # (length, -start)
        for i, h in enumerate(q.kgrams):
            occ = self._kgrams.get(h)
            if occ is None:
                continue
            for sid, j in reversed(occ):  # most recent first
                diag = (sid, i - j)
                if i < reached.get(diag, 0):
                    continue  # inside a run already extended: same span
                other = self._stored[sid].tokens
                right = _lcp(toks, i, other, j, min(n - i, len(other) - j))
                work += k + right
                if right < k:
                    continue  # hash collision: the k-gram itself differs
                left = _lcs(toks, i, other, j, min(i, j))
                work += left
                start, end = i - left, i + right
                reached[diag] = end
                if end - start >= self.min_tokens and (best is None or (end - start, -start) > best):
                    best = (end - start, -start)
                if work > budget:  # only pathological repetition gets here; the answer so far is verified
                    return None if best is None else (-best[1], -best[1] + best[0])
        return None if best is None else (-best[1], -best[1] + best[0])

    def _add(self, q: _Query) -> None:
        n = len(q.tokens)
        if n > self.max_tokens or self.max_prompts == 0 or n == 0:
            return
        key = affix_key(q.tokens)
        sid = self._prompt_ids.get(key)
        if sid is not None:
            if self._stored[sid].tokens == q.tokens:
                self._prompts.move_to_end(sid)
                return
            self._forget(sid)  # a key collision: keep the newer prompt
        rec = self._store(q, key, pinned=False)
        self._prompts[rec.id] = rec
        self._prompt_ids[key] = rec.id
        self._num_tokens += n
        while len(self._prompts) > self.max_prompts or self._num_tokens > self.max_tokens:
            self._forget(next(iter(self._prompts)))

    def _store(self, q: _Query, key: str, pinned: bool) -> _Stored:
        rec = _Stored(self._next_id, key, q, pinned)
        self._next_id += 1
        self._stored[rec.id] = rec
        for pos in range(0, len(q.kgrams), self.stride):
            h = q.kgrams[pos]
            occ = self._kgrams.setdefault(h, [])
            if occ and occ[-1][0] == rec.id:
                continue  # a k-gram repeated within this prompt: its first occurrence is enough
            occ.append((rec.id, pos))
            rec.kgrams.append(h)
            if len(occ) > self.max_hits:
                del occ[0]  # the oldest prompt's occurrence goes first
        for h in rec.chain:
            self._chains.setdefault(h, {})[rec.id] = None
        return rec

    def _forget(self, sid: int) -> None:
        rec = self._prompts.pop(sid)
        del self._prompt_ids[rec.key]
        self._num_tokens -= len(rec.tokens)
        self._unindex(rec)

    def _unindex(self, rec: _Stored) -> None:
        del self._stored[rec.id]
        for h in rec.kgrams:
            occ = self._kgrams.get(h)
            if occ is not None:
                occ[:] = [e for e in occ if e[0] != rec.id]
                if not occ:
                    del self._kgrams[h]
        for h in rec.chain:
            ids = self._chains.get(h)
            if ids is not None:
                ids.pop(rec.id, None)
                if not ids:
                    del self._chains[h]
