"""Several engine replicas behind one ingress (issue 43): the affix-aware routing rule (`routing`, host logic),
one replica's in-process server (`replica`) and the Ray Serve application (`app`, `run`: `dllm-jax serve
--replicas N`). Ray is imported only by `app` and `run`."""

from dllm_jax.cluster.routing import LEAD_CHARS, LEAD_TOKENS, RoutingRule, owner, request_route_key, route_key

__all__ = ["LEAD_CHARS", "LEAD_TOKENS", "RoutingRule", "owner", "request_route_key", "route_key"]
