"""The shape of the house, checked: no module reaches into another's private names, and layers import downward.

Read from the source with `ast`, so a violation fails here before it spreads.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "kvattn").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))


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


# Lower layers never import higher ones (see docs/design): the pure math, then the cache types,
# then the step, the layer, the drivers, the models, generation, serving, and the CLI on top.
FLOORS = [
    ("kvattn.errors", "kvattn.extra", "kvattn.config", "kvattn.rope", "kvattn.ops", "kvattn.norms", "kvattn.kernels",
     "kvattn.quant", "kvattn.native"),
    ("kvattn.validation",),
    ("kvattn.cache", "kvattn.paging"),
    ("kvattn.forward",),
    ("kvattn.attention",),
    ("kvattn.decoding", "kvattn.sharding", "kvattn.snapshots"),
    ("kvattn.models",),
    ("kvattn.generation",),
    ("kvattn.serving",),
    ("kvattn.demo", "kvattn.cli"),
]


def floor(module: str) -> int | None:
    """The floor of the longest name in FLOORS that is `module` or a package holding it."""
    matches = [(len(name), level) for level, names in enumerate(FLOORS) for name in names
               if module == name or module.startswith(name + ".")]
    return max(matches)[1] if matches else None


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in (ROOT / "src" / "kvattn").rglob("*.py"):
        own = floor(module_name(path))
        if own is None:
            continue
        for module, names, line in imports(path):
            # `from kvattn import paged` names the submodule it imports.
            for target in [f"{module}.{name}" for name in names] if module == "kvattn" else [module]:
                level = floor(target)
                if level is not None and level > own:
                    upward.append(f"{path.relative_to(ROOT)}:{line} ({FLOORS[own][0]}...) imports {target}")
    assert not upward, "\n".join(upward)


# The paged cache's device half: it lives in paging until the cache types have their own package (docs/design).
PAGING_DEVICE_HALF = "kvattn.paging.device"
# What the host half of paging may import from kvattn: the leaves, and itself.
PAGING_HOST_IMPORTS = ("kvattn.config", "kvattn.errors", "kvattn.paging")


def within(module: str, names) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def test_the_host_half_of_paging_imports_no_device_code():
    """Paging decides which page holds what with NumPy alone: no JAX, no layer or device pool, no snapshot."""
    device = []
    for path in sorted((ROOT / "src" / "kvattn" / "paging").rglob("*.py")):
        if module_name(path) == PAGING_DEVICE_HALF:
            continue
        for module, names, line in imports(path):
            # `from kvattn.paging import device` names the submodule it imports.
            for target in [f"{module}.{name}" for name in names] if module in ("kvattn", "kvattn.paging") else [module]:
                if (within(target, ("jax", "jaxlib", "flax", "jaxtyping", PAGING_DEVICE_HALF))
                        or (within(target, ("kvattn",)) and not within(target, PAGING_HOST_IMPORTS))):
                    device.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not device, "\n".join(device)
