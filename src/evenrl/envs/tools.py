"""The built-in tools: `calculator` (arithmetic read with ast and walked over exact fractions: nothing is evaluated
as Python) and `python` (code run in a sandbox: evenrl.isolation.code)."""

from __future__ import annotations

import ast
from fractions import Fraction

from evenrl.isolation.code import run_code

MAX_EXPRESSION_CHARS = 200
MAX_POWER = 64  # largest exponent of **; bigger ones are refused (2 ** 10 ** 9 would take the worker's memory)
MAX_DIGITS = 1000  # results with more digits are refused

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 2"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _walk(tree.body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return f"error: not an arithmetic expression: {expression!r}"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError as e:
        return f"error: {e}"
    return _show(value)


def _walk(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, power = _walk(node.left), _walk(node.right)
        if power.denominator != 1 or abs(power) > MAX_POWER:
            raise OverflowError(f"exponent {power} outside whole numbers -{MAX_POWER}..{MAX_POWER}")
        return base ** int(power)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_walk(node.left), _walk(node.right))
        if abs(value.numerator) > 10 ** MAX_DIGITS:
            raise OverflowError(f"result longer than {MAX_DIGITS} digits")
        return value
    raise ValueError(type(node).__name__)


def _show(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout and stderr); in a sandbox without network or the trainer's
    files, 2 s of CPU (10 s of wall time), 256 MiB of memory, 32 processes, 16 KiB of output.

    Args:
        code: a Python program; print the results you need
    """
    result = run_code(code)
    note = {"ok": "", "error": "", "blocked": "", "timeout": "[killed: took too long]",
            "cpu": "[killed: used its CPU time]", "memory": "", "output": "[output cut: too long]", "refused": ""}[result.status]
    return result.output + note if result.output or note else "(no output)"
