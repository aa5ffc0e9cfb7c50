"""The package's layers, read from the source: which kvtier modules each module imports (module level and inside
functions, parsed with ``ast``, never executed), checked against the rules below, and no import cycle between
modules at module level; and no public name (class, function, constant) defined in two modules. A failure names
each offending import or definition (file, line, module)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

ROOT = Path(kvtier.__file__).resolve().parent  # the kvtier under test (a worktree's src, or the install)
# import no kvtier module but kvtier.errors
LEAVES = ("kvtier.errors", "kvtier.units", "kvtier.proc", "kvtier.zmq_context", "kvtier.medium")
VOCABULARY = ("kvtier.hashing", "kvtier.keys", "kvtier.extra_keys", "kvtier.identity", "kvtier.layout", "kvtier.record",
              "kvtier.tensors", "kvtier.metrics", "kvtier.protocol", "kvtier.shm", "kvtier.config", "kvtier.auth",
              "kvtier.backend", "kvtier.codecs", "kvtier.hints", "kvtier.pages")
UPPER = ("kvtier.cache", "kvtier.l1", "kvtier.l2", "kvtier.server", "kvtier.client", "kvtier.connectors",
         "kvtier.events", "kvtier.demo", "kvtier.blend", "kvtier.trace")
# (importers, the modules they must not import); a name covers its submodules
RULES = [
    (VOCABULARY, UPPER),
    (("kvtier.l1", "kvtier.l2"), ("kvtier.cache", "kvtier.server", "kvtier.client", "kvtier.connectors", "kvtier.events",
                                  "kvtier.demo", "kvtier.trace")),
    # storage knows its own configs (kvtier.units has their value types), never the application's tree
    (("kvtier.l1", "kvtier.l2", "kvtier.codecs"), ("kvtier.config",)),
    # a trace is replayed through L1 and L2 themselves; the server writes one (server/trace.py imports trace.format)
    (("kvtier.trace",), ("kvtier.cache", "kvtier.server", "kvtier.client", "kvtier.connectors", "kvtier.events",
                         "kvtier.demo")),
    (("kvtier.events",), ("kvtier.cache", "kvtier.l1", "kvtier.l2", "kvtier.server", "kvtier.client", "kvtier.connectors",
                          "kvtier.demo")),
    (("kvtier.cache",), ("kvtier.server", "kvtier.client", "kvtier.connectors", "kvtier.demo")),
    (("kvtier.server",), ("kvtier.client", "kvtier.connectors", "kvtier.demo")),
    (("kvtier.client",), ("kvtier.server", "kvtier.l1", "kvtier.l2", "kvtier.cache", "kvtier.events", "kvtier.connectors",
                          "kvtier.demo")),
    (("kvtier.connectors", "kvtier.demo"), ("kvtier.server",)),
    # the demo and its model loaders (demo/models.py) sit on top of the connectors, never under them
    (("kvtier.connectors",), ("kvtier.demo",)),
    (("kvtier.blend",), ("kvtier.cache", "kvtier.l1", "kvtier.l2", "kvtier.server", "kvtier.client", "kvtier.connectors",
                         "kvtier.events", "kvtier.demo")),  # tensors in, tensors out  # they reach a server over the protocol only
]


def module_names() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("kvtier", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_names()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, typing: bool = True) -> list[tuple[str, int, bool]]:
    """(imported kvtier module, line, at module level) for every import in module ``name``; an
    ``if TYPE_CHECKING:`` import counts as not at module level (it never runs; ``typing`` False: left out)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                for alias in child.names:  # ``from kvtier import protocol``: the submodule, not the package
                    sub = f"{base}.{alias.name}"
                    out.append((sub if sub in MODULES else base, child.lineno, top))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                if typing:
                    visit(child, False)
            else:
                visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), True)
    return [(mod, line, top) for mod, line, top in out if mod == "kvtier" or mod.startswith("kvtier.")]


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT.parent)}:{line}"


def test_every_module_is_found():
    assert {"kvtier.errors", "kvtier.cache.cache", "kvtier.auth.zap", "kvtier.server.server"} <= set(MODULES)


def test_leaves_import_only_errors():
    bad = [f"{_where(name, line)} imports {mod}" for name in MODULES if _under(name, LEAVES)
           for mod, line, _ in imports_of(name) if mod != "kvtier.errors"]
    assert bad == [], "leaf modules import kvtier modules:\n" + "\n".join(bad)


def test_layers():
    bad = [f"{_where(name, line)}: {name} imports {mod}" for importers, forbidden in RULES
           for name in MODULES if _under(name, importers)
           for mod, line, _ in imports_of(name) if _under(mod, forbidden)]
    assert bad == [], "imports across layers:\n" + "\n".join(bad)


def import_cycles(deferred: bool) -> list[str]:
    """The import cycles between kvtier modules, at module level (``deferred`` False) or counting the imports
    inside functions too (never a ``TYPE_CHECKING`` one: it never runs)."""
    graph = {name: sorted({mod for mod, _, top in imports_of(name, typing=False)
                           if (top or deferred) and mod in MODULES and mod != name}) for name in MODULES}
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*path[path.index(dep):], dep]))
            elif dep not in state:
                walk(dep, [*path, dep])
        state[name] = 2

    for name in graph:
        if name not in state:
            walk(name, [name])
    return cycles


def test_no_import_cycle_at_module_level():
    cycles = import_cycles(deferred=False)
    assert cycles == [], "import cycles at module level:\n" + "\n".join(cycles)


def test_no_import_cycle_through_deferred_imports():
    """An import inside a function only hides a cycle until it runs (issue 40): two modules that need each other
    are one module, or a third holds what they share."""
    cycles = import_cycles(deferred=True)
    assert cycles == [], "import cycles, counting imports inside functions:\n" + "\n".join(cycles)


def public_names(name: str) -> list[tuple[str, int]]:
    """(name, line) of what module ``name`` defines at its top level for others to use: classes, functions and
    assigned names not starting with ``_`` (imports are not definitions)."""
    out = []
    for node in ast.parse(MODULES[name].read_text(), str(MODULES[name])).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, node.lineno))
        elif isinstance(node, ast.Assign):
            out.extend((t.id, node.lineno) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.append((node.target.id, node.lineno))
    return [(n, line) for n, line in out if not n.startswith("_")]


def test_no_two_public_things_share_a_name():
    # a module's logger and an entry point's main are every module's own, never imported
    own = {"log", "logger", "main"}
    where: dict[str, list[str]] = {}
    for name in MODULES:
        for thing, line in public_names(name):
            if thing not in own:
                where.setdefault(thing, []).append(_where(name, line))
    twice = [f"{thing}: {', '.join(places)}" for thing, places in sorted(where.items()) if len(places) > 1]
    assert twice == [], "public names defined in more than one module:\n" + "\n".join(twice)


def test_mediums_are_named_by_the_enum():
    """One ``Medium`` enum (``kvtier/medium.py``): no other module spells a medium as a string literal in code
    (docstrings may quote the wire values)."""
    mediums = {m.value for m in __import__("kvtier.medium", fromlist=["Medium"]).Medium}
    found = []
    for name, path in MODULES.items():
        if name == "kvtier.medium":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        found += [_where(name, node.lineno) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in mediums and id(node) not in docstrings]
    assert found == [], "medium string literals (use kvtier.medium.Medium):\n" + "\n".join(found)
