"""Python source parsed into its syntax tree one parse at a time in this process.

A run writes, checks and reduces its findings' scripts in threads. CPython 3.11 keeps the recursion depth of its
conversion of a parse into `ast` objects in state its threads share, so two parses at once could fail with
"SystemError: AST constructor recursion depth mismatch" (python/cpython#106905; a default job died of it once). The
standard library parses too: `inspect.getsource` of a class parses its whole module.
"""

from __future__ import annotations

import ast
import inspect
import symtable
import threading
from typing import Any

_ONE_AT_A_TIME = threading.Lock()


def parse(source: str) -> ast.Module:
    with _ONE_AT_A_TIME:
        return ast.parse(source)


def literal(source: str) -> Any:
    """`ast.literal_eval` of Python source text, which parses it: one parse at a time, as `parse`."""
    with _ONE_AT_A_TIME:
        return ast.literal_eval(source)


def source_of(code: Any) -> str:
    """`inspect.getsource` of a function or class, which parses the class's module to find it: one parse at a time."""
    with _ONE_AT_A_TIME:
        return inspect.getsource(code)


def symbols(source: str) -> symtable.SymbolTable:
    """`symtable.symtable` of Python source text, which compiles it: one parse at a time, as `parse`."""
    with _ONE_AT_A_TIME:
        return symtable.symtable(source, "<source>", "exec")
