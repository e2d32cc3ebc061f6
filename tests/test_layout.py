"""The package's wings and the one way their imports run (issue #21).

Bottom to top: ``model`` < ``run`` < ``data`` < ``decode`` < ``interop`` < ``serve`` < ``train`` <
``aot`` < ``cli``; a module may import its own wing and the wings below it, never one above, and
no chain of imports between modules comes back to where it started. Every import
counts: at module level, inside a function, or for type checking only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jaxformer

PACKAGE = Path(jaxformer.__file__).parent
WINGS = ("model", "run", "data", "decode", "interop", "serve", "train", "aot", "cli")
ENTRY = len(WINGS)   # jaxformer/__init__.py and the ``python -m`` shims sit above every wing


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The jaxformer modules ``path`` imports (``from jaxformer.x import y`` counts
    ``jaxformer.x.y`` when that is a module, else ``jaxformer.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxformer")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxformer"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


def _level(module: str) -> int:
    parts = module.split(".")
    if parts[-1] == "__main__":   # a wing's ``python -m`` shim (serve/__main__.py): an entry point
        return ENTRY
    return WINGS.index(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) \
        else ENTRY


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_is_in_a_wing_or_an_entry_point():
    loose = {m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in WINGS}
    assert loose == {"jaxformer.translate", "jaxformer.prepare", "jaxformer.convert",
                     "jaxformer.compile"}   # ``python -m`` shims
    assert {m.split(".")[1] for m in MODULES if m.count(".") >= 1} >= set(WINGS)


def test_wings_import_only_downwards():
    upward = []
    for module, path in MODULES.items():
        for imported in _imports(path):
            if imported != "jaxformer" and _level(imported) > _level(module):
                upward.append(f"{module} imports {imported}")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles_between_modules():
    graph = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    # A package's __init__ is imported with each of its modules; it imports none of them here.
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
                return True
            if nxt not in state and visit(nxt, path + [node]):
                return True
        state[node] = 2
        return False

    for module in sorted(graph):
        if module not in state and visit(module, []):
            break
    assert not cycle, " -> ".join(cycle)


def test_the_model_wing_imports_nothing_from_the_others():
    """Importing every model module (and ``jaxformer`` itself) loads no other wing, but
    for ``run.platform`` (standard library only), which ``import jaxformer`` asks to keep
    JAX off an absent TPU."""
    model_modules = sorted(m for m in MODULES if m.startswith("jaxformer.model"))
    code = ("import sys; import jaxformer; " + "; ".join(f"import {m}" for m in model_modules)
            + "; print(sorted(m for m in sys.modules if m.startswith('jaxformer.') and "
              "not m.startswith('jaxformer.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""}, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "['jaxformer.run', 'jaxformer.run.platform']", out.stdout
    assert _imports(PACKAGE / "run" / "platform.py") == set()


def test_public_names_and_entry_points_still_there():
    import tomllib

    import jaxformer as jf
    from jaxformer.cli import compile as compile_cli
    from jaxformer.cli import convert, prepare, serve, train, translate

    assert {"Transformer", "TransformerConfig", "preset", "create_padding_mask",
            "scaled_dot_product_attention", "check_token_ids"} <= set(jf.__all__)
    assert all(hasattr(jf, name) for name in jf.__all__)
    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    modules = {"jaxformer.cli.train": train, "jaxformer.cli.prepare": prepare,
               "jaxformer.cli.translate": translate, "jaxformer.cli.convert": convert,
               "jaxformer.cli.compile": compile_cli, "jaxformer.cli.serve": serve}
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(modules[module], function)), target
    import importlib.util

    # Every command but training (train.py) also runs as `python -m jaxformer.<name>`.
    for name in scripts:
        if name != "jaxformer-train":
            spec = importlib.util.find_spec(name.replace("-", "."))
            assert spec is not None, name
            if spec.submodule_search_locations:   # a package runs as its __main__
                assert importlib.util.find_spec(name.replace("-", ".") + ".__main__") is not None, name


def test_the_readme_python_examples_run():
    """The README's two Python blocks (the model as a library, decoding as a library) run
    as written, in order, in a fresh process: a renamed argument or an undefined name in
    them is a failure here, not a user's first traceback."""
    import re

    readme = (Path(jaxformer.__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2
    code = "\n".join(blocks) + "\nprint(ids.shape, seqs.shape, attention.shape)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "(1, 64) (1, 4, 64) (1, 4, 4, 6)"
