"""A finding's standalone script reduced to what its case runs, while it still shows the same bug.

An emitter copies whole library-calling functions (never a second implementation), so a script carries every branch
those functions have for other models, plans and schedules. The script is run once with a line tracer (its ranks
included: they are forks of it), lines and the arcs between them; what no process executed is what this case does not
need. Removed, on the syntax tree's statements and with the source's own text and comments kept: functions never called,
statements never reached, the branch of an `if` never taken, the `if` whose test always held (its body takes its place,
unless it holds a `raise`, `return`, `break` or `continue`: such a guard decides what another release does), the `try`
none of whose handlers ran; then, repeatedly, the definitions, constants and imports nothing refers to any more, and the
local functions and side-effect-free assignments nothing reads. The part every script shares (start the ranks, judge,
report) is never touched. The reduced script is kept only if, run as a maintainer runs it (sealed: no difftest
importable), it prints the same verdict lines — the same tensors off with the same values at their worst elements, to
the digits printed, or the same failure line — and exits 1; else the full script stays. The full script is kept beside
it either way (`standalone.full.py`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import tempfile
import time
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from difftest.contracts.syntax import parse

if TYPE_CHECKING:
    from difftest.scripts.check import Checked

# where the part every script shares begins (`difftest.scripts.emit.render_script` writes this line before it)
SHARED_MARKER = "# --- the rest is what every difftest script shares"
FULL_FILE = "standalone.full.py"

# Defines `trace_into(script, out)`: from then on each line of `script` the first time this process or a process forked
# from it executes it, and each arc (a line, then the next its frame ran: `a:b`, or `a:0` where the frame returned
# or raised), is appended to out/<pid>.lines at once, unbuffered (a rank killed by a signal has written every line it
# ran). Only the standard library: it runs where the script runs, sealed as a check is (`_TRACER`, and the fork
# server of `difftest.scripts.shrink`).
TRACE_FUNCTIONS = '''
import os, sys, threading

def trace_into(script, out):
    seen, files, last = set(), {}, {}

    def record(token):
        pid = os.getpid()
        if pid not in files:  # a fork: what the parent saw is in the parent's file
            files.clear()
            files[pid] = os.open(os.path.join(out, f"{pid}.lines"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(files[pid], f"{token} ".encode())

    def once(token):
        if (os.getpid(), token) not in seen:
            seen.add((os.getpid(), token))
            record(token)

    def local(frame, event, arg):
        if event == "line":
            once(frame.f_lineno)
            if id(frame) in last:
                once(f"{last[id(frame)]}:{frame.f_lineno}")
            last[id(frame)] = frame.f_lineno
        elif event == "return" and id(frame) in last:
            once(f"{last.pop(id(frame))}:0")
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == script else None

    sys.settrace(tracer)
    threading.settrace(tracer)
'''
# Run as `python tracer.py SCRIPT OUT`: SCRIPT as __main__, traced into OUT.
_TRACER = TRACE_FUNCTIONS + '''
import runpy

script, out = os.path.abspath(sys.argv[1]), sys.argv[2]
trace_into(script, out)
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
'''


# why a reduction is not kept where the reduced script, checked fresh, did not show the bug the whole one showed
NOT_THE_SAME_BUG = "the reduced script did not show the same bug"


class Executed(set[int]):
    """The lines of a script some process ran, with the arcs between them (`arcs`: a line, then the next one its frame
    ran, 0 where the frame returned or raised)."""

    def __init__(self, lines: Iterable[int] = (), arcs: Iterable[tuple[int, int]] = ()) -> None:
        super().__init__(lines)
        self.arcs: frozenset[tuple[int, int]] = frozenset(arcs)


def traced_lines(folder: Path) -> Executed:
    """The lines and arcs `trace_into(script, folder)` recorded, over every process."""
    tokens = [token for dump in folder.glob("*.lines") for token in dump.read_text().split()]
    arcs = [tuple(map(int, token.split(":"))) for token in tokens if ":" in token]
    return Executed((int(t) for t in tokens if ":" not in t), ((a, b) for a, b in arcs))


@dataclass(frozen=True)
class Reduction:
    """What reducing a script came to."""

    lines_before: int
    lines_after: int  # lines_before where the reduced script was not kept
    seconds: float
    kept: bool
    why_not: str = ""  # where not kept: why (it did not reproduce the same way, the traced run failed, …)
    trials: int = 0  # edits tried one at a time (`difftest.scripts.shrink`)
    kept_edits: int = 0  # of them, those that showed the same bug

    trials_failed: str = ""  # why no edit could be tried, where the trials failed (a defect of difftest's)

    def describe(self) -> str:
        trials = f"; {self.kept_edits} of {self.trials} trial edits kept" if self.trials else ""
        trials += f"; no trials: {self.trials_failed}" if self.trials_failed else ""
        if self.kept:
            return (f"reduced from {self.lines_before} to {self.lines_after} lines in {self.seconds:.0f} s "
                    f"(what never ran{trials}; {FULL_FILE} keeps the whole program)")
        return f"not reduced ({self.why_not}{trials}; {self.seconds:.0f} s)"


def traced_check(script: Path, timeout_s: float, env: dict[str, str] | None = None,
                 niceness: int = 0) -> tuple[Checked, set[int]]:
    """The script's check (`check_script`: run as a maintainer runs it), traced: what it printed, and the lines of it
    that some process executed."""
    from difftest.scripts.check import check_script

    with tempfile.TemporaryDirectory(prefix="difftest-trace-") as folder:
        tracer = Path(folder) / "tracer.py"
        tracer.write_text(_TRACER)
        checked = check_script(script, timeout_s, env=env, niceness=niceness, runner=[str(tracer)],
                               arguments=[folder])
        lines = traced_lines(Path(folder))
    return checked, lines


# Reducing the source ----------------------------------------------------------------------------------------------


def _span(node: ast.stmt) -> tuple[int, int]:
    """First and last line of a statement, its decorators included."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
    return first, node.end_lineno or node.lineno


def _header_lines(node: ast.stmt) -> range:
    """The lines of a compound statement before its body (`if a and\\n b:`), or a simple statement's lines."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return range(node.lineno, max(body[0].lineno, node.lineno + 1))  # `if x: return` on one line: that line
    return range(node.lineno, (node.end_lineno or node.lineno) + 1)


def _ran(lines: range, executed: set[int]) -> bool:
    return any(n in executed for n in lines)


def _body_ran(body: list[ast.stmt], executed: set[int]) -> bool:
    return any(_ran(range(s.lineno, (s.end_lineno or s.lineno) + 1), executed) for s in body)


class _Edits:
    """Line edits of one source: line ranges to delete, lines to replace; applied bottom up."""

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines()
        self.deleted: set[int] = set()  # 1-based
        self.replaced: dict[int, str] = {}
        self.in_strings = _lines_inside_strings(source)  # moved, their text would change the string's value

    def current(self, number: int) -> str:
        return self.replaced.get(number, self.lines[number - 1])

    def delete(self, first: int, last: int) -> None:
        self.deleted.update(range(first, last + 1))

    def text(self) -> str:
        kept = [self.replaced.get(n, line) for n, line in enumerate(self.lines, 1) if n not in self.deleted]
        return "\n".join(kept) + "\n"


def _lines_inside_strings(source: str) -> set[int]:
    """The lines that continue a string literal begun on an earlier line."""
    inside: set[int] = set()
    with contextlib.suppress(tokenize.TokenError, SyntaxError):
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.STRING and token.end[0] > token.start[0]:
                inside.update(range(token.start[0] + 1, token.end[0] + 1))
    return inside


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _reduce_body(body: list[ast.stmt], executed: set[int], edits: _Edits) -> None:
    """Delete what never ran in one block of statements (a block left empty keeps a `pass`)."""
    doomed: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if not _body_ran(node.body, executed):
                # a local function never called, unless what runs beside it names it (a hook registered, to run
                # after the failure): then it stays whole, as a top-level one does (`prune_unexecuted`); one that only
                # removed code named goes afterwards (`drop_unused_locals`)
                if node.name not in _names_read(s for s in body if s is not node):
                    doomed.append(node)
            else:
                _reduce_body(node.body, executed, edits)
            continue
        if _is_docstring(node):
            continue  # docstrings go separately (`drop_docstrings`)
        if not _ran(_header_lines(node), executed) and not (isinstance(node, ast.ClassDef)
                                                           and _body_ran(node.body, executed)):
            doomed.append(node)
            continue
        if isinstance(node, ast.For | ast.AsyncFor | ast.While) and not _body_ran(node.body, executed):
            doomed.append(node)  # it never iterated
            continue
        if isinstance(node, ast.If) and not node.orelse and not _body_ran(node.body, executed):
            doomed.append(node)  # its test never held
            continue
        if isinstance(node, ast.If) and not node.orelse and _always_held(node, executed) and _guard_goes(node, edits):
            _reduce_body(node.body, executed, edits)
            _unwrap_if(node, edits)  # its test held every time: the guard goes, its body takes its place
            continue
        if isinstance(node, ast.If):
            _reduce_if(node, executed, edits)
            continue
        if isinstance(node, ast.ClassDef | ast.With | ast.For | ast.While | ast.Try):
            for block in ("body", "orelse", "finalbody"):
                inner = getattr(node, block, None)
                if inner and _body_ran(inner, executed):
                    _reduce_body(inner, executed, edits)
        if isinstance(node, ast.Try) and not node.finalbody and not any(_body_ran(h.body, executed)
                                                                         for h in node.handlers):
            _unwrap_try(node, edits)  # no handler ever ran: nothing it guards against happened in this case
    if doomed and len(doomed) == len([n for n in body if not _is_docstring(n)]):
        keep = doomed.pop(0)  # the block needs a statement: the first one becomes `pass`
        first, last = _span(keep)
        edits.delete(first + 1, last)
        edits.replaced[first] = _indent(edits.lines[first - 1]) + "pass"
    for node in doomed:
        edits.delete(*_span(node))


def _names_read(nodes: Iterable[ast.stmt]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _reduce_if(node: ast.If, executed: set[int], edits: _Edits) -> None:
    """An `if` reached: the branch no process took goes. A body never run before an `elif`: the `elif` becomes the
    `if`; before an `else`: the `else` block takes its place; a never-run `else`/`elif` goes."""
    body_ran = _body_ran(node.body, executed)
    orelse_ran = bool(node.orelse) and _body_ran(node.orelse, executed)
    elif_chain = len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and \
        edits.lines[node.orelse[0].lineno - 1].lstrip().startswith("elif")
    is_elif = edits.current(node.lineno).lstrip().startswith("elif")  # an `elif` keeps its place in its chain
    if not body_ran and node.orelse and (orelse_ran or elif_chain):
        if elif_chain:
            inner = node.orelse[0]
            assert isinstance(inner, ast.If)
            edits.delete(node.lineno, inner.lineno - 1)
            if not is_elif:
                line = edits.lines[inner.lineno - 1]
                edits.replaced[inner.lineno] = _indent(edits.lines[node.lineno - 1]) + line.lstrip()[2:]  # elif → if
            _reduce_if(inner, executed, edits)
        elif is_elif:  # `elif a: …` never taken, its `else` was: the `else:` in its place
            edits.delete(node.lineno + 1, _else_line(node, edits))
            edits.replaced[node.lineno] = _indent(edits.lines[node.lineno - 1]) + "else:"
            _reduce_body(node.orelse, executed, edits)
        else:
            edits.delete(node.lineno, node.orelse[0].lineno - 1)  # `if …:`, its body, `else:`
            _dedent(edits, node.orelse)
            _reduce_body(node.orelse, executed, edits)
        return
    if body_ran:
        _reduce_body(node.body, executed, edits)
    if node.orelse and not orelse_ran:
        else_line = _else_line(node, edits)
        edits.delete(else_line, node.orelse[-1].end_lineno or node.orelse[-1].lineno)
        if body_ran and _guard_goes(node, edits):
            _unwrap_if(node, edits)  # its test held every time (the `else` never ran): its body takes its place
    elif node.orelse and elif_chain:
        _reduce_if(node.orelse[0], executed, edits)  # type: ignore[arg-type]
    elif node.orelse:
        _reduce_body(node.orelse, executed, edits)


def _always_held(node: ast.If, executed: set[int]) -> bool:
    """Whether an `if`'s test held every time it was evaluated, by the traced arcs: every step out of its test's lines
    went into its body (none past it, to a loop's head, or out of the frame)."""
    arcs: frozenset[tuple[int, int]] = getattr(executed, "arcs", frozenset())
    test = range(node.lineno, _span(node.body[0])[0])
    first = range(_span(node.body[0])[0], (node.body[0].end_lineno or node.body[0].lineno) + 1)
    out = {b for a, b in arcs if a in test and b not in test}
    return bool(out) and out <= set(first)


def _guard_goes(node: ast.If, edits: _Edits) -> bool:
    """Whether an `if` whose test always held may give way to its body: an `if` (an `elif` keeps its place) with its
    body on lines of its own, a test with no effect of its own (`_effect_free`), and no `raise`, `return`, `break` or
    `continue` in the body: such a guard decides what another release does."""
    return not edits.current(node.lineno).lstrip().startswith("elif") and _span(node.body[0])[0] > node.lineno \
        and _effect_free(node.test) and _falls_through(node.body)


def _unwrap_if(node: ast.If, edits: _Edits) -> None:
    edits.delete(node.lineno, _span(node.body[0])[0] - 1)
    _dedent(edits, node.body)


def _falls_through(body: list[ast.stmt]) -> bool:
    """Whether a block has no `raise`, `return`, `break` or `continue` of its own: a guard around one (the release
    that raises, the early exit) decides what the script does on another release, and stays."""
    exits = ast.Raise | ast.Return | ast.Break | ast.Continue
    pending: list[ast.AST] = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, exits):
            return False
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            pending += ast.iter_child_nodes(node)
    return True


def _unwrap_try(node: ast.Try, edits: _Edits) -> None:
    """A `try` none of whose handlers ran, without `finally`: its body (then its `else` block) in its place."""
    edits.delete(node.lineno, _span(node.body[0])[0] - 1)
    _dedent(edits, node.body)
    last_handler = node.handlers[-1]
    if node.orelse:  # from the first `except` to the `else:` line, then the `else` block moved out
        edits.delete(node.handlers[0].lineno, node.orelse[0].lineno - 1)
        _dedent(edits, node.orelse)
    else:
        edits.delete(node.handlers[0].lineno, last_handler.end_lineno or last_handler.lineno)


def _else_line(node: ast.If, edits: _Edits) -> int:
    """The line of the `else:`/`elif` that opens an `if`'s orelse."""
    first = node.orelse[0].lineno
    for n in range(first, node.body[-1].end_lineno or first, -1):
        if edits.lines[n - 1].lstrip().startswith(("else", "elif")):
            return n
    return first


def _dedent(edits: _Edits, block: list[ast.stmt]) -> None:
    """Move a block one level out (an `else` block that replaces its `if`)."""
    first, last = _span(block[0])[0], block[-1].end_lineno or block[-1].lineno
    outer = len(_indent(edits.lines[first - 1]))
    for n in range(first, last + 1):
        if n in edits.in_strings:
            continue
        line = edits.replaced.get(n, edits.lines[n - 1])
        step = 4 if outer >= 4 else outer
        edits.replaced[n] = line[step:] if line[:step].strip() == "" else line


def _shared_start(lines: list[str]) -> int:
    """The line where the part every script shares begins (past the end where there is none)."""
    return next((n for n, line in enumerate(lines, 1) if line.startswith(SHARED_MARKER)), len(lines) + 1)


def prune_unexecuted(source: str, executed: set[int]) -> str:
    """`source` less what never ran, before the shared part (never touched). A definition that never ran but is named
    by what stays (a call on the line that failed, before it was reached) stays whole."""
    keep: set[str] = set()
    while True:
        pruned = _prune(source, executed, keep)
        tree = parse(pruned)
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        missing = (named - defined) & _definitions(source) - keep
        if not missing:
            return pruned
        keep |= missing


def _definitions(source: str) -> set[str]:
    return {n.name for n in parse(source).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def _prune(source: str, executed: set[int], keep: set[str]) -> str:
    tree = parse(source)
    edits = _Edits(source)
    marker = _shared_start(edits.lines)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.lineno < marker:
            if node.name in keep:
                continue
            if not _body_ran(node.body, executed):
                edits.delete(*_span(node))
            else:  # a class: its methods never called and their branches never taken go too
                _reduce_body(node.body, executed, edits)
    return edits.text()


def drop_idle_blocks(source: str) -> str:
    """Remove, until none is left, the loops and `with` blocks whose whole body is `pass` (pruning left it so: what
    they did for other cases never happened in this one); a block they leave empty gets a `pass` of its own."""
    while True:
        tree = parse(source)
        edits = _Edits(source)
        marker = _shared_start(edits.lines)
        for parent in ast.walk(tree):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(parent, field, None)
                if not isinstance(block, list) or not block or not isinstance(block[0], ast.stmt):
                    continue
                idle = [s for s in block if isinstance(s, ast.For | ast.AsyncFor | ast.While | ast.With)
                        and s.lineno < marker and not getattr(s, "orelse", None)
                        and all(isinstance(b, ast.Pass) for b in s.body)]
                for node in idle:
                    first, last = _span(node)
                    if len(idle) == len(block) and node is idle[0]:  # the block needs a statement
                        edits.delete(first + 1, last)
                        edits.replaced[first] = _indent(edits.lines[first - 1]) + "pass"
                    else:
                        edits.delete(first, last)
        if not edits.deleted:
            return source
        source = edits.text()


def drop_docstrings(source: str) -> str:
    """Every docstring but the script's own (which says what it shows): the maintainer reads the code that runs."""
    tree = parse(source)
    edits = _Edits(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and len(node.body) > 1 \
                and _is_docstring(node.body[0]):
            edits.delete(*_span(node.body[0]))
    return edits.text()


def _unused_local_definitions(source: str) -> list[ast.stmt]:
    """The functions and classes defined inside a function (before the shared part) that nothing else in that function
    names (what named them has gone; a decorated one stays: its decorator may register it), and the assignments
    there whose names nothing reads and whose value has no effect of its own."""
    tree = parse(source)
    marker = _shared_start(source.splitlines())
    unused: list[ast.stmt] = []
    for outer in ast.walk(tree):
        if not isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef) or outer.lineno >= marker:
            continue
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("locals", "vars", "eval", "exec")
               for n in ast.walk(outer)):
            continue  # it may reach its names by strings
        for block in _statement_blocks(outer):
            for node in block:
                if isinstance(node, ast.ClassDef) and (node.bases or node.keywords):
                    continue  # a base class may register it (`__init_subclass__`)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.decorator_list:
                    others = (n for child in outer.body for n in ast.walk(child) if n is not node)
                    inside = {id(n) for n in ast.walk(node)}
                    if not any(isinstance(n, ast.Name) and n.id == node.name and id(n) not in inside for n in others):
                        unused.append(node)
        # an assignment, without side effects, to names nothing in the function (its local functions included) reads
        read = {n.id for n in ast.walk(outer) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load | ast.Del)}
        read |= {n.target.id for n in ast.walk(outer) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}
        read |= {name for n in ast.walk(outer) if isinstance(n, ast.Nonlocal | ast.Global) for name in n.names}
        for block in _statement_blocks(outer):
            for node in block:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                    if isinstance(node, ast.AnnAssign) and node.value is not None else []
                names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                if targets and all(isinstance(t, ast.Name | ast.Tuple) for t in targets) and \
                        all(isinstance(e, ast.Name) for t in targets if isinstance(t, ast.Tuple) for e in t.elts) and \
                        not {n.id for n in names} & read and _pure(node.value):  # type: ignore[attr-defined]
                    unused.append(node)
    return unused


# what an expression may hold and still do nothing but compute a value that cannot fail: literals, names, the
# containers of them, comparisons and `not`, and `mapping.get(...)` and the calls below; an operator, a subscript or
# an attribute may raise (the failure the script shows), any other call may do anything
_PURE_NODES = (ast.Constant, ast.Name, ast.Load, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Compare, ast.BoolOp,
               ast.UnaryOp, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn,
               ast.Call, ast.Attribute, ast.keyword)
_PURE_FUNCTIONS = frozenset({"isinstance", "hasattr", "callable"})


def _effect_free(expression: ast.expr) -> bool:
    """Whether evaluating `expression` does nothing but compute a value, if it does not raise: no call but the ones
    above and `len`, no walrus, no yield (a test that always held, and so never raised, may go)."""
    for node in ast.walk(expression):
        if isinstance(node, ast.NamedExpr | ast.Await | ast.Yield | ast.YieldFrom | ast.Lambda):
            return False
        if isinstance(node, ast.Call) and not (
                (isinstance(node.func, ast.Name) and node.func.id in _PURE_FUNCTIONS | {"len"})
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "get")):
            return False
    return True


def _pure(expression: ast.expr | None) -> bool:
    """Whether evaluating `expression` only computes a value, and cannot raise (`_PURE_NODES`)."""
    for node in ast.walk(expression) if expression is not None else ():
        if not isinstance(node, _PURE_NODES):
            return False
        if isinstance(node, ast.Call) and not (
                (isinstance(node.func, ast.Name) and node.func.id in _PURE_FUNCTIONS)
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name))):
            return False
        if isinstance(node, ast.Attribute) and not any(isinstance(c, ast.Call) and c.func is node
                                                       for c in ast.walk(expression)):  # type: ignore[arg-type]
            return False  # an attribute read may raise; `x.get` as the function called is the one allowed
    return True


def _statement_blocks(function: ast.AST) -> Iterable[list[ast.stmt]]:
    """The blocks of statements inside `function`, not those of the functions and classes it defines."""
    pending: list[ast.AST] = [function]
    while pending:
        node = pending.pop()
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block:
                if isinstance(block[0], ast.stmt):
                    yield block
                pending += [n for n in block if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                                               | ast.ClassDef)]


def drop_unused_locals(source: str) -> str:
    """Remove, until none is left, the local functions, classes and side-effect-free assignments nothing reads
    (`_unused_local_definitions`); a block they leave empty gets a `pass`."""
    while unused := _unused_local_definitions(source):
        edits = _Edits(source)
        tree = parse(source)
        for node in unused:
            block = next(b for b in statement_blocks(tree) if any(s is node or _same(s, node) for s in b))
            first, last = _span(node)
            if all(_same(s, node) or any(_same(s, u) for u in unused) or _is_docstring(s) for s in block) and \
                    _same(node, next(s for s in block if not _is_docstring(s))):
                edits.delete(first + 1, last)  # the block needs a statement: the first one becomes `pass`
                edits.replaced[first] = _indent(edits.lines[first - 1]) + "pass"
            else:  # with the comment right above it, and the blank line after it
                while first > 1 and edits.lines[first - 2].strip().startswith("#") and \
                        len(_indent(edits.lines[first - 2])) == len(_indent(edits.lines[first - 1])):
                    first -= 1
                edits.delete(first, last + (last < len(edits.lines) and not edits.lines[last].strip()))
        source = edits.text()
    return source


def statement_blocks(tree: ast.AST) -> Iterable[list[ast.stmt]]:
    """Every block of statements in `tree`: bodies, `else` and `finally` blocks, handlers' bodies."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for handler in getattr(node, "handlers", ()):
            yield handler.body


def _same(a: ast.stmt, b: ast.stmt) -> bool:
    return (a.lineno, a.col_offset) == (b.lineno, b.col_offset)


def drop_unused(source: str) -> str:
    """Remove, until none is left, the top-level definitions, single-name constants and imported names that nothing
    else in the script refers to (by name, or as a string the script reads by name), and the local functions and
    classes nothing names."""
    source = drop_unused_locals(source)
    while True:
        tree = parse(source)
        lines = source.splitlines()
        loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        loads |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        drop: list[tuple[int, int, str | None]] = []
        for node in tree.body:
            first, last = _span(node)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name not in loads - _self_references(node):
                    drop.append((first, last, None))
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if all(isinstance(t, ast.Name) and t.id not in loads for t in targets):
                    drop.append((first, last, None))
            elif isinstance(node, ast.Import | ast.ImportFrom) and first == last:
                if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                    continue
                used = [a for a in node.names if (a.asname or a.name).split(".")[0] in loads]
                if not used:
                    drop.append((first, last, None))
                elif len(used) < len(node.names):
                    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in used)
                    head = f"from {node.module} import " if isinstance(node, ast.ImportFrom) else "import "
                    drop.append((first, last, _indent(lines[first - 1]) + head + names))
        if not drop:
            return source
        for first, last, replacement in sorted(drop, reverse=True):
            lines[first - 1:last] = [replacement] if replacement is not None else []
        source = "\n".join(lines) + "\n"


def _self_references(node: ast.AST) -> set[str]:
    """A definition's name where only its own body reads it (recursion keeps nothing alive)."""
    name = getattr(node, "name", "")
    inner = {n.id for child in ast.iter_child_nodes(node) for n in ast.walk(child) if isinstance(n, ast.Name)}
    return {name} if name in inner else set()


_OPENER = re.compile(r":[ \t]*(?:#.*)?$")  # a line that opens a block


def tidy(source: str) -> str:
    """What removing statements leaves, tidied: from the first definition to the part every script shares, no blank
    line right after a block's opening line and at most one between indented statements (a string's own lines kept
    as they are); at most two blank lines in a row anywhere."""
    lines = source.splitlines(keepends=True)
    marker = _shared_start([line.rstrip("\n") for line in lines])
    first = next((_span(n)[0] for n in parse(source).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                                                          | ast.ClassDef)), marker)
    inside = _lines_inside_strings(source)
    kept: list[str] = []
    number = first
    while number < marker:
        line = lines[number - 1]
        if line.strip() or number in inside:
            kept.append(line)
            number += 1
            continue
        end = number  # a run of blank lines, outside any string
        while end < marker and not lines[end - 1].strip() and end not in inside:
            end += 1
        following = lines[end - 1] if end < marker else ""
        if following.strip() and following[:1] in (" ", "\t"):  # before an indented statement
            opener = kept and (number - 1) not in inside and _OPENER.search(kept[-1].rstrip("\n"))
            kept += [] if opener else [line]
        else:
            kept += lines[number - 1:end - 1]
        number = end
    source = "".join(lines[:first - 1] + kept + lines[marker - 1:])
    return re.sub(r"\n{4,}", "\n\n\n", source)


def narrow_rank_imports(source: str) -> str:
    """`RANK_IMPORTS` less the modules no code left in the script imports: the ranks are not made to import a library
    that only a removed branch used (a timm model's script, the transformers its kind's other branch builds with)."""
    tree = parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["RANK_IMPORTS"]
                and isinstance(node.value, ast.Tuple)):
            kept = tuple(e.value for e in node.value.elts if isinstance(e, ast.Constant) and e.value in imported)
            first, last = _span(node)
            lines = source.splitlines()
            lines[first - 1:last] = [f"RANK_IMPORTS = {kept!r}"]
            return "\n".join(lines) + "\n"
    return source


def reduce_source(source: str, executed: set[int]) -> str:
    """What never ran (before the shared part), the loops left idle, every docstring but the script's, then what
    nothing refers to, and the ranks' imports of what is gone."""
    return tidy(narrow_rank_imports(drop_unused(drop_docstrings(drop_idle_blocks(prune_unexecuted(source,
                                                                                                   executed))))))


# The same bug --------------------------------------------------------------------------------------------------------


def verdict_lines(output: str) -> list[str]:
    """What a script printed of its own about the bug, less the releases and the case lines: the tensors' verdicts (values to the
    digits printed), the failure's line, BUG PRESENT. A nondeterminism's values differ from run to run: its tensors'
    names stand for them."""
    from difftest.scripts.check import own_lines

    lines = [line for line in own_lines(output) if not line.startswith(("python ", "case: "))]
    if any("two runs of the setting differ" in line for line in lines):
        lines = [line.split(":")[0] + (": differs" if "elements differ" in line else ": same") for line in lines]
    return lines


def same_bug(original: str, reduced: str) -> bool:
    from difftest.contracts.script import BUG_PRESENT

    mine = verdict_lines(reduced)
    return mine == verdict_lines(original) and any(line.startswith(BUG_PRESENT) for line in mine)


def reduced_by_trace(path: Path, executed: set[int]) -> tuple[str, str, str]:
    """(the script at `path`, kept whole as `standalone.full.py`; it less what never ran; why there is no reduction,
    or ""): a reducer that fails, or writes what does not compile, leaves the whole script (ours to fix, never the end
    of the run)."""
    source = path.read_text()
    path.with_name(FULL_FILE).write_text(source)
    try:
        reduced = reduce_source(source, executed)
        compile(reduced, path.name, "exec")
    except SyntaxError as exc:
        return source, source, f"the reduced script does not compile ({exc.msg}, line {exc.lineno})"
    except Exception as exc:
        return source, source, f"the reducer failed, a defect of difftest's: {type(exc).__name__}: {exc}"
    return source, reduced, ""


def reduce_script(path: Path, traced: Checked, executed: set[int], timeout_s: float,
                  env: dict[str, str] | None = None, niceness: int = 0) -> tuple[Reduction, Checked]:
    """Reduce the script at `path`, whose traced check (`traced_check`) reproduced, in place; its whole form is kept
    as `standalone.full.py`. The reduced one is kept only if its own check (sealed, by `env`) prints the same verdict
    and exits 1. Returns the reduction and the check that stands for the script now at `path`."""
    from difftest.scripts.check import check_script

    started = time.perf_counter()
    source, reduced, why_not = reduced_by_trace(path, executed)
    before = source.count("\n")

    def refused(why: str) -> tuple[Reduction, Checked]:
        path.write_text(source)
        return Reduction(before, before, time.perf_counter() - started, False, why), traced

    if why_not:
        return refused(why_not)
    if reduced == source:
        return refused("nothing it does not run")
    path.write_text(reduced)
    checked = check_script(path, timeout_s, env=env, niceness=niceness)
    if checked.exit_code != 1 or not same_bug(traced.output, checked.output):
        return refused(f"{NOT_THE_SAME_BUG} (exit {checked.exit_code})")
    return Reduction(before, reduced.count("\n"), time.perf_counter() - started, True), checked
