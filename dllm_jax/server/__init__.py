"""The OpenAI-compatible HTTP server on the engine (`dllm-jax serve`)."""

from dllm_jax.server.app import ServeSettings, create_app
from dllm_jax.server.service import EngineService

__all__ = ["EngineService", "ServeSettings", "create_app"]
