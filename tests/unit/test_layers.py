"""Layers call downward only (docs/structure.md): no module imports a package ranked above its
own, lazily inside a function or not."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "outpace"

# Lower rank = lower layer. Core modules (config, types, errors, tokenizer) and heads/ hold no
# layer logic and may be imported from anywhere.
RANK = {"kernels": 0, "attention": 1, "models": 2, "kvcache": 2, "sample": 2, "speculative": 3,
        "scheduler": 4, "runner": 4, "engine": 5, "entrypoints": 6, "training": 6,
        "bench": 6}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def upward_imports(root: Path = PKG) -> list:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if len(rel) < 2 or rel[0] not in RANK:
            continue
        own = RANK[rel[0]]
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[0] != "outpace" or len(parts) < 2 or parts[1] not in RANK:
                continue
            if RANK[parts[1]] > own:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_the_check_finds_an_upward_import(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.py").write_text("def f():\n    from outpace.runner import x\n")
    assert upward_imports(tmp_path) == ["kernels/k.py:2 imports outpace.runner"]
