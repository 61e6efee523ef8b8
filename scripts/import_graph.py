"""The import graph of this repository's packages (core's `engine`, `engine_cli`, `engine_testing`
and every plugin's `engine_*`): the import cycles, the arrows back up and the product's imports
of its test kit.

- A cycle is a set of modules that import each other round (a strongly connected component).
  Each edge is a module-level import (runs when the module is imported) or a function-level one
  (runs when the function is called) or a type-checking one (under ``if TYPE_CHECKING:``: it
  never runs, but the annotations still depend on the module). A cycle is "module-level" when
  its module-level imports alone close it, "function-level" when it needs an import inside a
  function too, "type-checking" when it closes only through a type-checking import.
- An arrow back up is an import from inside a subpackage (``engine.parallel``,
  ``engine.memory``, ...) of a module outside it that itself imports, directly or not, a module
  of that subpackage: the subpackage sits both above and below that module.
- The product (`engine`, `engine_cli`) must never import the test kit (`engine_testing`, or
  the old ``engine.testing*`` modules).

    python scripts/import_graph.py            # every finding, then the counts
    python scripts/import_graph.py --counts   # the counts only
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "engine_cli")
TEST_KIT = ("engine_testing", "engine.testing")


def package_roots() -> list[Path]:
    """The import packages of every distribution in the repository."""
    roots = [ROOT / "core" / "engine", ROOT / "cli" / "engine_cli",
             ROOT / "testing" / "engine_testing"]
    roots += sorted(p for p in (ROOT / "plugins").glob("*/engine_*") if p.is_dir())
    return [r for r in roots if (r / "__init__.py").exists()]


def discover() -> dict[str, Path]:
    """Module name -> file, for every module of every package."""
    modules = {}
    for root in package_roots():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


KINDS = ("module", "function", "type-checking")  # strongest first


def _imports(tree: ast.Module):
    """(names imported, relative level, line, kind) for each import statement."""
    found = []

    def visit(node, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_one(sub, "type-checking")
                for sub in child.orelse:
                    visit_one(sub, kind)
            else:
                visit_one(child, kind)

    def visit_one(node, kind: str) -> None:
        if isinstance(node, ast.Import):
            found.append(([(a.name, None) for a in node.names], 0, node.lineno, kind))
        elif isinstance(node, ast.ImportFrom):
            found.append(([(node.module or "", a.name) for a in node.names], node.level,
                          node.lineno, kind))
        else:
            inner = kind
            if kind == "module" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda)):
                inner = "function"
            visit(node, inner)

    visit(tree, "module")
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def edges(modules: dict[str, Path]) -> dict[tuple[str, str], list[tuple[str, int]]]:
    """(importer, imported) -> sorted [(kind, line)], kind one of KINDS."""
    out: dict[tuple[str, str], list[tuple[str, int]]] = defaultdict(list)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for names, level, line, kind in _imports(tree):
            for module, attr in names:
                if level:
                    base = package.split(".")[:len(package.split(".")) - level + 1]
                    module = ".".join(base + ([module] if module else []))
                full = f"{module}.{attr}" if attr else module
                target = _known(full, modules) or _known(module, modules)
                if target and target != name and (kind, line) not in out[(name, target)]:
                    out[(name, target)].append((kind, line))
    return out


def strongly_connected(nodes, graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, each sorted."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    counter = [0]

    def connect(v: str) -> None:
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            connect(v)
    return sorted(comps)


def path_between(graph: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """The shortest import chain from ``start`` to a module for which ``goal`` holds."""
    seen, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w in seen:
                    continue
                seen[w] = v
                if goal(w):
                    chain = [w]
                    while seen[chain[-1]] is not None:
                        chain.append(seen[chain[-1]])
                    return chain[::-1]
                nxt.append(w)
        frontier = nxt
    return None


def subpackages(modules: dict[str, Path]) -> list[str]:
    """Packages below a distribution's import package (engine.parallel, not engine)."""
    return sorted(n for n, p in modules.items() if p.name == "__init__.py" and "." in n)


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def analyse(modules: dict[str, Path]) -> dict:
    found = edges(modules)
    graph: dict[str, set[str]] = defaultdict(set)
    # kind -> the graph of the imports of that kind or a stronger one
    at_least = {kind: defaultdict(set) for kind in KINDS}
    for (a, b), sites in found.items():
        graph[a].add(b)
        strongest = min(KINDS.index(kind) for kind, _ in sites)
        for kind in KINDS[strongest:]:
            at_least[kind][a].add(b)
    cycles = []
    for comp in strongly_connected(modules, graph):
        members = set(comp)
        level = next(kind for kind in KINDS if strongly_connected(
            comp, {v: at_least[kind][v] & members for v in comp}))
        inner = {(a, b): found[(a, b)] for a in comp for b in sorted(graph[a] & members)}
        cycles.append({"modules": comp, "level": level, "edges": inner})
    upward = []
    for package in subpackages(modules):
        for (a, b), sites in sorted(found.items()):
            if not inside(a, package) or inside(b, package):
                continue
            chain = path_between(graph, b, lambda m: inside(m, package))
            if chain:
                upward.append({"package": package, "edge": (a, b), "sites": sites,
                               "back": chain})
    test_kit = [{"edge": (a, b), "sites": sites} for (a, b), sites in sorted(found.items())
                if a.split(".")[0] in PRODUCT and not a.startswith(TEST_KIT)
                and b.startswith(TEST_KIT)]
    return {"cycles": cycles, "upward": upward, "test_kit": test_kit}


def _sites(sites) -> str:
    return ", ".join(f"{kind}-level line {line}" for kind, line in sites)


def report(result: dict, counts_only: bool) -> str:
    lines = []
    if not counts_only:
        for c in result["cycles"]:
            lines.append(f"cycle ({c['level']}-level): {' <-> '.join(c['modules'])}")
            lines += [f"    {a} -> {b}  ({_sites(s)})" for (a, b), s in c["edges"].items()]
        for u in result["upward"]:
            a, b = u["edge"]
            lines.append(f"arrow back up from {u['package']}: {a} -> {b}  ({_sites(u['sites'])});"
                         f" {' -> '.join(u['back'])}")
        for t in result["test_kit"]:
            a, b = t["edge"]
            lines.append(f"product imports its test kit: {a} -> {b}  ({_sites(t['sites'])})")
    by_level = defaultdict(int)
    for c in result["cycles"]:
        by_level[c["level"]] += 1
    levels = ", ".join(f"{kind}-level {by_level[kind]}" for kind in KINDS)
    lines.append(f"import cycles: {len(result['cycles'])} ({levels}); arrows back up: "
                 f"{len(result['upward'])}; product imports of the test kit: "
                 f"{len(result['test_kit'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", action="store_true", help="print the counts only")
    args = parser.parse_args(argv)
    result = analyse(discover())
    print(report(result, args.counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
