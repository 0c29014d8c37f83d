"""Several engine replicas behind one ingress (issue 43): the affix-aware routing rule (`routing`)."""

from dllm_jax.cluster.routing import LEAD_TOKENS, RoutingRule, owner, route_key

__all__ = ["LEAD_TOKENS", "RoutingRule", "owner", "route_key"]
