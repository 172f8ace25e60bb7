"""The package's layering, read from the source: the device layer (tandem/device) never imports the layers
above it (engine, LLM API, scheduler, server), its modules import each other without a circle, and no file of
the package grows past ~400 lines (DEVELOPERS' rule; imports inside functions count too)."""
from __future__ import annotations

import ast
import os

import tandem

PKG = os.path.dirname(tandem.__file__)
ABOVE_DEVICE = ("tandem.engine", "tandem.llm", "tandem.scheduler", "tandem.server", "tandem.bench")
MAX_LINES = 420


def imports(path: str, module: str) -> set[str]:
    """Every tandem module that `module`'s source imports, at the top or inside a function."""
    out: set[str] = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tandem")}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            if name.startswith("tandem"):
                out.add(name)
                out |= {f"{name}.{a.name}" for a in node.names}          # `from . import step`
    return out


def device_modules() -> dict[str, set[str]]:
    folder = os.path.join(PKG, "device")
    return {f"tandem.device.{f[:-3]}": imports(os.path.join(folder, f), f"tandem.device.{f[:-3]}")
            for f in os.listdir(folder) if f.endswith(".py")}


def test_the_device_layer_never_imports_the_engine_or_above():
    bad = {m: sorted(i for i in imps if i.startswith(ABOVE_DEVICE)) for m, imps in device_modules().items()}
    assert {m: i for m, i in bad.items() if i} == {}


def test_device_modules_import_each_other_without_a_circle():
    mods = device_modules()
    graph = {m: {i for i in imps if i in mods and i != m} for m, imps in mods.items()}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path, m))
        if m not in done:
            for n in graph[m]:
                visit(n, (*path, m))
            done.add(m)

    for m in graph:
        visit(m, ())


def test_every_file_stays_under_the_size_rule():
    long = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                n = sum(1 for _ in open(path))
                if n > MAX_LINES:
                    long[os.path.relpath(path, PKG)] = n
    assert long == {}
