"""kvtier's vLLM connector under the name Dynamo's disaggregated prefill worker accepts (NVIDIA Dynamo 1.6.1).

Why this module exists: ``python -m dynamo.vllm --disaggregation-mode prefill`` picks its prefill/decode
hand-off protocol by the ``kv_connector`` *name* (``dynamo/vllm/kv_connector_protocols.py``) and refuses any
other name (``Unsupported kv_connector='KVTierConnector' for PD``). kvtier needs exactly the protocol Dynamo
files under ``LMCacheMPConnector``: "cache-mediated", no per-request transfer parameters; the prefill worker
stores the prompt's chunks in the shared cache server and the decode worker finds them by token-hash lookup
(whatever it does not find it recomputes). vLLM resolves ``kv_connector`` inside ``kv_connector_module_path``
before its own registry ("External module path takes priority over internal registry",
``vllm/distributed/kv_transfer/kv_connector/factory.py``), so naming this module there loads kvtier's connector
under that name, with no change to Dynamo or vLLM::

    --kv-transfer-config '{"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": "kvtier.connectors.dynamo_pd",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"kvtier.server_url": "tcp://127.0.0.1:5555"}}'

LMCache is neither imported nor needed: the class below is ``KVTierConnector`` itself (same settings, same
behaviour, its log lines say "kvtier connector"). Use it only for Dynamo's prefill and decode workers; everywhere
else name ``KVTierConnector`` in ``kvtier.connectors.vllm``. Once Dynamo lists kvtier's connector in its
protocol table, this alias is no longer needed.
"""

from __future__ import annotations

from kvtier.connectors.vllm import KVTierConnector


class LMCacheMPConnector(KVTierConnector):
    """``KVTierConnector`` under the name that selects Dynamo's cache-mediated PD protocol (see the module doc)."""
