"""The shape of the house, checked: no module reaches into another's private names, and layers import downward.

Read from the source with `ast`, so a violation fails here before it spreads.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "kvattn").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))


def module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(ROOT / "src") if "src" in path.parts else path.relative_to(ROOT)
    parts = list(relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path):
    """`(imported module, names, line)` for every import in a file, relative ones resolved."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            yield base, [alias.name for alias in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno


def test_no_module_imports_another_modules_private_names():
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name} from {module}"
        for path in SOURCES
        for module, names, line in imports(path)
        if module.startswith(("kvattn", "benchmarks")) and module != "__future__"
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not offenders, "\n".join(offenders)


def test_attribute_access_to_private_names_of_kvattn_modules_is_absent():
    """`from kvattn import x; x._helper` is the same reach by another road."""
    offenders = []
    for path in SOURCES:
        aliases = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("kvattn", "benchmarks")):
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(("kvattn", "benchmarks")):
                        aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not offenders, "\n".join(offenders)


# The floors, bottom up, read from the folders: each names top-level packages (folders) or modules of
# src/kvattn. Lower floors never import higher ones (see docs/design); every module of the package sits on
# exactly one floor, so a new folder must be placed here before anything can import it.
FLOORS = [
    # the leaves; `caches.base` (the cache specs, data) among them, so the config can hold one
    ("errors", "extra", "rotary", "config", "validation", "templates", "caches.base"),
    ("math",),
    ("kernels",),
    ("caches", "paging"),
    ("layer",),
    ("snapshots",),
    ("models",),
    ("generation",),
    ("serving",),
    ("cli", "demo"),
]


def floor(module: str) -> int | None:
    """The floor of `module` (a `kvattn` module), from the folder or top-level module it lives in."""
    parts = module.split(".")
    if parts[0] != "kvattn" or len(parts) < 2:
        return None
    for name in (".".join(parts[1:3]), parts[1]):  # a module placed on its own floor, else its folder's
        for level, names in enumerate(FLOORS):
            if name in names:
                return level
    return None


def test_every_folder_and_module_sits_on_one_floor():
    top = sorted(path.stem for path in (ROOT / "src" / "kvattn").iterdir()
                 if (path.is_dir() and (path / "__init__.py").exists())
                 or (path.suffix == ".py" and path.name != "__init__.py"))
    placed = [name for names in FLOORS for name in names if "." not in name]
    assert sorted(placed) == top, f"unplaced {sorted(set(top) - set(placed))}, gone {sorted(set(placed) - set(top))}"


def test_no_import_circle():
    """No two modules import each other, by any road (imports inside functions count)."""
    graph = {}
    for path in (ROOT / "src" / "kvattn").rglob("*.py"):
        own = module_name(path)
        reached = set()
        for module, names, _ in imports(path):
            for target in targets(module, names):
                if target in MODULES and target != own and not own.startswith(target + "."):
                    reached.add(target)
        graph[own] = reached
    done, stack, circles = set(), [], []

    def visit(node):
        if node in stack:
            circles.append(" -> ".join(stack[stack.index(node):] + [node]))
            return
        if node in done:
            return
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            visit(target)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not circles, "\n".join(circles)


MODULES = {module_name(path) for path in (ROOT / "src" / "kvattn").rglob("*.py")}


def targets(module: str, names) -> list[str]:
    """What an import reaches: `from kvattn.caches import paged` the submodule, `from kvattn.config import RoPE`
    the module."""
    return [f"{module}.{name}" if f"{module}.{name}" in MODULES else module for name in names] or [module]


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in (ROOT / "src" / "kvattn").rglob("*.py"):
        own = floor(module_name(path))
        if own is None:
            continue
        for module, names, line in imports(path):
            # `from kvattn.caches import paged` names the submodule it imports.
            for target in targets(module, names):
                level = floor(target)
                if level is not None and level > own:
                    upward.append(f"{path.relative_to(ROOT)}:{line} ({FLOORS[own][0]}...) imports {target}")
    assert not upward, "\n".join(upward)


# What the host half of paging may import from kvattn: the leaves (the cache specs among them), and itself.
PAGING_HOST_IMPORTS = ("kvattn.config", "kvattn.caches.base", "kvattn.errors", "kvattn.paging")


def within(module: str, names) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def test_the_host_half_of_paging_imports_no_device_code():
    """Paging decides which page holds what with NumPy alone: no JAX, no layer or device pool, no snapshot."""
    device = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / "src" / "kvattn" / "paging").rglob("*.py"))
        for module, names, line in imports(path)
        for target in targets(module, names)
        if within(target, ("jax", "jaxlib", "flax", "jaxtyping"))
        or (within(target, ("kvattn",)) and not within(target, PAGING_HOST_IMPORTS))
    ]
    assert not device, "\n".join(device)


def test_the_cache_types_never_import_the_host_half_of_paging():
    """The paged cache reads the fixed-shape tables the host hands out; it never loads the `PageManager`."""
    host = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / "src" / "kvattn" / "caches").rglob("*.py"))
        for module, names, line in imports(path)
        for target in targets(module, names)
        if within(target, ("kvattn.paging",))
    ]
    assert not host, "\n".join(host)


def test_test_modules_share_only_the_helpers_and_the_reference():
    """Tests mirror the source tree; a test module imports `tests.helpers` or `tests.reference`, never another."""
    crossing = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        for module, _, line in imports(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert not crossing, "\n".join(crossing)


def documented_names() -> tuple[set[str], set[str]]:
    """What the API reference documents: `(names, whole)`, read from its `::: target` lines.

    A target with a `members: [...]` option documents those members; one
    without documents itself and, if a module, all its public names (`whole`).
    """
    names, whole = set(), set()
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("::: "):
                continue
            target = line[4:].strip()
            at = next((j for j in range(i + 1, min(i + 4, len(lines))) if lines[j].strip().startswith("members:")), None)
            if at is None:
                names.add(target)
                whole.add(target)
            else:
                members = lines[at].split(":", 1)[1]
                while "]" not in members and at + 1 < len(lines):  # a list that goes on over more lines
                    at += 1
                    members += lines[at]
                names.update(f"{target}.{m.strip()}" for m in members.strip().strip("[]").split(",") if m.strip())
    return names, whole


def test_benchmarks_reach_kvattn_only_through_documented_names():
    """A benchmark imports (and reads attributes of) only what the API reference documents, its testing face
    included: the internals it times are named there, and a rename shows up in the reference too."""
    names, whole = documented_names()

    def allowed(full: str) -> bool:
        return (full == "kvattn" or full in names or any(n.startswith(full + ".") for n in names)
                or any(full.startswith(w + ".") for w in whole))

    def module_like(full: str) -> bool:  # a package or module whose attributes name further documented things
        return full == "kvattn" or any(n.startswith(full + ".") for n in names)

    offenders = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvattn":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if not allowed(full):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {full}")
                    elif module_like(full) and full not in whole:
                        modules[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "kvattn":
                        if not allowed(alias.name):
                            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
                        elif alias.asname:
                            modules[alias.asname] = alias.name
                        else:
                            modules["kvattn"] = "kvattn"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                full = f"{modules[node.value.id]}.{node.attr}"
                if not node.attr.startswith("__") and not allowed(full):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {full}")
    assert not offenders, "\n".join(offenders)
