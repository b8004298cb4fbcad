"""OpenAI-compatible HTTP front: a Starlette sub-app to mount in any host app (see docs/server.md)."""

from .app import create_app, default_model_name

__all__ = ["create_app", "default_model_name"]
