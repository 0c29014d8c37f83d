"""Test oracles of the engine's host bookkeeping: consistency checks that read a BlockManager's or an AffixIndex's
state (their private fields) and raise AssertionError on any inconsistency. Not `assert`: must hold under -O too."""

from collections import Counter

from dllm_jax.engine.affix_index import AffixIndex
from dllm_jax.engine.block_manager import BlockManager, affix_key, pages_for


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def check_block_manager(bm: BlockManager) -> None:
    """Every page in exactly one place (the free list, one owner's allocation, one entry), entries stored under
    their key with the right page count, unheld entries exactly the LRU list and ready, the cached count right."""
    entry_pages = [p for e in bm._entries.values() for p in e.pages]
    places = Counter([*bm._free, *bm._owners, *entry_pages])
    check(len(set(bm._free)) == len(bm._free), "a page is on the free list twice")
    check(places == Counter(range(bm.num_pages)), "a page is in no place (leaked) or in two")
    for key, e in bm._entries.items():
        check(e.key == key == affix_key(e.tokens), f"entry {key} is stored under the wrong key")
        check(len(e.pages) == pages_for(len(e.tokens), bm.page_size), f"entry {key} has the wrong page count")
        check(e.holders >= 0, f"entry {key} has {e.holders} holders")
        check((e.holders == 0) == (key in bm._lru), f"entry {key}: unheld iff in the LRU list")
        check(e.holders > 0 or e.ready, f"unheld entry {key} is not ready")
    check(all(bm._entries.get(k) is e for k, e in bm._lru.items()), "LRU list holds a removed entry")
    check(bm._num_cached == sum(len(e.pages) for e in bm._lru.values()), "cached page count is off")
    check(bm.num_used_pages + bm.num_available_pages == bm.num_pages, "page counts do not add up")


def check_affix_index(ix: AffixIndex) -> None:
    """Within the memory bounds; the token count right; prompts and affixes stored under their key; every k-gram
    occurrence (at most max_hits a hash) names a stored record at an indexed position of that hash; every
    registered affix anchored once, under its first k-gram's hash (None if shorter than k)."""
    check(len(ix._prompts) <= ix.max_prompts and ix._num_tokens <= ix.max_tokens, "over the bounds")
    check(ix._num_tokens == sum(len(r.tokens) for r in ix._prompts.values()), "token count is off")
    stored = {**{id(r): r for r in ix._prompts.values()}, **{id(r): r for r in ix._registered.values()}}
    check(len(stored) == len(ix._prompts) + len(ix._registered), "a record is stored twice")
    for key, r in [*ix._prompts.items(), *ix._registered.items()]:
        check(affix_key(r.tokens) == key, f"record {key} is stored under the wrong key")
    for h, occ in ix._kgrams.items():
        check(0 < len(occ) <= ix.max_hits, f"k-gram list of length {len(occ)}")
        for rec, pos in occ:
            at = pos // ix.stride
            live = stored.get(id(rec)) is rec and pos % ix.stride == 0 and at < len(rec.kgrams)
            check(live and rec.kgrams[at] == h, "stale k-gram entry")
    anchored = Counter(key for keys in ix._anchors.values() for key in keys)
    check(anchored == Counter(list(ix._registered)), "anchors are off")
    for anchor, keys in ix._anchors.items():
        for key in keys:
            kgrams = ix._registered[key].kgrams
            check(anchor == (kgrams[0] if kgrams else None), f"affix {key} is under the wrong anchor")
