"""Parts own their state: every ``self.x`` a class of the connectors, the client, the server, the cache, L1, L2 or the
events reads is set by the class itself (in any method, or in its body: a method, a property, a dataclass field, a
class attribute) or by a kvtier base class. A mixin that reads what its host sets fails here. Read from the source
with ``ast``, never executed; a failure names the class, the attribute and the line. And no module reads the
private attributes (``x._name``) that another kvtier module owns: a collaborator uses its partner's public face."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

ROOT = Path(kvtier.__file__).resolve().parent  # the kvtier under test (a worktree's src, or the install)
PACKAGES = ("connectors", "client", "server", "cache", "l1", "l2", "events")
# what a base class from outside kvtier sets for its subclasses (read from that library's source: vLLM 0.32, msgspec,
# SGLang 0.5.23: HiCacheStorage's register_mem_pool_host sets mem_pool_host, which KVTierStorage overrides)
FOREIGN_BASES = {
    "KVConnectorBase_V1": {"_kv_transfer_config", "_connector_metadata", "_get_connector_metadata", "_role",
                           "_vllm_config", "_kv_cache_config", "_kv_cache_manager"},
    "KVConnectorKVEvents": set(),
    "KVConnectorMetadata": set(),
    "SupportsHMA": set(),
    "Struct": set(),  # msgspec
    "HiCacheStorage": set(),
}


def _classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    out: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append((path, node))
    return out


CLASSES = _classes()


def _targets(node: ast.AST):
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _own(cls: ast.ClassDef) -> set[str]:
    """Names ``cls`` defines: its body's names and every ``self.x`` it assigns."""
    names = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for target in stmt.targets for t in _targets(target) if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in _targets(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Subscript):  # Generic[T]
        base = base.value
    return base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None


def _defined(cls: ast.ClassDef, seen: frozenset = frozenset()) -> tuple[set[str], list[str]]:
    """(names ``cls`` and its bases define, base classes nobody knows)."""
    names, unknown = _own(cls), []
    for base in cls.bases:
        name = _base_name(base)
        if name in FOREIGN_BASES:
            names |= FOREIGN_BASES[name]
        elif name in CLASSES and len(CLASSES[name]) == 1 and name not in seen:
            more, unk = _defined(CLASSES[name][0][1], seen | {cls.name})
            names |= more
            unknown += unk
        elif name not in ("object", "ABC", "Exception", "Protocol", "NamedTuple", "Enum", "IntEnum", "str", "int",
                          "dict", "tuple", "RuntimeError", "ValueError", "threading.Thread", "Thread", "BaseModel"):
            unknown.append(name or ast.dump(base))
    return names, unknown


def _reads(cls: ast.ClassDef):
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                and node.value.id == "self"):
            yield node.attr, node.lineno


def test_every_part_reads_only_what_it_sets_or_inherits():
    bad = []
    for name, found in CLASSES.items():
        for path, cls in found:
            if path.relative_to(ROOT).parts[0] not in PACKAGES:
                continue
            defined, unknown = _defined(cls)
            where = f"{path.relative_to(ROOT.parent)}:{cls.lineno} {name}"
            bad += [f"{where}: base {b} is neither kvtier's nor listed in FOREIGN_BASES" for b in unknown]
            bad += [f"{path.relative_to(ROOT.parent)}:{line} {name} reads self.{attr}, which it never sets"
                    for attr, line in _reads(cls) if attr not in defined and not attr.startswith("__")]
    assert bad == [], "classes reading state they do not own:\n" + "\n".join(sorted(set(bad)))


def test_the_check_sees_a_mixin():
    mixin = ast.parse("class Mixin:\n    def load(self):\n        return self.backend.get(self.key)\n").body[0]
    assert {attr for attr, _ in _reads(mixin)} - _defined(mixin)[0] == {"backend", "key"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, variables and the attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _foreign_private_reads(trees: dict[str, ast.AST]) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` / ``cls`` / ``super()`` and ``_name`` belongs to another kvtier module
    than the reader (a private of a library, e.g. transformers' ``config._commit_hash``, is not kvtier's to rule)."""
    homes: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for name in _private_names(tree):
            homes.setdefault(name, set()).add(module)
    bad = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                    isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"):
                continue
            if node.attr in homes and module not in homes[node.attr]:
                bad.append(f"{module}:{node.lineno} reads {ast.unparse(owner)}.{node.attr}, private to "
                           f"{', '.join(sorted(homes[node.attr]))}")
    return bad


def test_no_module_reads_the_private_attributes_of_another_modules_objects():
    trees = {str(path.relative_to(ROOT.parent)): ast.parse(path.read_text(), str(path))
             for path in sorted(ROOT.rglob("*.py"))}
    bad = _foreign_private_reads(trees)
    assert bad == [], "private attributes read across modules (make them public or move the code):\n" + "\n".join(bad)


def test_the_check_sees_a_private_read_across_modules():
    owner = ast.parse("class Connector:\n    def __init__(self):\n        self._store = {}\n")
    reader = ast.parse("def blend(connector):\n    return connector._store, connector.model._commit_hash\n")
    same = ast.parse("class A:\n    def __init__(self):\n        self._n = 1\n    def eq(self, other):\n"
                     "        return other._n == self._n\n")
    bad = _foreign_private_reads({"connector.py": owner, "blend.py": reader, "a.py": same})
    assert len(bad) == 1 and bad[0].startswith("blend.py:2 reads connector._store")
