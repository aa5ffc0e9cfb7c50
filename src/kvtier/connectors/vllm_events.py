"""kvtier's KV cache events in vLLM's types: what the connector hands vLLM to publish in the engine's own stream.

``to_vllm_events`` converts kvtier's events (``kvtier.events.model``: the same field names, vLLM's encoding) into
vLLM's ``kv_events`` structs; ``KVTierEvents`` is the ``KVConnectorKVEvents`` the workers hand the scheduler
(``get_kv_connector_kv_cache_events`` -> ``update_connector_output``), which the scheduler's ``take_events``
publishes. Imports vLLM.
"""

from __future__ import annotations

from vllm.distributed import kv_events as ve
from vllm.distributed.kv_events import KVConnectorKVEvents


class KVTierEvents(KVConnectorKVEvents):
    """Events the workers hand to the scheduler (one worker per engine on vLLM CPU: no de-duplication)."""

    def __init__(self, events=None, num_workers: int = 1):
        self._events, self._workers = list(events or []), num_workers

    def add_events(self, events):
        self._events.extend(events)

    def aggregate(self):
        return self

    def increment_workers(self, count: int = 1):
        self._workers += count

    def get_all_events(self):
        return list(self._events)

    def get_number_of_workers(self):
        return self._workers

    def clear_events(self):
        self._events.clear()


def to_vllm_events(events) -> list:
    """kvtier events (``kvtier.events.model``) as vLLM's ``kv_events`` structs (same field names)."""
    out = []
    for ev in events or []:
        name = type(ev).__name__
        if name == "BlockStored":
            out.append(ve.BlockStored(block_hashes=ev.block_hashes, parent_block_hash=ev.parent_block_hash,
                                      token_ids=ev.token_ids, block_size=ev.block_size, lora_id=ev.lora_id,
                                      medium=ev.medium, lora_name=ev.lora_name, extra_keys=ev.extra_keys))
        elif name == "BlockRemoved":
            out.append(ve.BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium))
        elif name == "AllBlocksCleared":
            out.append(ve.AllBlocksCleared())
    return out
