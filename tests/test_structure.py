"""The house rules, checked from the source (issue 31): a path says what it holds, nothing grows too big to read, and
committed files name no machine's paths. The import rules (inward only, no circles) are tests/test_layers.py's.

- no module is named like its folder (``trees/trees.py``), and no two modules share a file name (one name, one job);
- no product file over :data:`MAX_FILE_LINES` lines, no product function over :data:`MAX_FUNCTION_LINES`;
- no absolute path of a machine (``/work/...``, ``/root/...``, ``/home/...``) in a committed text file: records hold
  paths relative to the repository or ``$SPECRAY_HOME`` (``decoding.paths.portable``);
- docs/architecture.md lists every module of the product, and nothing that is not one.

The product is the layers' packages (not tests/, not infra/)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("decoding", "kernels", "actors", "cluster", "evaluation", "training", "tuning", "serving", "jobs")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80

# Places that break a rule until the work on them lands, by rule; each entry says whose it is. An entry whose place
# passes fails the test below: take it out. The list only shrinks.
PENDING: dict[str, set[str]] = {}

# A path that starts like a machine's home or work folder, not preceded by what makes it part of a longer path or a URL
MACHINE_PATH = re.compile(r"(?<![\w./~$-])/(?:work|root|home|Users)/[^\s\"'`)\]]*")
# Absolute paths that are no machine's: the home of the user in Ray's container images (infra/kuberay)
ALLOWED_PATHS = ("/home/ray/",)
TEXT_FILES = (".py", ".md", ".json", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh")


def product_files() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def committed_files() -> list[Path]:
    """The files git tracks (every file below the root, caches and builds aside, outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", "__pycache__", "site", "build", ".venv"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def only_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def check_pending(rule: str, broken: set[str]) -> list[str]:
    """The places that break ``rule`` and are not pending, and the pending ones that no longer do."""
    pending = PENDING.get(rule, set())
    return sorted(broken - pending) + [f"{p} passes now: take it out of PENDING[{rule!r}]" for p in sorted(pending - broken)]


def test_no_module_is_named_like_its_folder():
    broken = {rel(p) for p in product_files() if p.stem == p.parent.name}
    assert not (bad := check_pending("named like its folder", broken)), "a module named like its folder:\n" + "\n".join(bad)


def test_one_file_name_for_one_job():
    seen: dict[str, list[str]] = {}
    for p in product_files():
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(rel(p))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, "one file name, two modules: " + "; ".join(f"{n}: {', '.join(ps)}" for n, ps in sorted(twice.items()))


def test_no_product_file_is_too_long():
    broken = {f"{rel(p)} ({n} lines)" for p in product_files() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not broken, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(sorted(broken))


def long_functions(path: Path) -> dict[str, int]:
    """``path::name`` -> lines of every function (methods and nested ones included) over the limit."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out[f"{rel(path)}::{node.name}"] = n
    return out


def test_no_product_function_is_too_long():
    found = {k: n for p in product_files() for k, n in long_functions(p).items()}
    bad = check_pending("function too long", set(found))
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(f"{b} ({found.get(b, '-')})" for b in bad)


def machine_paths(text: str) -> list[str]:
    """The machine paths in ``text`` (the allowed ones aside).

    >>> machine_paths('{"data": "/work/train/data", "home": "/home/ray/specray-home", "url": "http://h/root/x", "t": "/tmp/a"}')
    ['/work/train/data']
    """
    return [m for m in MACHINE_PATH.findall(text) if not m.startswith(ALLOWED_PATHS)]


def test_machine_paths_are_found():
    assert machine_paths("see /root/.specray/ship and `/home/alice/x`, not ~/work/a or $SPECRAY_HOME/root/b") == [
        "/root/.specray/ship",
        "/home/alice/x",
    ]


def test_no_machine_paths_in_committed_files():
    found = {}
    for p in committed_files():
        if p == Path(__file__).resolve():
            continue  # this file's own examples
        if p.suffix in TEXT_FILES and p.is_file() and p.stat().st_size < 5_000_000:
            hits = machine_paths(p.read_text(errors="replace"))
            if hits:
                found[rel(p)] = hits
    bad = check_pending("machine paths", set(found))
    assert not bad, "machine paths in committed files:\n" + "\n".join(f"{b}: {found.get(b, '')}" for b in bad)


def test_the_architecture_page_lists_every_module():
    """docs/architecture.md names each product module by its path; a package's __init__ counts when it holds code."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b(?:" + "|".join(PRODUCT) + r")/[\w/]*\.py\b", text))
    missing_files = sorted(n for n in named if not (ROOT / n).is_file())
    unlisted = sorted(rel(p) for p in product_files() if rel(p) not in named and not (p.name == "__init__.py" and only_docstring(p)))
    assert not missing_files, f"docs/architecture.md names modules that do not exist: {missing_files}"
    assert not unlisted, f"docs/architecture.md does not list: {unlisted}"


def missing_imports(paths: list[Path]) -> list[str]:
    """``file:line: module`` for every import of a project module that does not exist, inside functions too."""

    def exists(module: str) -> bool:
        base = ROOT / Path(*module.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    missing = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                if module.split(".")[0] in PRODUCT and not exists(module):
                    missing.append(f"{path.name}:{node.lineno}: {module}")
    return missing


def test_every_project_import_resolves(tmp_path):
    """A module renamed or moved leaves no import behind, not even one inside a function that runs only on a GPU, on
    a cluster or in a slow test (``from decoding.model.models import ...`` after models.py became loading.py)."""
    missing = missing_imports(product_files() + sorted((ROOT / "tests").rglob("*.py")))
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
    stale = tmp_path / "stale.py"  # the check finds one
    stale.write_text("def f():\n    from decoding.model.models import load_model\n    import decoding.engine\n")
    assert missing_imports([stale]) == ["stale.py:2: decoding.model.models", "stale.py:3: decoding.engine"]


def scripts_without_kernels(paths: list[Path]) -> list[str]:
    """The scripts (a ``__main__`` block) that import the decoding code but never install the kernels the product runs:
    neither ``kernels.install()`` nor ``jobs.common.run_cli`` (which calls it; ``jobs.common.command`` makes a job's
    main of it). ``decoding/`` may not import
    ``kernels`` (tests/test_layers.py), so every process installs them itself, and a script that forgets measures the
    slow torch operations instead: ``tests/actors/bench_pearl.py`` compared AR at 86 tokens/s in-process against
    actors on the kernels, and found PEARL's output identical to AR's on 2 prompts of 6."""
    missing = []
    for path in paths:
        text = path.read_text()
        if '__name__ == "__main__"' not in text:
            continue
        tree = ast.parse(text)
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imports |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        if not any(m == "decoding" or m.startswith("decoding.") for m in imports):
            continue
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        installs = {"kernels.install"} | ({"run_cli", "command"} if "jobs.common" in imports else set())  # a job's main
        if not calls & installs:
            missing.append(rel(path) if path.is_relative_to(ROOT) else path.name)
    return missing


def test_every_script_that_decodes_installs_the_kernels(tmp_path):
    """A script that builds decoders runs the kernels the CLI, the workers and Serve run, so what it measures is what
    users get."""
    missing = scripts_without_kernels(product_files() + sorted((ROOT / "tests").rglob("*.py")))
    assert not missing, "scripts that decode without kernels.install() or jobs.common.run_cli:\n" + "\n".join(missing)
    bare = tmp_path / "bare.py"  # the check finds one
    bare.write_text('from decoding.in_process import SpecDecoder\n\nif __name__ == "__main__":\n    SpecDecoder(None)\n')
    fixed = tmp_path / "fixed.py"
    fixed.write_text("import kernels\n\nkernels.install()\n" + bare.read_text())
    assert scripts_without_kernels([bare, fixed]) == ["bare.py"]
