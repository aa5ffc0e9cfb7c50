"""Facts read from the CUDA vLLM wheels' Python sources (``scripts/setup-vllm-wheels.sh`` puts them under
``.cache/vllm-wheels/<version>``): attention backends, KV cache layouts, the connector base class. Read with ``ast``
(the CUDA backends do not all import on a CPU machine), never executed, except ``vllm/v1/kv_cache_layout.py``, a leaf
module of one enum, which is run as it is."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".cache" / "vllm-wheels"
VERSIONS = ("0.33.0", "0.34.0")
CONNECTOR_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def root(version: str) -> Path:
    """The extracted ``vllm`` sources of ``version``. Raises RuntimeError (what to run) when they are missing."""
    path = WHEELS / version
    if not (path / ".complete").exists():
        raise RuntimeError(f"{path} is missing: run scripts/setup-vllm-wheels.sh (scripts/test.sh does)")
    return path


def parse(version: str, relpath: str) -> tuple[ast.Module, str]:
    text = (root(version) / relpath).read_text()
    return ast.parse(text), text


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found")


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def registry(version: str) -> dict[str, str]:
    """``AttentionBackendEnum`` member name -> class path (``vllm/v1/attention/backends/registry.py``)."""
    tree, _ = parse(version, "vllm/v1/attention/backends/registry.py")
    out = {}
    for stmt in find_class(tree, "AttentionBackendEnum").body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            value = stmt.value
            parts = [value] if isinstance(value, ast.Constant) else list(ast.walk(value))
            text = "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
            if text:
                out[stmt.targets[0].id] = text
    return out


def backend_facts(version: str, class_path: str) -> dict:
    """One backend class: ``name`` (``get_name``'s constant), ``kv_cache_dtypes`` (``supported_kv_cache_dtypes``),
    ``block_sizes`` / ``block_multiples`` (the ints and ``MultipleOf(n)`` of every return of
    ``get_supported_kernel_block_sizes``), ``bases``, ``module`` (the source text) and ``relpath``."""
    module, _, cls_name = class_path.rpartition(".")
    relpath = module.replace(".", "/") + ".py"
    tree, text = parse(version, relpath)
    cls = find_class(tree, cls_name)
    facts = {"class": cls_name, "relpath": relpath, "module": text,
             "bases": [ast.unparse(b) for b in cls.bases], "name": None, "kv_cache_dtypes": None,
             "block_sizes": set(), "block_multiples": set()}
    get_name = method(cls, "get_name")
    if get_name is not None:
        facts["name"] = next(n.value.value for n in ast.walk(get_name) if isinstance(n, ast.Return))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", "") == "supported_kv_cache_dtypes":
            facts["kv_cache_dtypes"] = [e.value for e in stmt.value.elts]
    sizes = method(cls, "get_supported_kernel_block_sizes")
    for ret in (n for n in ast.walk(sizes) if isinstance(n, ast.Return)) if sizes else ():
        for elt in getattr(ret.value, "elts", []):
            if isinstance(elt, ast.Constant):
                facts["block_sizes"].add(elt.value)
            elif isinstance(elt, ast.Call) and ast.unparse(elt.func) == "MultipleOf":
                facts["block_multiples"].add(elt.args[0].value)
    return facts


def split_expressions(text: str) -> list[str]:
    """Every ``<x> = kv_cache...`` right-hand side that splits or squeezes the paged KV (e.g.
    ``kv_cache.transpose(1, 2).split(self.head_size, dim=-1)``), as source text."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign):
            rhs = ast.unparse(node.value)
            if rhs.startswith("kv_cache.") and (".split(" in rhs or ".squeeze(" in rhs):
                out.append(rhs)
    return out


def kv_cache_layouts(version: str) -> dict[str, tuple[int, ...]]:
    """``KVCacheLayout`` member -> stride order, by running the wheel's ``vllm/v1/kv_cache_layout.py`` (a leaf
    module: one enum, no vLLM imports)."""
    scope: dict = {"__name__": "vllm_kv_cache_layout"}
    exec(compile((root(version) / "vllm/v1/kv_cache_layout.py").read_text(), "kv_cache_layout.py", "exec"), scope)
    return {member.name: tuple(member.value) for member in scope["KVCacheLayout"]}


def signature(fn: ast.FunctionDef) -> dict:
    """A method's parameters as ``{"kind": [(name, has_default)], ...}`` plus its decorators."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    return {"positional": [(p.arg, d) for p, d in zip(positional, defaults)],
            "vararg": a.vararg.arg if a.vararg else None,
            "kwonly": [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)],
            "kwarg": a.kwarg.arg if a.kwarg else None,
            "decorators": sorted(ast.unparse(d) for d in fn.decorator_list if ast.unparse(d) != "abstractmethod")}


def class_methods(tree: ast.Module, cls_name: str) -> dict[str, tuple[ast.FunctionDef, bool]]:
    """``{method name: (node, abstract)}`` of a class body."""
    cls = find_class(tree, cls_name)
    return {n.name: (n, any(ast.unparse(d) == "abstractmethod" for d in n.decorator_list))
            for n in cls.body if isinstance(n, ast.FunctionDef)}


def parse_kvtier(relpath: str) -> ast.Module:
    """A kvtier source file (``relpath`` from the repository root), parsed."""
    return ast.parse((REPO / relpath).read_text())
