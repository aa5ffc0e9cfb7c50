"""One configuration tree for kvtier: the pydantic models (``tree``), where values come from (``load``: a YAML
file, ``KVTIER_*`` variables, overrides) and LMCache-style files (``lmcache``). Sizes and booleans are read
by ``kvtier.units``."""

from kvtier.config.load import NON_CONFIG_ENV, build_config, load_config
from kvtier.config.tree import (
    EVENT_ENCODINGS,
    EVICTION_POLICIES,
    Bool,
    ConnectorConfig,
    KVEventsConfig,
    KVTierConfig,
    ServerConfig,
    SizeBytes,
    SizeGB,
    StrictModel,
)

__all__ = [
    "EVENT_ENCODINGS", "EVICTION_POLICIES", "NON_CONFIG_ENV", "Bool", "ConnectorConfig", "KVEventsConfig", "KVTierConfig",
    "ServerConfig", "SizeBytes", "SizeGB", "StrictModel", "build_config", "load_config",
]
