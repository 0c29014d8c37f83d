"""Automatic discovery of affixes that requests share without saying so (host-only, bounded memory).

For a new prompt, `AffixIndex` reports the span worth storing once: the longest registered affix it contains
("registered"); else the best span of >= min_tokens shared with a recent prompt or a registered affix, at any
offsets in both (k-grams of stored prompts indexed every min_tokens - k + 1 positions, so any shared run of
min_tokens holds one; hits extended both ways): the longest, ties to the earliest start, except that by default
(`prefer_prefix`) a span starting at the prompt's position 0 ("prefix": no RoPE shift) wins over any other ("span").
A prefix may sit anywhere in the other prompt and end anywhere (not only at whole pages): its copy is computed alone.
Spans are verified token by token (hashes only propose), answers are the same in every process (fixed hashes,
ordered dicts and lists), work is O(prompt length) (`max_hits`, `work_factor`) and memory is bounded (`max_prompts`,
`max_tokens`; registered affixes stay until unregistered). The engine calls `observe` per request."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from itertools import chain, repeat
from typing import NamedTuple, Sequence

from .block_manager import affix_key, token_array, token_bytes

__all__ = ["AffixIndex", "AffixMatch", "find_aligned"]

_MOD = (1 << 61) - 1  # a Mersenne prime: a 61-bit polynomial hash, collisions ~ 2^-61 per pair
_BASE = 0x5DEECE66D  # fixed, so that hashes (and tie-breaks) are the same in every process


def _kgram_hashes(tokens: Sequence[int], k: int) -> list[int]:
    """Hash of every k-token window, h[i] of tokens[i:i+k], rolling in O(len(tokens))."""
    drop, h, out = pow(_BASE, k, _MOD), 0, []  # drop: the weight of the token that leaves the window
    for t_in, t_out in zip(tokens, chain(repeat(0, k), tokens)):
        h = (h * _BASE + t_in - t_out * drop) % _MOD
        out.append(h)
    del out[: k - 1]  # the windows of fewer than k tokens
    return out


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


def _lcp(a: Sequence[int], i: int, b: Sequence[int], j: int, limit: int) -> int:
    """Length of the common run a[i:] / b[j:], at most `limit`."""
    return _run(lambda n, s: a[i + n : i + n + s] == b[j + n : j + n + s], limit)


def _lcs(a: Sequence[int], i: int, b: Sequence[int], j: int, limit: int) -> int:
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


class _Prompt:
    """A prompt's or affix's tokens (an int32 array: slices compare in C), their bytes and k-gram hashes: all of
    them while it is a query; once stored, only the indexed ones (positions 0, stride, ..., to unindex them)."""

    __slots__ = ("tokens", "data", "kgrams")

    def __init__(self, tokens: Sequence[int], k: int):
        self.tokens = token_array(tokens)
        self.data = token_bytes(self.tokens)
        self.kgrams = _kgram_hashes(self.tokens, k)


@dataclasses.dataclass(eq=False)
class AffixIndex:
    """Finds the span of a prompt worth sharing, from recent prompts and registered affixes (see the module doc)."""

    min_tokens: int = 64  # the shortest span worth reporting (>= k)
    max_prompts: int = 256  # the memory bound on remembered prompts ...
    max_tokens: int = 1 << 20  # ... and on their tokens
    k: int = 16  # the k-gram length
    max_hits: int = 4  # remembered occurrences per k-gram (the most recent prompts')
    work_factor: int = 8  # the extension budget per prompt token
    prefer_prefix: bool = True  # a span at position 0 wins over any other, else only over spans no longer than it

    def __post_init__(self) -> None:
        if min(self.k, self.max_hits, self.work_factor) < 1 or self.min_tokens < self.k:
            raise ValueError("need k >= 1, min_tokens >= k, max_hits >= 1 and work_factor >= 1")
        if min(self.max_prompts, self.max_tokens) < 0:
            raise ValueError("need max_prompts >= 0 and max_tokens >= 0")
        self.stride = self.min_tokens - self.k + 1  # any shared run of min_tokens tokens covers an indexed k-gram
        self._prompts: OrderedDict[str, _Prompt] = OrderedDict()  # affix_key -> remembered prompt, oldest first
        self._num_tokens = 0  # of the remembered prompts
        self._registered: dict[str, _Prompt] = {}  # key -> registered affix, in registration order
        self._kgrams: dict[int, list[tuple[_Prompt, int]]] = {}  # k-gram hash -> [(stored, position)], oldest first
        # registered keys by their first k-gram's hash (None: shorter than k, searched for from the start)
        self._anchors: dict[int | None, list[str]] = {}

    def match(self, prompt: Sequence[int]) -> AffixMatch | None:
        """The span of the prompt worth sharing and the rule that chose it (see the module doc), or None."""
        q = _Prompt(prompt, self.k)
        return self._find_registered(q) or self._find_span(q)

    def observe(self, prompt: Sequence[int]) -> AffixMatch | None:
        """match(prompt), then remember the prompt (forgetting the least recently added beyond max_prompts and
        max_tokens). A prompt longer than max_tokens is not remembered; an identical one becomes the most recent."""
        q = _Prompt(prompt, self.k)
        m = self._find_registered(q) or self._find_span(q)
        if 0 < len(q.tokens) <= self.max_tokens and self.max_prompts > 0:
            self._remember(q)
        return m

    def register(self, tokens: Sequence[int]) -> str:
        """Pin an affix: prompts containing it report it first, and spans are matched against it too. Returns its key
        (affix_key); registering it again is a no-op."""
        q = _Prompt(tokens, self.k)
        if not q.tokens:
            raise ValueError("an affix needs at least one token")
        key = affix_key(q.tokens)
        if (old := self._registered.get(key)) is not None and old.tokens != q.tokens:
            raise ValueError(f"affix key collision on {key}")
        if old is None:
            self._registered[key] = self._index(q)
            self._anchors.setdefault(q.kgrams[0] if q.kgrams else None, []).append(key)
        return key

    def unregister(self, key: str) -> bool:
        """Unpin a registered affix (e.g. its entry was evicted); False if it was not registered."""
        if (rec := self._registered.pop(key, None)) is None:
            return False
        anchor = rec.kgrams[0] if rec.kgrams else None
        self._anchors[anchor].remove(key)
        if not self._anchors[anchor]:
            del self._anchors[anchor]
        self._unindex(rec)
        return True

    def _find_registered(self, q: _Prompt) -> AffixMatch | None:
        """The leftmost occurrence of the longest registered affix the prompt contains, or None."""
        if not self._registered:
            return None
        starts = {key: find_aligned(q.data, self._registered[key].data) for key in self._anchors.get(None, ())}
        for i, h in enumerate(q.kgrams):
            for key in self._anchors.get(h, ()):
                if key not in starts:
                    # An occurrence at p has its anchor hit at p, so the first hit is the earliest possible start;
                    # one C search from there decides this affix (linear, however repetitive the prompt).
                    starts[key] = find_aligned(q.data, self._registered[key].data, 4 * i)
        # (length, -start): never a tie, since two affixes of one length at one start are the same tokens
        found = [(len(self._registered[key].tokens), -s) for key, s in starts.items() if s is not None]
        n, s = max(found, default=(0, 0))
        return AffixMatch(-s, n - s, "registered") if n else None

    def _find_span(self, q: _Prompt) -> AffixMatch | None:
        """The best span shared with a stored prompt or affix (see the module doc): k-gram hits, verified, extended."""
        toks, n, k, budget = q.tokens, len(q.tokens), self.k, self.work_factor * len(q.tokens)  # extension work left
        reached: dict[tuple[_Prompt, int], int] = {}  # (stored, diagonal) -> end of the last extension on it
        best = None  # ((preferred prefix, length, -start), the match)
        for i, h in enumerate(q.kgrams):
            for rec, j in reversed(self._kgrams.get(h, ())):  # most recent first
                if i < reached.get((rec, i - j), 0):
                    continue  # inside a run already extended: same span
                right = _lcp(toks, i, rec.tokens, j, min(n - i, len(rec.tokens) - j))
                budget -= k + right
                if right < k:
                    continue  # hash collision: the k-gram itself differs
                left = _lcs(toks, i, rec.tokens, j, min(i, j))
                start, end, budget = i - left, i + right, budget - left
                reached[rec, i - j] = end
                rank = (self.prefer_prefix and start == 0, end - start, -start)
                if end - start >= self.min_tokens and (best is None or rank > best[0]):
                    best = rank, AffixMatch(start, end, "span" if start else "prefix")
                if budget < 0:  # only pathological repetition gets here; the answer so far is verified
                    return None if best is None else best[1]
        return None if best is None else best[1]

    def _index(self, rec: _Prompt) -> _Prompt:
        """Index every stride-th k-gram of a prompt or affix being stored (keeping only those in rec.kgrams)."""
        rec.kgrams = rec.kgrams[:: self.stride]
        for n, h in enumerate(rec.kgrams):
            occ = self._kgrams.setdefault(h, [])
            if occ and occ[-1][0] is rec:
                continue  # a k-gram repeated within this prompt: its first occurrence is enough
            occ.append((rec, n * self.stride))
            if len(occ) > self.max_hits:
                del occ[0]  # the oldest prompt's occurrence goes first
        return rec

    def _remember(self, q: _Prompt) -> None:
        key = affix_key(q.tokens)
        if (old := self._prompts.get(key)) is not None and old.tokens == q.tokens:
            self._prompts.move_to_end(key)
            return
        if old is not None:
            self._forget(key)  # a key collision: keep the newer prompt
        self._prompts[key] = self._index(q)
        self._num_tokens += len(q.tokens)
        while len(self._prompts) > self.max_prompts or self._num_tokens > self.max_tokens:
            self._forget(next(iter(self._prompts)))

    def _forget(self, key: str) -> None:
        rec = self._prompts.pop(key)
        self._num_tokens -= len(rec.tokens)
        self._unindex(rec)

    def _unindex(self, rec: _Prompt) -> None:
        for h in rec.kgrams:
            if (occ := self._kgrams.get(h)) is not None:
                occ[:] = [e for e in occ if e[0] is not rec]
                if not occ:
                    del self._kgrams[h]
