"""Processes that tests and benchmarks both start: storage servers (``services``, ``service_proc``), the kvtier
server, vLLM and LMCache (``vllm``). Shared code, not tests: benchmarks import it, never a test module. Importable
from the repository root (pytest's ``pythonpath``; benchmarks put the root on ``sys.path``)."""
