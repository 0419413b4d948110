"""Reading a module's forward from its source: what the fusions check before replacing layers
(transformers writes its modules' forward passes as plain Python)."""

from __future__ import annotations

import ast
import inspect
import textwrap


def forward_def(cls: type) -> ast.FunctionDef | None:
    """The definition of ``cls.forward`` as an AST, None where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    return fn if isinstance(fn, ast.FunctionDef) else None


def statements(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The statements of a function, its docstring left out."""
    return [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]


def self_call(node: ast.AST) -> tuple[str, list[ast.AST]] | None:
    """(child, arguments, keyword values included) of a call ``self.<child>(...)``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"):
        return node.func.attr, [*node.args, *(k.value for k in node.keywords)]
    return None
