"""kvtier: a tiered KV cache layer for LLM inference (prefill once, reuse everywhere)."""

__version__ = "0.1.0"

from kvtier.errors import KVTierError  # noqa: E402

__all__ = ["KVTierError", "__version__"]
