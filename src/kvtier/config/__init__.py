"""One configuration tree for kvtier: the pydantic models (``tree``), where values come from (``load``: a YAML
file, ``KVTIER_*`` variables, overrides) and LMCache-style files (``lmcache``). Sizes and booleans are read
by ``kvtier.units``, which also has the value types and the section base the L2 adapters' configs share."""

from kvtier.config.load import NON_CONFIG_ENV, build_config, load_config
from kvtier.config.tree import EVICTION_POLICIES, ConnectorConfig, KVEventsConfig, KVTierConfig, ServerConfig

__all__ = ["EVICTION_POLICIES", "NON_CONFIG_ENV", "ConnectorConfig", "KVEventsConfig", "KVTierConfig", "ServerConfig",
           "build_config", "load_config"]
