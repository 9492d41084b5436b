"""No script or module refers to a name it never defines or imports (the class of defect that
made ``bench/gpu_tune.py`` crash at the end of its default run, issue 12 §6): every name read
anywhere in a file must be a builtin, imported, assigned, a parameter, or defined in that file.
Coarse (scopes are not told apart), so it can miss a name defined in another function, but it
never needs the GPU or a long run to find a typo in a rarely reached branch."""

import ast
import builtins
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("src/redlite/**/*.py"), *ROOT.glob("tests/*.py")])


def undefined_names(source: str) -> list[tuple[str, int]]:
    tree = ast.parse(source)
    known = set(dir(builtins)) | {"__file__", "__name__", "__doc__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            known |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            known |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            known.add(node.id)
        elif isinstance(node, ast.arguments):
            known |= {a.arg for a in [*node.posonlyargs, *node.args, *node.kwonlyargs,
                                      *(x for x in (node.vararg, node.kwarg) if x)]}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            known.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            known.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            known |= set(node.names)
        elif isinstance(node, ast.MatchAs) and node.name:
            known.add(node.name)
    return sorted({(n.id, n.lineno) for n in ast.walk(tree)
                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in known})


def test_the_check_finds_an_undefined_name():
    assert undefined_names("import os\ndef f(x):\n    return os.path.join(x, y)\n") == [("y", 3)]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_undefined_names(path):
    assert undefined_names(path.read_text(encoding="utf-8")) == []
