"""L2 tiers: adapters behind L1 (local disk, S3, Azure Blob, Redis/Valkey, memory, faulty)."""

from kvtier.l2.base import L2Adapter, Usage, adapter_types, create_adapter

__all__ = ["L2Adapter", "Usage", "adapter_types", "create_adapter"]
