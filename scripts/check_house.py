"""House rules that a linter does not check, over the tracked source tree.

1. No source file over ``MAX_LINES`` lines (Python, C++, CUDA; tests and benches included).
2. No import cycle between ``osd`` / ``osd_kernels`` modules through module-level imports
   (imports under ``if TYPE_CHECKING:`` are for annotations only and do not count).
3. An import inside a function carries a comment saying why (on the import's lines, or
   just above the run of import statements it belongs to): optional dependencies, heavy
   modules kept off the import path, tests that skip without a package.

Usage: ``python scripts/check_house.py [paths...]``; prints each breach and exits 1 if any.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

MAX_LINES = 600
SOURCE_SUFFIXES = {".py", ".cpp", ".cu", ".h", ".cuh"}
PACKAGES = ("osd", "osd_kernels")
ROOT = Path(__file__).resolve().parent.parent


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / line for line in out.splitlines() if Path(line).suffix in SOURCE_SUFFIXES]


def long_files(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        if not p.exists():
            continue
        n = len(p.read_text(errors="replace").splitlines())
        if n > MAX_LINES:
            out.append(f"{p.relative_to(ROOT)}: {n} lines (at most {MAX_LINES})")
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _module_name(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_imports(tree: ast.Module, module: str, is_pkg: bool) -> set[str]:
    """Modules imported at module level (not inside functions or TYPE_CHECKING blocks)."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                names.add(mod)
                names.update(f"{mod}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return names


def import_cycles(files: list[Path]) -> list[str]:
    mods: dict[str, ast.Module] = {}
    pkgs: set[str] = set()
    for p in files:
        rel = p.relative_to(ROOT)
        if p.suffix != ".py" or rel.parts[0] not in PACKAGES or not p.exists():
            continue
        name = _module_name(p)
        mods[name] = ast.parse(p.read_text())
        if p.name == "__init__.py":
            pkgs.add(name)
    graph: dict[str, set[str]] = {}
    for name, tree in mods.items():
        deps = set()
        for imp in _top_level_imports(tree, name, name in pkgs):
            if imp in mods and imp != name:
                deps.add(imp)
        # A submodule import runs its parent packages' __init__ first, but a package's own
        # submodules importing the package is the usual layout, so only explicit edges count.
        graph[name] = deps
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cyc = stack[stack.index(v) :] + [v]
                # A package __init__ that re-exports its submodules is not a cycle with them.
                if not (len(cyc) == 3 and (cyc[0] in pkgs or cyc[1] in pkgs)):
                    cycles.append("import cycle: " + " -> ".join(cyc))
            elif v not in state:
                dfs(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return cycles


def uncommented_function_imports(files: list[Path]) -> list[str]:
    """Imports inside functions without a comment on their lines or above their group (the
    run of import statements they belong to, blank lines between them allowed)."""
    out = []
    for p in files:
        if p.suffix != ".py" or not p.exists():
            continue
        src = p.read_text()
        lines = src.splitlines()
        tree = ast.parse(src)
        import_lines: set[int] = set()  # 1-based lines of any import statement
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                import_lines.update(range(node.lineno, node.end_lineno + 1))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                if not isinstance(sub, (ast.Import, ast.ImportFrom)):
                    continue
                ok = any("#" in line for line in lines[sub.lineno - 1 : sub.end_lineno])
                i = sub.lineno - 1  # walk up the group: other imports and blank lines
                while not ok and i >= 1:
                    text = lines[i - 1]
                    if i in import_lines or not text.strip():
                        ok = i in import_lines and "#" in text
                        i -= 1
                        continue
                    ok = text.strip().startswith("#")
                    break
                if not ok:
                    out.append(
                        f"{p.relative_to(ROOT)}:{sub.lineno}: import inside a function "
                        f"without a comment saying why: {lines[sub.lineno - 1].strip()}"
                    )
    return sorted(set(out))


def main(argv: list[str]) -> int:
    files = tracked_files()
    if argv:
        wanted = {(ROOT / a).resolve() for a in argv}
        scoped = [p for p in files if p.resolve() in wanted or any(w in p.parents for w in wanted)]
    else:
        scoped = files
    problems = long_files(scoped) + uncommented_function_imports(scoped) + import_cycles(files)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
