"""The cluster's routing rule (`dllm_jax.cluster.routing`): requests that share an affix meet on one replica that
every ingress agrees on, a replica leaving moves only its own keys, and a busy owner spills to the least loaded."""

import collections

import numpy as np
import pytest

from dllm_jax.audit import affix_id
from dllm_jax.cluster import RoutingRule, owner, request_route_key, route_key
from dllm_jax.engine.block_manager import affix_key

RNG = np.random.default_rng(0)
DOC = RNG.integers(0, 1000, 96).tolist()


def test_keys_name_the_affix_whatever_surrounds_it():
    a = RNG.integers(0, 1000, 5).tolist() + DOC + [7, 8]
    b = [9] + DOC + RNG.integers(0, 1000, 30).tolist()
    # an explicit span: the content key registering the affix gives (so a handle and a span meet)
    assert route_key(a, (5, 101)) == route_key(b, (1, 97)) == affix_id(affix_key(DOC))
    assert route_key(b, (1, 97), registered="affix-3-abc") == "affix-3-abc"
    # no affix named: the leading tokens (a shared prefix), and nothing for a short prompt
    assert route_key(DOC + [1, 2]) == route_key(DOC + [3]) != route_key([0] + DOC)
    assert route_key(DOC[:63]) is None and route_key(DOC[:63], lead_tokens=16) is not None
    with pytest.raises(ValueError, match="not a non-empty span"):
        route_key(a, (5, 200))


def test_owners_are_stable_spread_and_move_only_when_their_replica_leaves():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"affix-{i}" for i in range(400)]
    owners = {k: owner(k, replicas) for k in keys}
    assert owners == {k: owner(k, list(reversed(replicas))) for k in keys}  # order-free: every ingress agrees
    counts = collections.Counter(owners.values())
    assert set(counts) == set(replicas) and min(counts.values()) > 60  # ~100 each
    left = [r for r in replicas if r != "r2"]
    moved = {k for k in keys if owner(k, left) != owners[k]}
    assert moved == {k for k in keys if owners[k] == "r2"}  # only the leaver's keys move
    with pytest.raises(ValueError, match="no live replica"):
        owner("k", [])


def test_a_busy_owner_spills_to_the_least_loaded_and_unkeyed_requests_balance():
    rule = RoutingRule(spill_queue=3)
    replicas = ["a", "b", "c"]
    key = next(f"k{i}" for i in range(100) if owner(f"k{i}", replicas) == "a")
    assert rule.choose(key, {"a": 2, "b": 0, "c": 0}) == ("a", False)  # below the bound: the owner, busy or not
    assert rule.choose(key, {"a": 3, "b": 1, "c": 0}) == ("c", True)  # at the bound: the least loaded
    assert rule.choose(key, {"a": 3, "b": 3, "c": 3}, turn=1) == ("a", False)  # all as busy: the owner keeps it
    assert [rule.choose(None, {"a": 1, "b": 1, "c": 2}, turn)[0] for turn in range(4)] == ["a", "b", "a", "b"]
    control = RoutingRule(affinity=False)  # round robin among the least loaded, whatever the key
    assert {control.choose(key, dict.fromkeys(replicas, 0), t)[0] for t in range(3)} == set(replicas)
    with pytest.raises(ValueError, match="spill_queue"):
        RoutingRule(spill_queue=0)


def test_a_warming_replica_gets_no_routed_request_while_a_warm_one_is_live():
    """A restarted replica compiles its programs before it can answer: its keys go to the warm replicas meanwhile
    (as if it had not joined), and come back to it once warm; when every replica warms (the cluster's start), all
    are used."""
    rule = RoutingRule(spill_queue=3)
    replicas = ["a", "b", "c"]
    key = next(f"k{i}" for i in range(100) if owner(f"k{i}", replicas) == "c")
    idle = dict.fromkeys(replicas, 0)
    assert rule.choose(key, idle) == ("c", False)
    assert rule.choose(key, idle, warming=["c"]) == (owner(key, ["a", "b"]), False)
    assert {rule.choose(None, {"a": 0, "b": 0, "c": 0}, t, warming=["a"])[0] for t in range(4)} == {"b", "c"}
    assert rule.choose(key, idle, warming=replicas) == ("c", False)
    control = RoutingRule(affinity=False)
    assert {control.choose(key, idle, t, warming=["b", "c"])[0] for t in range(3)} == {"a"}


def test_request_bodies_are_keyed_without_a_tokenizer():
    """The ingress keys a JSON body as the engine would group it: by a registered id, an explicit affix (its text,
    the message it names, or its token span: the same key as registering those tokens), else the prompt's lead;
    a body it cannot read gets no key (the replica answers its 400)."""
    system = "you answer questions about the attached contract. " * 8  # > LEAD_CHARS characters
    chat = lambda q, **kw: {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}], **kw}  # noqa: E731
    assert request_route_key(chat("a?")) == request_route_key(chat("b?")) is not None
    assert request_route_key(chat("a?")) != request_route_key({"messages": [{"role": "user", "content": system}]})
    assert request_route_key({"prompt": system + "x"}) == request_route_key({"prompt": [system + "y"]})
    assert request_route_key({"prompt": "short"}) is None
    # text parts read as the replica reads them (joined by newlines); a batch of prompts by its first
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": t} for t in system.split(". ")]}]}
    assert request_route_key(parts) == request_route_key(
        {"messages": [{"role": "system", "content": system.replace(". ", "\n")}]}
    )
    assert request_route_key({"prompt": [system + "x", "another"]}) == request_route_key({"prompt": system + "y"})
    assert request_route_key({"prompt": [DOC + [1], [2, 3]]}) == route_key(DOC)
    # explicit affixes, wherever they sit in the prompt
    text = {"text": "rule examples : 7 4 0 -> 2 5 9 ;"}
    assert request_route_key({"prompt": "a b", "affix": text}) == request_route_key({"prompt": "c", "affix": text})
    assert request_route_key(chat("a?", affix={"message": 0})) == request_route_key(
        {"messages": [{"role": "user", "content": system}], "affix": {"message": 0}}
    )
    assert request_route_key({"prompt": [1, 2], "affix": {"id": "affix-3-abc"}}) == "affix-3-abc"
    tokens = [5] * 3 + DOC + [6]
    assert request_route_key({"prompt": tokens, "affix": {"start": 3, "end": 99}}) == affix_id(affix_key(DOC))
    assert request_route_key({"prompt": DOC + [1]}) == route_key(DOC)
    for bad in (None, [], "x", {"prompt": tokens, "affix": {"start": 3, "end": 999}}, {"messages": "x"}):
        assert request_route_key(bad) is None


def test_affinity_stores_each_affix_once_where_the_control_stores_it_everywhere():
    """The traffic of the cluster's control run, one request at a time on idle replicas (three affixes, four requests
    each, the ingress's request counter as the turn): affix routing sends each affix to one replica, the control
    (`--no-affinity`, what `serve --replicas --no-affinity` routes by) to both, so both would store its copy."""
    replicas, idle = ["r1", "r2"], {"r1": 0, "r2": 0}
    keys = [f"affix {i}" for i in range(3)]
    for rule, copies in ((RoutingRule(), 1), (RoutingRule(affinity=False), 2)):
        stored = collections.defaultdict(set)
        for turn, key in enumerate(k for k in keys for _ in range(4)):
            stored[key].add(rule.choose(key, idle, turn)[0])
        assert [len(stored[k]) for k in keys] == [copies] * 3 and set().union(*stored.values()) <= set(replicas)
