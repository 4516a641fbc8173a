"""The layers, checked from the source: imports point inward only, no two modules import each other (directly or
round a longer loop; lazily or not; not even for type checkers), and neither do decoding/'s rooms.

The layers and rooms are those of docs/architecture.md (and of the project's design notes, DESIGN.md, which live
beside the repository, in ../shared, not in it). tests/test_structure.py checks the other house rules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# from the inside out; a package may import only packages before it in this list
LAYERS = ["decoding", "kernels", "actors", "cluster", "evaluation", "training", "tuning", "serving", "jobs"]


def imports_of(path: Path, lazy: bool = True, typing: bool = False) -> set[str]:
    """Every absolute import of a project module the file runs: top-level ones, and with ``lazy`` also those inside
    functions (a lazy import that closes a loop is a circle too, only hidden). ``if TYPE_CHECKING:`` blocks never
    run: they count only with ``typing`` (a circle through them is still a circle to a reader and a type checker)."""
    found = set()

    def visit(node) -> None:
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if not lazy and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {n for n in found if n.split(".")[0] in LAYERS}


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
    assert not outward, "imports must point inward (docs/architecture.md layers):\n" + "\n".join(sorted(outward))


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (lazily too; with ``typing``, for type checkers too)."""
    mods = project_modules()
    return {m: {i for i in imports_of(p, typing=typing) if i in mods and i != m} for m, p in mods.items()}


def circles_in(graph: dict[str, set[str]]) -> list[str]:
    circles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == "open":
                circles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return circles


def test_no_import_circles():
    circles = circles_in(import_graph(typing=True))  # TYPE_CHECKING imports included
    assert not circles, "import circles:\n" + "\n".join(circles)


def room_of(module: str) -> str | None:
    """decoding/'s room of a module: its subpackage (``decoding.loop``, ``decoding.drafters``, ...), or the module
    itself at decoding/'s root (``decoding.config``); None outside decoding/ and for the package itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "decoding" and len(parts) > 1 else None


def test_no_circles_between_decodings_rooms():
    """The rooms of decoding/ (model, trees, drafters, loop, schedules, and the modules at its root) import one
    another one way only: a drafter that runs the loop lives above it (schedules/), not beside the drafters."""
    rooms: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        if room_of(m):
            rooms.setdefault(room_of(m), set()).update(room_of(d) for d in deps if room_of(d) not in (None, room_of(m)))
    circles = circles_in(rooms)
    assert not circles, "circles between decoding/'s rooms:\n" + "\n".join(circles)


# decoding/'s rooms from the ground up: a room imports only rooms before it (no arrow back up)
DECODING_ROOMS = [
    # the ground: errors, $SPECRAY_HOME, kernel dispatch, the device clock, warping, sampling limits, tree descriptions, builders
    "decoding.errors",
    "decoding.paths",
    "decoding.accel",
    "decoding.timing",
    "decoding.sampling",
    "decoding.limits",
    "decoding.treespec",
    "decoding.builders",
    # the declarations: the table of methods and the configuration (torch-free)
    "decoding.methods",
    "decoding.config",
    # the rooms
    "decoding.model",
    "decoding.trees",
    "decoding.drafters",
    "decoding.loop",
    "decoding.decoder",
    "decoding.schedules",
    "decoding.in_process",
]


def test_decodings_rooms_import_downward_only():
    """Every room has a place in :data:`DECODING_ROOMS` and imports only rooms below it, lazily or not; so the
    declarations (config, methods) import nothing but the ground."""
    up = []
    for m, deps in import_graph().items():
        room = room_of(m)
        if room is None:
            continue
        assert room in DECODING_ROOMS, f"{room} has no place in DECODING_ROOMS"
        for d in deps:
            dep = room_of(d)
            if dep not in (None, room) and DECODING_ROOMS.index(dep) > DECODING_ROOMS.index(room):
                up.append(f"{m} imports {d}")
    assert not up, "imports back up between decoding/'s rooms:\n" + "\n".join(sorted(up))


def test_the_checks_catch_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    import cluster\ndef f():\n    from jobs.common import fail\n    import serving.app\n"
    )
    assert imports_of(bad) == {"jobs.common", "jobs.common.fail", "serving.app"}
    assert imports_of(bad, lazy=False) == set()
    assert imports_of(bad, typing=True) == {"cluster", "jobs.common", "jobs.common.fail", "serving.app"}
    assert circles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    rooms = [room_of(m) for m in ("decoding.loop.batch", "decoding.config", "decoding", "jobs.cli")]
    assert rooms == ["decoding.loop", "decoding.config", None, None]
