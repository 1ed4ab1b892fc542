"""Whether renaming a transformers attention module's ``config._attn_implementation`` changes only the function it
calls: what ``core_attn`` needs to swap in recompute's own (``recompute.checkpointing``).

transformers 5 attention modules look their function up in ``ALL_ATTENTION_FUNCTIONS`` by that name, so a name
registered by recompute reaches the module's attention call and nothing else. Some classes test the name
themselves: Falcon runs ``F.scaled_dot_product_attention`` when it is ``"sdpa"`` and its own eager code otherwise
(it never calls the interface), DeepSeek-V3.2 builds its sparse mask only for ``"eager"`` and ``"sdpa"``, GPT-2
reorders and upcasts its eager attention when the name is ``"eager"`` and a flag is set. Under another name those
run something else: a model that computes differently, silently.

``swap_changes`` reads the class's own methods (``ast``): the class must look its function up in the interface,
and every test of the name (a comparison with string constants, ``is_flash_attention_requested``) must decide
its ``if`` the same way under the model's name and under recompute's. Tests are evaluated with the module's own
flags (``self.reorder_and_upcast_attn``) and the names assigned from them; a test that depends on anything else
(an argument) counts as changed. Helpers outside the class are not read.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["swap_changes"]

_UNKNOWN = object()
_INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")
_REQUESTED = "is_flash_attention_requested"


def swap_changes(module: nn.Module, impl: str | None, ours: str) -> str | None:
    """None if setting ``module``'s ``_attn_implementation`` from ``impl`` to ``ours`` (a function registered in
    transformers' ``AttentionInterface``) changes only the attention function it calls; else why not, in words."""
    functions = _methods(type(module))
    if not functions:
        return "its source cannot be read to check how it dispatches its attention"
    if not any(_names_interface(f) for f in functions):
        return (
            "it does not look its attention function up in transformers' AttentionInterface (it runs its own "
            "attention code), so recompute's attention function would never run"
        )
    for fn in functions:
        why = _changed_test(fn, module, impl, ours)
        if why is not None:
            return (
                f"it tests its attention implementation itself ({why}), so recompute's attention function, "
                "registered under another name, would change what it computes"
            )
    return None


def _methods(cls: Any) -> tuple[ast.FunctionDef, ...]:
    """The methods the class and its bases define, but for torch's own (parsed once per class)."""
    if cls not in _PARSED:
        _PARSED[cls] = _parse(cls)
    return _PARSED[cls]


_PARSED: dict[Any, tuple[ast.FunctionDef, ...]] = {}


def _parse(cls: type) -> tuple[ast.FunctionDef, ...]:
    out: list[ast.FunctionDef] = []
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        out += [node for node in body if isinstance(node, ast.FunctionDef)]
    return tuple(out)


def _names_interface(fn: ast.FunctionDef) -> bool:
    return any(isinstance(node, ast.Name) and node.id in _INTERFACE for node in ast.walk(fn))


def _is_test(node: ast.AST) -> bool:
    """A comparison of ``..._attn_implementation`` or a call of ``is_flash_attention_requested``."""
    if isinstance(node, ast.Compare):
        return any(isinstance(n, ast.Attribute) and n.attr == "_attn_implementation" for n in ast.walk(node))
    return isinstance(node, ast.Call) and _REQUESTED in ast.unparse(node.func)


def _changed_test(fn: ast.FunctionDef, module: nn.Module, impl: str | None, ours: str) -> str | None:
    """The first test of the name in ``fn`` that decides differently under ``impl`` and ``ours``, as source."""
    parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    assigned: dict[str, ast.expr] = {}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        if any(_is_test(n) for n in ast.walk(node.value)):
            assigned[node.targets[0].id] = node.value
    for node in ast.walk(fn):
        named = isinstance(node, ast.Name) and node.id in assigned and isinstance(node.ctx, ast.Load)
        if not (_is_test(node) or named):
            continue
        alone = [_eval(node, module, name, assigned) for name in (impl, ours)]
        if _UNKNOWN not in alone and alone[0] == alone[1]:
            continue  # the test itself decides the same under both names
        decision = _decision(node, parents)
        if decision is None or any(isinstance(p, ast.Assign) for p in _ancestors(node, parents, decision)):
            continue  # an assignment of a test: judged where the name is read
        values = [_eval(decision, module, name, assigned) for name in (impl, ours)]
        if _UNKNOWN in values or values[0] != values[1]:
            return f"`{ast.unparse(decision)}`"
    return None


def _decision(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.expr | None:
    """The whole condition of the ``if``, ``while``, conditional expression or assertion that ``node`` is in, or
    the outermost expression holding it (an argument, a returned value: judged as is)."""
    expr: ast.AST = node
    while expr in parents:
        parent = parents[expr]
        if isinstance(parent, (ast.If, ast.While, ast.IfExp, ast.Assert)) and parent.test is expr:
            return parent.test
        if not isinstance(parent, ast.expr):
            return expr if isinstance(expr, ast.expr) else None
        expr = parent
    return None


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST], top: ast.AST) -> Iterator[ast.AST]:
    """The nodes above ``top`` up to the statement holding it."""
    while top in parents and not isinstance(top, ast.stmt):
        top = parents[top]
        yield top


def _eval(node: ast.AST, module: nn.Module, impl: str | None, assigned: dict[str, ast.expr]) -> Any:
    """The value of a condition under ``impl``, with the module's own flags; ``_UNKNOWN`` where it depends on
    anything else."""

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            items = [ev(e) for e in n.elts]
            return _UNKNOWN if _UNKNOWN in items else tuple(items)
        if isinstance(n, ast.Attribute) and n.attr == "_attn_implementation":
            return impl
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            value = getattr(module, n.attr, _UNKNOWN)
            return value if value is None or isinstance(value, (bool, int, float, str)) else _UNKNOWN
        if isinstance(n, ast.Name) and n.id in assigned:
            return ev(assigned[n.id])
        if isinstance(n, ast.Call) and _REQUESTED in ast.unparse(n.func):
            return impl is not None and "flash" in impl
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            value = ev(n.operand)
            return _UNKNOWN if value is _UNKNOWN else not value
        if isinstance(n, ast.BoolOp):
            return _bool_op(isinstance(n.op, ast.And), [ev(v) for v in n.values])
        if isinstance(n, ast.Compare) and len(n.ops) == 1:
            return _compare(n.ops[0], ev(n.left), ev(n.comparators[0]))
        return _UNKNOWN

    return ev(node)


def _bool_op(conjunction: bool, values: list[Any]) -> Any:
    """``and``/``or`` over values some of which may be unknown (three-valued: False and ? is False)."""
    decisive = not conjunction  # a False decides an ``and``, a True an ``or``
    if any(v is not _UNKNOWN and bool(v) is decisive for v in values):
        return decisive
    return _UNKNOWN if _UNKNOWN in values else not decisive


def _compare(op: ast.cmpop, left: Any, right: Any) -> Any:
    if left is _UNKNOWN or right is _UNKNOWN:
        return _UNKNOWN
    ops = {ast.Eq: lambda: left == right, ast.NotEq: lambda: left != right, ast.Is: lambda: left is right}
    ops.update({ast.IsNot: lambda: left is not right, ast.In: lambda: left in right})
    ops[ast.NotIn] = lambda: left not in right
    try:
        return ops[type(op)]() if type(op) in ops else _UNKNOWN
    except TypeError:
        return _UNKNOWN
