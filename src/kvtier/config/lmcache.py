"""LMCache-style configuration files, read by ``kvtier.config.load.load_config``.

LMCache's keys (``local_cpu``, ``max_local_cpu_size``, ``local_disk``, ...; sizes in GB) are translated into
kvtier's; its remote backend keys are refused with the L2 adapter to configure instead (docs/configuration.md,
"LMCache-style files").
"""

from __future__ import annotations

import urllib.parse

from kvtier.errors import ConfigError
from kvtier.units import parse_bool, parse_size

# LMCache YAML key -> how to translate it (LMCache sizes are GB).
_LMCACHE_KEYS = {"local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
                 "pre_caching_hash_algorithm"}


def _lmcache_remote(data: dict) -> None:
    """Refuse LMCache's remote backend keys, naming the kvtier L2 adapter that replaces them."""
    url = data.get("remote_url")
    if url is not None:
        parts = urllib.parse.urlsplit(str(url))
        if parts.scheme in ("redis", "rediss", "valkey", "valkeys"):
            host_port = parts.netloc.rpartition("@")[2]  # without user:password@: the message may end up in logs
            spec = f"l2_adapters: [{{type: redis, url: '{parts.scheme}://{host_port or '127.0.0.1'}{parts.path}'}}]"
            hint = f"configure a redis L2 adapter instead: {spec} (a password goes in the URL or 'password')"
        else:
            hint = ("kvtier has no L2 adapter for that scheme; configure one of its L2 adapters instead, e.g. "
                    "l2_adapters: [{type: redis, url: 'redis://host:6379'}] (docs/configuration.md, L2 adapters)")
        raise ConfigError(f"LMCache key 'remote_url' is not read by kvtier: {hint}")
    if "remote_serde" in data:
        raise ConfigError("LMCache key 'remote_serde' is not read by kvtier: its L2 adapters store kvtier's own "
                          "record format; remove the key (and configure the remote store as an l2_adapters entry)")


def from_lmcache(data: dict) -> dict:
    """The kvtier form of an LMCache-style mapping: its keys translated, the others kept as they are.

    Raises:
        ConfigError: ``remote_url`` / ``remote_serde`` (kvtier's L2 adapters replace them) or a bad value.
    """
    _lmcache_remote(data)
    out = {k: v for k, v in data.items() if k not in _LMCACHE_KEYS}
    if "max_local_cpu_size" in data:
        out["l1_size_gb"] = data["max_local_cpu_size"]
    if "local_cpu" in data and not parse_bool(data["local_cpu"]):
        out["l1_size_gb"] = 0
    if "pre_caching_hash_algorithm" in data:
        algo = data["pre_caching_hash_algorithm"]
        out["hash_algorithm"] = "sha256_cbor" if algo in ("builtin", "sha256_cbor_64bit") else algo
    disk = data.get("local_disk")
    if disk:
        path = str(disk).removeprefix("file://")
        spec = {"type": "local_disk", "path": path}
        if data.get("max_local_disk_size"):  # LMCache's 0 means "no limit"
            spec["size_gb"] = parse_size(data["max_local_disk_size"])
        out["l2_adapters"] = [spec, *out.get("l2_adapters", [])]
    return out
