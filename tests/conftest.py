"""Makes ``tests/`` importable (pytest's default "prepend" import mode puts a rootless conftest's folder on
``sys.path``), so every test reaches the helpers in ``tests/support/`` as ``support.<module>``.

Also a private ``$XDG_RUNTIME_DIR`` for the whole run: kvtier servers keep their secret file under
``$XDG_RUNTIME_DIR/kvtier/`` (one per port) and same-user clients find it there; a private folder keeps those
files out of the user's own and removes them after the run. Subprocesses (servers, vLLM) inherit it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_made: list[str] = []


def pytest_configure(config) -> None:
    runtime = tempfile.mkdtemp(prefix="kvtier-test-runtime-")  # mode 0700
    os.environ["XDG_RUNTIME_DIR"] = runtime
    _made.append(runtime)


def pytest_unconfigure(config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
