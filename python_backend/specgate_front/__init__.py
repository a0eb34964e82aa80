"""An OpenAI-compatible HTTP front for the `llm` model: a thin client of Triton over gRPC (docs/front.md)."""

from specgate_front.app import create_app

__all__ = ["create_app"]
