"""Processes that tests and benchmarks both start: storage servers (``services``, ``service_proc``), the kvtier
server, vLLM and LMCache (``vllm``). Shared code, not tests: benchmarks import it, never a test module. Installed
with kvtier (``pip install -e .``: pyproject's ``package-dir``), so nothing edits ``sys.path`` to import it."""
