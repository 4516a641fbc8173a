"""The layers of DESIGN.md, checked from the source: imports point inward only, and no two modules import
each other (directly or round a longer loop), lazily or not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# from the inside out; a package may import only packages before it in this list
LAYERS = ["decoding", "kernels", "actors", "cluster", "evaluation", "training", "tuning", "serving", "jobs"]


def imports_of(path: Path) -> set[str]:
    """Every absolute import of a project module in the file, top-level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in LAYERS)
    return found


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


def test_imports_point_inward():
    outward = []
    for mod, path in project_modules().items():
        here = LAYERS.index(mod.split(".")[0])
        for imported in imports_of(path):
            if LAYERS.index(imported.split(".")[0]) > here:
                outward.append(f"{mod} imports {imported}")
    assert not outward, "imports must point inward (DESIGN.md layers):\n" + "\n".join(sorted(outward))


def test_no_import_circles():
    mods = project_modules()
    graph = {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}
    # a package's __init__ importing its own submodules is not a circle worth failing on
    graph = {m: {i for i in deps if not (mods[i].name == "__init__" and m.startswith(i + "."))} for m, deps in graph.items()}
    circles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_catch_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jobs.common import fail\n    import serving.app\n")
    assert imports_of(bad) == {"jobs.common", "jobs.common.fail", "serving.app"}
