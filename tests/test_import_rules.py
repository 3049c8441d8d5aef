"""The package's import rules, read from the source with `ast` (nothing is imported).

- `optimus/` never imports `controller/` (DESIGN.md: they meet only through the rank<->agent
  socket and the environment an agent sets).
- `optimus/checkpoint/` never imports `optimus/hf/`: Hugging Face interop reads and writes
  checkpoints, not the other way round.
- The parts of `optimus/` (a subpackage, or a module at its top) import only parts of lower
  layers, as LAYERS orders them, so no two parts import each other, directly or around a cycle.
  Every import counts, a function's deferred one included: deferring it changes when the
  module loads, not which way the arrow points.

A new part of optimus/ goes into the lowest layer its imports allow; an import that points up
is moved down (or the code it needs is) rather than added to KNOWN_UPWARD.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "optimus"

LAYERS = (  # lowest first; a part may import parts of lower layers only
    ("optimus", "contract", "files", "lazy"),  # the root (__version__), the shared records, helpers
    ("models", "runtime"),  # the plain model; devices, the launch environment, meshes
    ("config",),  # the job file's schema and checks
    ("metrics", "optim", "stability", "supervision"),  # supervision: heartbeat, agreement, faults
    ("faults", "health", "ports"),  # re-exports of supervision/, until their importers move
    ("parallel",),  # plans applied to the model from outside; it marks the heartbeat's phases
    ("checkpoint", "planner"),
    ("rundir",),  # what a run directory says: reads checkpoint manifests and the job file
    ("data",),  # its audit reads a run's seed through rundir
    ("evaluate", "hf", "report", "step"),
    ("boundary", "commands"),
    ("train",),
    ("cli",),
    ("__main__",),
)

# (importing module, imported module): the one allowed upward arrow. The warm process
# (`python -m optimus.supervision.warm`) is a process entry point, as cli is: it preloads the
# trainer and runs the CLI in each forked rank, by design inside its main and standby functions,
# never at import (train imports nothing of it). Nothing else may be added here.
KNOWN_UPWARD = {
    ("optimus.supervision.warm", "optimus.train"),
    ("optimus.supervision.warm", "optimus.cli"),
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module name) of every import in `tree`, relative ones resolved, and the string
    named by an `importlib.import_module("...")` call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, name] if name else base)
            found.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and _called(node) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(importing module, line, imported module) for every import under `root`."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        rows += [(module, line, name)
                 for line, name in _imported(tree, module, path.name == "__init__.py")]
    return rows


def part(module: str, package: str = "optimus") -> str | None:
    """The part of `package` a module belongs to: its subpackage or top-level module."""
    names = module.split(".")
    if names[0] != package:
        return None
    return names[1] if len(names) > 1 else package


def upward(root: Path = ROOT, layers=LAYERS) -> list[tuple[str, int, str]]:
    """Imports of a part from the same or a higher layer; a part in no layer is one too."""
    package = root.name
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    bad = []
    for module, line, name in imports(root):
        source, target = part(module, package), part(name, package)
        if target is None or target == source:
            continue
        if source not in rank or target not in rank or rank[target] >= rank[source]:
            bad.append((module, line, name))
    return bad


def test_optimus_never_imports_controller():
    offending = [row for row in imports() if row[2].split(".")[0] == "controller"]
    assert offending == [], f"optimus/ imports controller/: {offending}"


def test_checkpoint_never_imports_hf():
    offending = [row for row in imports()
                 if part(row[0]) == "checkpoint" and part(row[2]) == "hf"]
    assert offending == [], f"optimus/checkpoint imports optimus/hf: {offending}"
    assert any(part(m) == "hf" and part(n) == "checkpoint" for m, _, n in imports()), \
        "optimus/hf no longer reads checkpoints: is the rule still about the right folders?"


def test_every_part_has_a_layer():
    parts = {part(_module_name(path, ROOT)) for path in ROOT.rglob("*.py")}
    placed = {name for layer in LAYERS for name in layer}
    assert parts - placed == set(), "add these parts of optimus/ to LAYERS, where their " \
        f"imports put them: {sorted(parts - placed)}"
    assert len(placed) == sum(len(layer) for layer in LAYERS), "a part is in two layers"


def test_no_upward_import():
    bad = [f"{module}:{line} imports {name}" for module, line, name in upward()
           if (module, name) not in KNOWN_UPWARD]
    assert bad == [], "imports against the layer order (LAYERS):\n" + "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself: a tree with one arrow each way, a deferred and a relative import."""
    pkg = tmp_path / "pkg"
    for folder in ("low", "high"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from pkg.low import b\nfrom . import c\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from ..high import a\n")
    (pkg / "low" / "d.py").write_text("import importlib\nimportlib.import_module('pkg.high.a')\n")
    layers = (("pkg",), ("low",), ("high",))
    assert sorted(upward(pkg, layers)) == [("pkg.low.b", 2, "pkg.high"),
                                           ("pkg.low.d", 2, "pkg.high.a")]
    assert upward(pkg, (("pkg",), ("high",), ("low",))) == [("pkg.high.a", 1, "pkg.low")]
    assert {row[1:] for row in upward(pkg, (("pkg",), ("low", "high")))} == {
        (1, "pkg.low"), (2, "pkg.high"), (2, "pkg.high.a")}  # one layer: neither way
