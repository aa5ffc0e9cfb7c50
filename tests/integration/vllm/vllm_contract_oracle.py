"""Run with the vLLM environment's python and ``PYTHONPATH=<.cache/vllm-wheels/VERSION>:<kvtier src>``
(``test_cuda_wheels.py`` does): imports that wheel's real ``KVConnectorBase_V1``, ``SupportsHMA`` and
``KVConnectorKVEvents`` (they import on CPU) and kvtier's connector on top of them, and reports every abstract method
left, every method whose signature differs from the base's, and what the 0.34 contract methods answer. Prints one
line ``ORACLE <json>``."""

from __future__ import annotations

import inspect
import json

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvtier.connectors.vllm import KVTierConnector
from kvtier.connectors.vllm_events import KVTierEvents


def compatible(base, ours) -> bool:
    """``ours`` accepts every call ``base`` accepts: the same parameters, in order, of the same kinds, with a default
    wherever the base has one, and the same static / class method kind."""
    if isinstance(inspect.getattr_static(*base), (staticmethod, classmethod)) != isinstance(
            inspect.getattr_static(*ours), (staticmethod, classmethod)):
        return False
    a, b = inspect.signature(getattr(*base)).parameters, inspect.signature(getattr(*ours)).parameters
    if list(a) != list(b):
        return False
    return all(a[n].kind == b[n].kind and (a[n].default is inspect.Parameter.empty or
                                           b[n].default is not inspect.Parameter.empty) for n in a)


def report(base_cls, our_cls) -> dict:
    own = [n for n, v in vars(our_cls).items() if callable(v) or isinstance(v, (staticmethod, classmethod))]
    shared = [n for n in own if hasattr(base_cls, n) and (not n.startswith("__") or n in vars(base_cls))]
    return {"abstract": sorted(base_cls.__abstractmethods__),
            "left": sorted(our_cls.__abstractmethods__),
            "implemented": sorted(n for n in base_cls.__abstractmethods__ if n in vars(our_cls)),
            "mismatched": sorted(n for n in shared if not compatible((base_cls, n), (our_cls, n)))}


def main() -> None:
    out = {"connector": report(KVConnectorBase_V1, KVTierConnector),
           "hma": report(SupportsHMA, KVTierConnector),
           "events": report(KVConnectorKVEvents, KVTierEvents),
           # the comparison can fail: two different methods of the base never pass for each other
           "differ_detected": not compatible((KVConnectorBase_V1, "start_load_kv"), (KVConnectorBase_V1, "save_kv_layer"))
           and not compatible((KVConnectorBase_V1, "get_num_new_matched_tokens"), (KVConnectorBase_V1, "update_state_after_alloc")),
           "lookahead": KVTierConnector.supports_lookahead_block_hashes(None),
           "has_may_load_async": hasattr(KVConnectorBase_V1, "may_load_async")}
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # before 0.34
        out["kv_cache_access"] = None
    else:
        access = KVTierConnector.kv_cache_access(None)
        out["kv_cache_access"] = access.name if isinstance(access, KVCacheAccess) else repr(access)
    print("ORACLE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
