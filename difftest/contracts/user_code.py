"""A user's own callables (a `ModelAdapter`'s model factory, loss, prediction, plan, chain) in a standalone script.

A script must run without difftest, and a user's module imports difftest (it makes the adapter). So a callable
defined in a user's module is copied: its definition and, transitively, every top-level definition, constant and
import of that module it reads, as the module has them (its text, its comments); the statements that use difftest
(the adapter itself) and `if __name__ == "__main__":` blocks never are. A name the module imports from another module
of the user's own (`from mypkg.layers import Block`, `from .layers import Block`) is copied from that module the same
way, before what reads it: a model spread over a package's files fits in one script. A callable of an installed
library (`torch.nn.functional.mse_loss`) is imported from it. A lambda, a `functools.partial`, a method or a function
defined inside another has no top-level definition to copy: the model then has no standalone script, and the reason
says how to give one.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import re
import symtable
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftest.contracts.errors import Unsupported
from difftest.contracts.script import SourceText
from difftest.contracts.script_runtime import RUNTIME_FUNCTIONS
from difftest.contracts.syntax import parse, source_of, symbols

# the packages a user's module may import for its adapter, never copied into a script
_OURS = ("difftest", "generators", "settings")
# what every script imports before any line of a user's
ALREADY_IMPORTED = frozenset({"import torch", "import numpy as np"})
# modules `import torch` (or numpy's) makes reachable by attribute: `torch.nn.functional.mse_loss` needs no line
IMPORTED_WITH_TORCH = frozenset({"torch", "torch.nn", "torch.nn.functional", "numpy"})
# names every script binds at its top itself (the runtime's imports, its constants and functions, the model's and
# the settings' functions a script copies): a user's definition or import of one of them is refused, not shadowed
SCRIPT_NAMES = frozenset({
    "annotations", "contextlib", "logging", "os", "re", "socket", "sys", "tempfile", "traceback", "warnings",
    "metadata", "Path", "Any", "np", "torch", "LIBRARIES", "WORLD_SIZE", "RANK_IMPORTS", "TENSORS", "SPREAD", "K",
    "ATOL", "RTOL", "CASE", "FAILURE", "ADAPTER", "POSITIONAL", "Unsupported", "build_model", "model_loss",
    "model_parameters", "model_tp_plan", "model_chain", "prediction_loss", "_unwrap", "_batch_inputs",
    "single_process", "on_rank", "distribute", "stepping", "full_parameters", "to_numpy", "sgd_on_share",
    "backward_on_share", "parameters_after", *RUNTIME_FUNCTIONS})


@dataclass
class UserCode:
    """What a script needs for a user's callables: import lines (after the script's own), the definitions copied in
    the module's order, and, per role, the expression that names the callable in the script."""

    imports: list[str] = field(default_factory=list)
    definitions: list[SourceText] = field(default_factory=list)
    named: dict[str, str] = field(default_factory=dict)
    # (module, name) copied or being copied: a name two modules read is copied once, and modules that import from
    # each other end
    copied: set[tuple[str, str]] = field(default_factory=set)
    modules: dict[str, _Module] = field(default_factory=dict)  # the user's modules read so far, by name

    def module(self, module: Any, adapter: str) -> _Module:
        """The user's `module` read for copying, once."""
        if module.__name__ not in self.modules:
            self.modules[module.__name__] = _Module(module, adapter)
        return self.modules[module.__name__]

    def binding(self) -> SourceText:
        """`ADAPTER = {role: callable, …}`: how the copied functions reach the user's callables."""
        entries = ", ".join(f"{role!r}: {expression}" for role, expression in self.named.items())
        return SourceText("ADAPTER", f"# the adapter's callables, as the user's module defines them\n"
                                     f"ADAPTER = {{{entries}}}\n")


@functools.cache
def _library_roots() -> tuple[Path, ...]:
    """Where installed libraries lie: site-packages (the user's too) and the standard library, each as given and
    resolved (installs made of links)."""
    import site

    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple({p for root in roots for p in (Path(root), Path(root).resolve())})


def _installed(path: str) -> bool:
    """Whether a file lies where installed libraries do (by its path as given or resolved)."""
    given = Path(path).absolute()
    return any(part in ("site-packages", "dist-packages") for part in given.parts) or any(
        p.is_relative_to(root) for p in (given, given.resolve()) for root in _library_roots())


def _is_library(module: Any) -> bool:
    """Whether a module is an installed library's, which a script may import wherever the same packages are
    installed, rather than a user's own file; a module that imports difftest is the user's wherever it lies."""
    path = getattr(module, "__file__", None)
    if path is None:
        return True  # built in
    if not _installed(path):
        return False
    try:
        return not re.search(rf"^\s*(?:from|import)\s+(?:{'|'.join(_OURS)})\b", source_of(module), re.M)
    except (OSError, TypeError):
        return True


def _bound_names(node: ast.stmt) -> set[str]:
    """Every name a top-level statement binds, in its own scope: assigned, imported, defined, a loop's or a `with`'s
    target, in any branch of an `if` or `try` (not inside a function or class it defines)."""
    names: set[str] = set()
    pending: list[ast.AST] = [node]
    while pending:
        current = pending.pop()
        if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(current.name)
            pending.extend(current.decorator_list)
            continue  # its body is its own scope
        if isinstance(current, ast.Lambda):
            continue
        if isinstance(current, ast.Import | ast.ImportFrom):
            names.update(alias.asname or alias.name.split(".")[0] for alias in current.names)
        elif isinstance(current, ast.Name) and isinstance(current.ctx, ast.Store):
            names.add(current.id)
        pending.extend(ast.iter_child_nodes(current))
    return names


def _changed_names(node: ast.stmt) -> set[str]:
    """The names a top-level statement changes without binding them anew: `TABLE["b"] = 2`, `Net.scale = 2`,
    `X += 1`."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
        if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
    changed = set()
    for target in targets:
        if isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):
            changed.add(target.id)
        while isinstance(target, ast.Subscript | ast.Attribute):
            target = target.value
            if isinstance(target, ast.Name):
                changed.add(target.id)
    return changed


class _NoAnnotations(ast.NodeTransformer):
    """A statement less its annotations: the script has `from __future__ import annotations`, so they are never
    evaluated, and a name only they read (one imported under TYPE_CHECKING) is not needed."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        self.generic_visit(node)
        return node

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AsyncFunctionDef:
        node.returns = None
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return ast.Pass()
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)


def _reads(text: str) -> set[str]:
    """The module-level names a top-level statement reads when it runs (a function's locals and parameters are not,
    nor its annotations)."""
    found: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table.get_type() == "module" or symbol.is_global()):
                found.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    tree = ast.fix_missing_locations(_NoAnnotations().visit(parse(text)))
    walk(symbols(ast.unparse(tree)))
    return found


def _imports_ours(node: ast.AST) -> bool:
    """Whether a statement imports difftest (or its plugins' packages), at its top or anywhere inside it."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Import) and any(a.name.split(".")[0] in _OURS for a in inner.names):
            return True
        if isinstance(inner, ast.ImportFrom) and (inner.module or "").split(".")[0] in _OURS:
            return True
    return False


def _user_imports(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement takes from the user's own files (not an installed library's), which a script
    run elsewhere cannot import."""
    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    found = []
    for name in modules:
        spec = importlib.util.find_spec(name.split(".")[0]) if name else None
        origin = getattr(spec, "origin", None)
        if origin not in (None, "built-in", "frozen") and not _installed(origin):
            found.append(name)
    return found


class _Module:
    """A user's module read for copying: each top-level statement by the names it binds."""

    def __init__(self, module: Any, adapter: str) -> None:
        self.name, self.adapter = module.__name__, adapter
        try:
            source = source_of(module)
        except (OSError, TypeError) as exc:
            raise Unsupported(f"adapter {adapter!r}: the source of its module {module.__name__} cannot be read "
                              f"({exc}), so a script cannot copy its model") from None
        tree = parse(source)
        self.source, self.tree = source, tree
        ours = {name for node in tree.body if _imports_ours(node) for name in _bound_names(node)}
        self.copyable: dict[str, tuple[ast.stmt, str]] = {}
        self.refused: dict[str, str] = {}  # name → why a script cannot have it
        # name → (the user's module it is imported from, its name there)
        self.elsewhere: dict[str, tuple[str, str]] = {}
        self.star = False  # `from x import *`: a name the module does not bind may come from it
        lines = source.splitlines()
        bound_by: dict[str, int] = {}
        for node in tree.body:
            text = _text(lines, node)
            names = _bound_names(node)
            for name in names:
                bound_by[name] = bound_by.get(name, 0) + 1
            for name in _changed_names(node):
                self.refused.setdefault(name, "changed by a top-level statement after its definition, which a script "
                                              "does not copy")
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                self.star = True
                continue
            if _imports_ours(node) and isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if _imports_ours(node) or _reads(text) & ours:
                why = "a statement that uses difftest"
            elif isinstance(node, ast.ImportFrom) and (node.level or _user_imports(node)):
                self._from_users_module(node, module)
                continue
            elif isinstance(node, ast.Import) and (theirs := _user_imports(node)):
                why = (f"the module {theirs[0]} of the user's own, imported whole, which a script run elsewhere cannot "
                       f"import: import from it the names the model uses (`from {theirs[0]} import …`)")
            elif not isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef |
                                ast.ClassDef | ast.Assign | ast.AnnAssign):
                why = f"bound by a top-level {type(node).__name__.lower()} statement, which a script does not copy"
            else:
                for name in names:
                    self.copyable[name] = (node, text)
                continue
            for name in names:
                self.refused[name] = why
        for name, count in bound_by.items():
            if count > 1:
                self.refused.setdefault(name, "bound by more than one top-level statement")

    def _from_users_module(self, node: ast.ImportFrom, module: Any) -> None:
        """`from mypkg.layers import Block` (or `from .layers import Block`): each name to be copied from there."""
        try:
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__) \
                if node.level else node.module or ""
        except (ImportError, ValueError) as exc:  # a relative import in a module outside any package
            for alias in node.names:
                self.refused[alias.asname or alias.name] = f"imported relatively where there is no package ({exc})"
            return
        for alias in node.names:
            if alias.asname not in (None, alias.name):
                self.refused[alias.asname] = (f"{source}.{alias.name} imported under another name, which a script "
                                              "copying its definition cannot give it: import it by its own name")
            elif importlib.util.find_spec(f"{source}.{alias.name}") if _is_package(source) else False:
                self.refused[alias.name] = (f"the module {source}.{alias.name} of the user's own, imported whole, "
                                            f"which a script run elsewhere cannot import: import from it the names "
                                            f"the model uses (`from {source}.{alias.name} import …`)")
            else:
                self.elsewhere[alias.name] = (source, alias.name)

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
        the module's order; what it imports from another of the user's modules copied from there first)."""
        wanted: dict[int, tuple[ast.stmt, str]] = {}
        pending = [name]
        while pending:
            current = pending.pop()
            if (self.name, current) in code.copied:
                continue
            code.copied.add((self.name, current))
            if current in self.elsewhere:
                source, original = self.elsewhere[current]
                try:
                    imported = importlib.import_module(source)
                except Exception as exc:  # whatever the user's module raises, the reason says it
                    raise Unsupported(f"adapter {self.adapter!r}: {self.name}.{current} is imported from {source}, "
                                      f"which does not import here ({type(exc).__name__}: {exc})") from None
                code.module(imported, self.adapter).copy(original, code)
                continue
            if current in self.refused:
                raise Unsupported(f"adapter {self.adapter!r}: {self.name}.{current}, which its model code reads, is "
                                  f"{self.refused[current]}")
            if current not in self.copyable:
                if hasattr(builtins, current):
                    continue
                where = "a star import" if self.star else "nothing at its top level"
                raise Unsupported(f"adapter {self.adapter!r}: {self.name}.{current}, which its model code reads, is "
                                  f"bound by {where}, which a script does not copy")
            node, text = self.copyable[current]
            if clash := _clash(node):
                raise Unsupported(f"adapter {self.adapter!r}: {self.name}.{clash} has the name of a definition "
                                  "every standalone script has: rename it")
            wanted[id(node)] = (node, text)
            pending.extend(_reads(text))
        for node, text in sorted(wanted.values(), key=lambda pair: pair[0].lineno):
            if isinstance(node, ast.Import | ast.ImportFrom):
                if text.strip() not in ALREADY_IMPORTED and text.rstrip("\n") not in code.imports:
                    code.imports.append(text.rstrip("\n"))
            elif all(d.text != text for d in code.definitions):
                names = sorted(_bound_names(node))
                code.definitions.append(SourceText(names[0], text, also=tuple(names[1:])))


# what the names every script imports at its top are: a user's import binding one of them to the same object is
# harmless
RUNTIME_BINDINGS = {"contextlib": "contextlib", "logging": "logging", "os": "os", "re": "re", "socket": "socket",
                    "sys": "sys", "tempfile": "tempfile", "traceback": "traceback", "warnings": "warnings",
                    "metadata": "importlib.metadata", "Path": "pathlib.Path", "Any": "typing.Any", "np": "numpy",
                    "torch": "torch"}


def _clash(node: ast.stmt) -> str | None:
    """A name the statement binds that a script binds otherwise (an import of the same object is no clash)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            target = alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
            if isinstance(node, ast.Import) and not alias.asname:
                target = bound
            if bound in SCRIPT_NAMES and RUNTIME_BINDINGS.get(bound) != target:
                return bound
        return None
    return next(iter(sorted(_bound_names(node) & SCRIPT_NAMES)), None)


def _text(lines: list[str], node: ast.stmt) -> str:
    """A top-level statement's lines, its decorators and the comment lines right above it included."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return "\n".join(lines[start:node.end_lineno or node.lineno]) + "\n"


def _is_package(name: str) -> bool:
    """Whether the module `name` is a package (its names may be modules)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.submodule_search_locations is not None


def user_code(adapter: str, callables: dict[str, Callable[..., Any] | None]) -> UserCode:
    """Everything a script needs to call the adapter's `callables` (role → callable; None: the adapter has none) by
    `ADAPTER[role]`; raises `Unsupported` with the reason where one cannot be copied or imported."""
    code = UserCode()
    for role, value in callables.items():
        if value is None:
            continue
        qualname = getattr(value, "__qualname__", None)
        module = inspect.getmodule(value)
        if qualname == "<lambda>" and module is not None and not _is_library(module):
            users = code.module(module, adapter)
            text = users.lambda_text(value, role)
            for name in _reads(f"_ = {text}"):
                users.copy(name, code)
            code.named[role] = text
            continue
        if not (inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)) or module is None \
                or qualname is None or "." in qualname or "<" in qualname:
            what = "a lambda" if qualname == "<lambda>" else "a function defined inside another" \
                if qualname and "<locals>" in qualname else f"a {type(value).__name__}"
            raise Unsupported(f"adapter {adapter!r}: its {role} is {what}; a standalone script copies or imports a "
                              f"function or class defined at a module's top level: define it with def")
        if _is_library(module):
            if getattr(importlib.import_module(module.__name__), qualname, None) is not value:
                raise Unsupported(f"adapter {adapter!r}: its {role}, {module.__name__}.{qualname}, cannot be imported "
                                  "by that name")
            line = f"import {module.__name__}"
            if module.__name__.split(".")[0] in SCRIPT_NAMES - {"torch"}:
                raise Unsupported(f"adapter {adapter!r}: its {role}'s module {module.__name__} has the name of a "
                                  "definition every standalone script has")
            if line not in code.imports and module.__name__ not in IMPORTED_WITH_TORCH:
                code.imports.append(line)
            code.named[role] = f"{module.__name__}.{qualname}"
            continue
        code.module(module, adapter).copy(qualname, code)
        code.named[role] = qualname
    names = [d.__name__ for d in code.definitions]
    if len(set(names)) < len(names):
        raise Unsupported(f"adapter {adapter!r}: its callables come from modules that define the same names "
                          f"({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    return code
