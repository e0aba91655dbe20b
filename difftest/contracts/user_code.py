"""A user's own callables (a `ModelAdapter`'s model factory, loss, prediction, plan, chain) in a standalone script.

A script must run without difftest, and a user's module imports difftest (it makes the adapter). So a callable
defined in a user's module is copied: its definition and, transitively, every top-level definition, constant and
import of that module it reads, as the module has them (its text, its comments); the statements that use difftest
(the adapter itself) and `if __name__ == "__main__":` blocks never are. A callable of an installed library
(`torch.nn.functional.mse_loss`) is imported from it. A lambda, a `functools.partial`, a method or a function defined
inside another has no top-level definition to copy: the model then has no standalone script, and the reason says
how to give one.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import symtable
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftest.contracts.errors import Unsupported
from difftest.contracts.script import SourceText

# the packages a user's module may import for its adapter, never copied into a script
_OURS = ("difftest", "generators", "settings")
# what every script imports before any line of a user's
ALREADY_IMPORTED = frozenset({"import torch", "import numpy as np"})
# modules `import torch` (or numpy's) makes reachable by attribute: `torch.nn.functional.mse_loss` needs no line
IMPORTED_WITH_TORCH = frozenset({"torch", "torch.nn", "torch.nn.functional", "numpy"})
# names every script defines itself (its constants, the runtime's and the model's functions): a user's definition
# of one of them is refused rather than shadowing it
RESERVED = frozenset({"LIBRARIES", "WORLD_SIZE", "RANK_IMPORTS", "TENSORS", "SPREAD", "K", "ATOL", "RTOL", "CASE",
                      "FAILURE", "ADAPTER", "POSITIONAL", "Unsupported", "np", "torch", "build_model", "model_loss",
                      "model_parameters", "model_tp_plan", "model_chain", "prediction_loss", "_unwrap",
                      "_batch_inputs", "single_process", "on_rank", "main", "main_failing", "main_twice"})


@dataclass
class UserCode:
    """What a script needs for a user's callables: import lines (after the script's own), the definitions copied in
    the module's order, and, per role, the expression that names the callable in the script."""

    imports: list[str] = field(default_factory=list)
    definitions: list[SourceText] = field(default_factory=list)
    named: dict[str, str] = field(default_factory=dict)

    def binding(self) -> SourceText:
        """`ADAPTER = {role: callable, …}`: how the copied functions reach the user's callables."""
        entries = ", ".join(f"{role!r}: {expression}" for role, expression in self.named.items())
        return SourceText("ADAPTER", f"# the adapter's callables, as the user's module defines them\n"
                                     f"ADAPTER = {{{entries}}}\n")


def _is_library(path: str | None) -> bool:
    """Whether a module's file is an installed library's (site-packages, the standard library), which a script may
    import wherever the same packages are installed, rather than a user's own file."""
    if path is None:
        return True  # built in
    resolved = Path(path).resolve()
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return any(resolved.is_relative_to(Path(root).resolve()) for root in roots)


def _statement_names(node: ast.stmt) -> list[str]:
    """The names a top-level statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [alias.asname or alias.name.split(".")[0] for alias in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
        if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _reads(text: str) -> set[str]:
    """The module-level names a top-level statement reads (a function's locals and parameters are not)."""
    found: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table.get_type() == "module" or symbol.is_global()):
                found.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(text, "<user>", "exec"))
    return found


def _imports_ours(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in _OURS for alias in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _OURS


class _Module:
    """A user's module read for copying: each top-level statement by the names it binds."""

    def __init__(self, module: Any, adapter: str) -> None:
        self.name, self.adapter = module.__name__, adapter
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError) as exc:
            raise Unsupported(f"adapter {adapter!r}: the source of its module {module.__name__} cannot be read "
                              f"({exc}), so a script cannot copy its model") from None
        tree = ast.parse(source)
        self.source, self.tree = source, tree
        ours = {name for node in tree.body if _imports_ours(node) for name in _statement_names(node)}
        self.copyable: dict[str, tuple[ast.stmt, str]] = {}
        self.refused: dict[str, str] = {}  # name → why a script cannot have it
        lines = source.splitlines()
        for node in tree.body:
            text = _text(lines, node)
            names = _statement_names(node)
            if _imports_ours(node) or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                why = "a relative import, which a script outside the package cannot make"
            elif _reads(text) & ours:
                why = "a statement that uses difftest"
            elif not isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef |
                                ast.ClassDef | ast.Assign | ast.AnnAssign):
                why = f"bound by a top-level {type(node).__name__.lower()} statement, which a script does not copy"
            else:
                for name in names:
                    self.copyable[name] = (node, text)
                continue
            for name in names:
                self.refused[name] = why

    def lambda_text(self, value: Any, role: str) -> str:
        """The source of a lambda of this module (`prediction=lambda output: output.logits`), found by the line its
        code starts on and its parameters; refused where it reads a variable of an enclosing function."""
        code = value.__code__
        if code.co_freevars:
            raise Unsupported(f"adapter {self.adapter!r}: its {role} is a lambda that reads {code.co_freevars[0]!r} of "
                              "an enclosing function; a standalone script copies top-level code: define it with def")
        parameters = list(code.co_varnames[:code.co_argcount])
        texts = {ast.get_source_segment(self.source, node) for node in ast.walk(self.tree)
                 if isinstance(node, ast.Lambda) and node.lineno == code.co_firstlineno
                 and [a.arg for a in node.args.args] == parameters}
        if len(texts) != 1 or None in texts:
            raise Unsupported(f"adapter {self.adapter!r}: its {role} is a lambda that cannot be told apart in "
                              f"{self.name}'s source (line {code.co_firstlineno}): define it with def")
        return f"({texts.pop()})"

    def copy(self, name: str, code: UserCode) -> None:
        """`name` and every top-level name its definition reads, transitively, into `code` (each statement once, in
        the module's order)."""
        wanted: dict[int, tuple[ast.stmt, str]] = {}
        pending, seen = [name], set()
        while pending:
            current = pending.pop()
            if current in seen:
                continue
            seen.add(current)
            if current in self.refused:
                raise Unsupported(f"adapter {self.adapter!r}: {self.name}.{current}, which its model code reads, is "
                                  f"{self.refused[current]}")
            if current not in self.copyable:
                continue  # a builtin, or a name the function binds itself
            node, text = self.copyable[current]
            if current in RESERVED and not isinstance(node, ast.Import | ast.ImportFrom):
                raise Unsupported(f"adapter {self.adapter!r}: {self.name}.{current} has the name of a definition "
                                  "every standalone script has: rename it")
            wanted[id(node)] = (node, text)
            pending.extend(_reads(text))
        for node, text in sorted(wanted.values(), key=lambda pair: pair[0].lineno):
            if isinstance(node, ast.Import | ast.ImportFrom):
                if text.strip() not in ALREADY_IMPORTED and text.rstrip("\n") not in code.imports:
                    code.imports.append(text.rstrip("\n"))
            elif all(d.text != text for d in code.definitions):
                code.definitions.append(SourceText(_statement_names(node)[0], text))


def _text(lines: list[str], node: ast.stmt) -> str:
    """A top-level statement's lines, its decorators and the comment lines right above it included."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return "\n".join(lines[start:node.end_lineno or node.lineno]) + "\n"


def user_code(adapter: str, callables: dict[str, Callable[..., Any] | None]) -> UserCode:
    """Everything a script needs to call the adapter's `callables` (role → callable; None: the adapter has none) by
    `ADAPTER[role]`; raises `Unsupported` with the reason where one cannot be copied or imported."""
    code = UserCode()
    modules: dict[str, _Module] = {}
    for role, value in callables.items():
        if value is None:
            continue
        qualname = getattr(value, "__qualname__", None)
        module = inspect.getmodule(value)
        if qualname == "<lambda>" and module is not None and not _is_library(getattr(module, "__file__", None)):
            if module.__name__ not in modules:
                modules[module.__name__] = _Module(module, adapter)
            text = modules[module.__name__].lambda_text(value, role)
            for name in _reads(f"_ = {text}"):
                modules[module.__name__].copy(name, code)
            code.named[role] = text
            continue
        if not (inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)) or module is None \
                or qualname is None or "." in qualname or "<" in qualname:
            what = "a lambda" if qualname == "<lambda>" else "a function defined inside another" \
                if qualname and "<locals>" in qualname else f"a {type(value).__name__}"
            raise Unsupported(f"adapter {adapter!r}: its {role} is {what}; a standalone script copies or imports a "
                              f"function or class defined at a module's top level: define it with def")
        if _is_library(getattr(module, "__file__", None)):
            if getattr(importlib.import_module(module.__name__), qualname, None) is not value:
                raise Unsupported(f"adapter {adapter!r}: its {role}, {module.__name__}.{qualname}, cannot be imported "
                                  "by that name")
            line = f"import {module.__name__}"
            if module.__name__.split(".")[0] in RESERVED - {"torch", "np"}:
                raise Unsupported(f"adapter {adapter!r}: its {role}'s module {module.__name__} has the name of a "
                                  "definition every standalone script has")
            if line not in code.imports and module.__name__ not in IMPORTED_WITH_TORCH:
                code.imports.append(line)
            code.named[role] = f"{module.__name__}.{qualname}"
            continue
        if module.__name__ not in modules:
            modules[module.__name__] = _Module(module, adapter)
        modules[module.__name__].copy(qualname, code)
        code.named[role] = qualname
    names = [d.__name__ for d in code.definitions]
    if len(set(names)) < len(names):
        raise Unsupported(f"adapter {adapter!r}: its callables come from modules that define the same names "
                          f"({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    return code
