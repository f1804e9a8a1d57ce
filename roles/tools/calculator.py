"""The calculator tool: arithmetic on integers and floats, read with ``ast`` and never ``eval``.

The expression is parsed as a Python expression and walked node by node; only numbers, ``+ - *
/ // % **``, unary ``-``/``+`` and parentheses are accepted, so a call can never reach a name,
an attribute, a call or an import. Integers stay exact (Python's big integers) up to
``MAX_INT_BITS``; a power whose result would be larger, an exponent past ``MAX_EXPONENT`` and an
expression longer than ``MAX_LENGTH`` are refused before any work is done.

A result is printed exactly: an integer as all its digits, a float as Python's shortest repr,
except that a float with an integer value (``8/2``) prints as that integer (``4``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

Number = int | float

MAX_LENGTH = 500
MAX_EXPONENT = 10_000
MAX_INT_BITS = 4_096  # about 1,230 decimal digits

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_HINTS: dict[type[ast.AST], str] = {
    ast.BitXor: "'^' is not a power here; write 2**3",
    ast.Name: "names are not allowed; write numbers only",
    ast.Call: "functions are not allowed; write + - * / // % ** and parentheses",
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the exact result.

    Supports + - * / // % ** (power), unary minus, parentheses, integers and decimals.

    Args:
        expression: the arithmetic to compute, for example "12*(3+4)" or "2**10 - 1".
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is {len(expression)} characters; at most {MAX_LENGTH}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot read {expression!r} as arithmetic: {exc.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own limit on nesting
        raise ValueError("the expression is nested too deeply") from None
    return format_number(_value(tree.body))


def format_number(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"{node.value!r} is not a number")
        return _checked(node.value)  # 1e999 is inf already, a long literal past the bound
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise ValueError("the result is too large for a decimal number") from None
    kind = type(node.op) if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node)
    hint = _HINTS.get(kind, "use numbers, + - * / // % ** and parentheses")
    raise ValueError(f"unsupported {kind.__name__} in the expression: {hint}")


def _check_power(base: Number, exponent: Number) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent} is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise ValueError(
                f"the result of {base}**{exponent} is too large (over 2**{MAX_INT_BITS})"
            )


def _checked(value: Number) -> Number:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the result is too large (over 2**{MAX_INT_BITS})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large for a decimal number")
    return value
