"""The OpenAI-compatible HTTP server on the engine (`dllm-jax serve`)."""

from typing import Any

from dllm_jax.server.settings import ServeSettings

__all__ = ["EngineService", "ServeSettings", "create_app"]


def __getattr__(name: str) -> Any:  # the web framework loads on first use: the CLI's parser needs only the settings
    if name == "create_app":
        from dllm_jax.server.app import create_app

        return create_app
    if name == "EngineService":
        from dllm_jax.server.service import EngineService

        return EngineService
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
