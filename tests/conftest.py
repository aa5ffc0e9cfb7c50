"""Makes ``tests/`` importable (pytest's default "prepend" import mode puts a rootless conftest's folder on
``sys.path``), so every test reaches the helpers in ``tests/support/`` as ``support.<module>``.

Also a private ``$XDG_RUNTIME_DIR`` for the whole run: kvtier servers keep their secret file under
``$XDG_RUNTIME_DIR/kvtier/`` (one per port) and same-user clients find it there; a private folder keeps those
files out of the user's own and removes them after the run. Subprocesses (servers, vLLM) inherit it.

``scripts/test.sh`` runs the suite on two pytest-xdist workers (``--dist loadscope``, scheduled by
``pytest_xdist_make_scheduler`` below): the modules that run vLLM or a Dynamo deployment are one scope, so they
run one after another on one worker, as they did alone (each binds the machine's cores and shares the model cache),
while the other worker takes the other modules, each module whole. vLLM computes on one core
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``): on this 2-core machine the second core was idle during its tests. The
transformers tests (``test_hf_connector``, the demo) assert outputs, never speed, so they run on the other worker:
the vLLM scope is the suite's critical path (about 20 of its minutes).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import pytest

_made: list[str] = []


def pytest_configure(config) -> None:
    runtime = tempfile.mkdtemp(prefix="kvtier-test-runtime-")  # mode 0700
    os.environ["XDG_RUNTIME_DIR"] = runtime
    _made.append(runtime)


def pytest_unconfigure(config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)


# modules that start vLLM or a Dynamo deployment
_ENGINE_MODULES = re.compile(r"(^|/)(test_vllm_\w+|test_dynamo_\w+)\.py$")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadscope``: each module goes to one worker as a whole (its module fixtures are set up once),
    and every engine module forms one scope, so they run one after another on the same worker."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EnginesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "engines" if _ENGINE_MODULES.search(nodeid.split("::", 1)[0]) else super()._split_scope(nodeid)

    return EnginesTogether(config, log)
