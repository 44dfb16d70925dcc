"""A safe arithmetic evaluator: the calculator tool of the calc agent.

Expressions are parsed with `ast` and only numbers, + - * / // % **, unary signs and parentheses
are evaluated; anything else (names, calls, attributes) is refused. Sizes are bounded so that a
model cannot make the tool hang or eat memory (`9**9**9`): the text length, the nesting depth,
exponents and the magnitude of every intermediate value. Every value is real: a power that
would be complex (`(-8)**0.5`) is refused, and any arithmetic error is a CalculatorError, so the
tool fails cleanly (with its span) and never raises past its caller.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator accepts; the message says why."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}

# What people and models write for the same operators; `^` means power in arithmetic, not xor.
_SPELLINGS = (("×", "*"), ("·", "*"), ("÷", "/"), ("−", "-"), ("^", "**"))
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def _normalise(expression: str) -> str:
    text = expression.strip().rstrip("=").strip()
    for written, meant in _SPELLINGS:
        text = text.replace(written, meant)
    return _THOUSANDS.sub("", text)


def _check(value: float | int | complex) -> float | int:
    if isinstance(value, complex):  # Python's power of a negative base to a fraction
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("a value is too large")
    return value


def _eval(node: ast.AST, depth: int) -> float | int:
    if depth > MAX_DEPTH:
        raise CalculatorError("the expression is nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents above {MAX_EXPONENT} are not allowed")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("a value is too large") from None
        except (ArithmeticError, TypeError, ValueError) as exc:
            # Whatever else arithmetic raises is the expression's fault, not the tool's.
            raise CalculatorError(f"cannot calculate this: {exc}") from None
        return _check(value)
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {_what(node)}")


def _what(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    return f"a {type(node).__name__} expression"


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _is_number(node.operand)
    return isinstance(node, ast.Constant)


def evaluate(expression: str, require_operation: bool = False) -> float | int:
    """The value of an arithmetic expression; raises CalculatorError for anything else.

    With `require_operation`, a lone number is refused too: "calculating" 27 gives 27 back,
    which is no calculation (and a model rewarded for tool calls that succeed would learn to
    make such calls instead of real ones).
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(_normalise(expression), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    if require_operation and _is_number(tree.body):
        raise CalculatorError("nothing to calculate: give the whole expression, e.g. 3 * (4 + 5)")
    return _eval(tree.body, 0)


def format_number(value: float | int) -> str:
    """A result as a person writes it: 14, not 14.0; at most 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}".rstrip("0").rstrip(".")
