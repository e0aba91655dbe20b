"""A standalone script shrunk by trials: what C-Reduce does for compiler bugs, at the level of Python statements.

The reduction by trace (`difftest.scripts.reduce`) removes what no process ran, and the guards that always held.
What ran but does not matter to the bug (an evaluation before the step that shows it, the weights a crash never
reads, a `with` block's context) goes here: one candidate edit at a time, on the syntax tree's statements and with the
source's own text kept — delete a statement (largest first), or put a compound statement's body in its place (`if`,
`with`, `try`) — then the definitions, constants and imports nothing refers to any more. An edit is kept only if the
script, run sealed as a maintainer runs it, prints the same verdict lines (the same tensors off with the same values
to the digits printed, or the same failure line) and exits 1. Edits that cannot compile, or that leave a name with no
definition, are never run. The part every script shares is never touched, and neither is anything above the first
definition (the docstring, imports, constants).

Trials run in a fork server that has imported the script's libraries once (`_SERVER`): a trial costs what its ranks
compute, a fraction of a second on the findings' small cases, not the seconds TorchRec's import takes; the script is
run in a forked child as `__main__`, its own folder beside its data, as `python standalone.py` would run it but in the
state the server left (what it imported, its `sys.path`): one fresh check decides what is kept.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from difftest.contracts.syntax import parse
from difftest.scripts.reduce import (
    NOT_THE_SAME_BUG,
    SHARED_MARKER,
    TRACE_FUNCTIONS,
    Reduction,
    drop_unused,
    reduce_script,
    same_bug,
    statement_blocks,
    tidy,
    traced_lines,
)
from difftest.storage.paths import absolute

if TYPE_CHECKING:
    from difftest.scripts.check import Checked

# Run as `python server.py MODULE...`: imports them, says it is ready, then for each request line (JSON: script, out,
# seconds: its time limit; optionally imports: more modules to import first, once; cwd: the folder to run it from;
# trace: a folder to trace it into, `trace_into`) forks a child that runs the script as `python script` would and
# answers with its exit code. Only the standard library: it runs sealed, where
# difftest does not import.
_SERVER = TRACE_FUNCTIONS + '''
import importlib, json, runpy, signal, time, traceback

def load(names):
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # a release without it: the script says what it does then
            pass

replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what a library prints on import goes where its warnings go, never into the replies

def answer(message):
    replies.write(json.dumps(message) + "\\n")
    replies.flush()

load(sys.argv[1:])  # what every trial would import again: once here
answer({"ready": True})
for line in sys.stdin:
    request = json.loads(line)
    load(request.get("imports", ()))
    started = time.perf_counter()
    sys.stdout.flush()  # what a library printed on import goes to the server's stderr now, not into a child's output
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()  # its ranks in its own group: a timeout kills them all
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        if request.get("trace"):
            trace_into(request["script"], request["trace"])
        sys.argv = [request["script"]]
        code = 0
        try:
            runpy.run_path(request["script"], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 2
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            try:  # a rank it left behind must not write into the next trial's output
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            break
        if time.perf_counter() - started > request["seconds"]:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = 124
            break
        time.sleep(0.01)
    answer({"code": code})
'''


@dataclass(frozen=True)
class Shrinking:
    """What the trials came to."""

    lines_before: int
    lines_after: int
    trials: int
    kept: int  # edits that showed the same bug
    seconds: float


def script_modules(source: str) -> list[str]:
    """The modules a script imports at its top (its statements', not its docstring's words) and has its ranks import
    (`RANK_IMPORTS`), numpy and torch first."""
    body = parse(source).body  # parsed once, under its lock; literal_eval of a node parses nothing (cpython#106905)
    ranks = next((ast.literal_eval(node.value) for node in body if isinstance(node, ast.Assign)
                  and [getattr(t, "id", "") for t in node.targets] == ["RANK_IMPORTS"]), ())
    top = [alias.name for node in body if isinstance(node, ast.Import) for alias in node.names]
    top += [node.module for node in body
            if isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module != "__future__"]
    return list(dict.fromkeys(["numpy", "torch", *ranks, *top]))


# seconds a server may take to import libraries (TorchRec: 3-10 s on a loaded 2-core host) before it answers
IMPORTS_S = 300.0


class TrialServer:
    """A fork server for scripts' trials and traced runs (`_SERVER`), with the scripts' environment: it imports the
    first script's libraries at once, another script's it lacks before that script's first run."""

    def __init__(self, script: Path, env: dict[str, str] | None, niceness: int = 0) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="difftest-trials-")
        server = Path(self._folder.name) / "server.py"
        server.write_text(_SERVER)
        command = ([] if not niceness else ["nice", "-n", str(niceness)]) + [sys.executable, str(server),
                                                                            *script_modules(script.read_text())]
        self._process = subprocess.Popen(command, cwd=script.parent.parent, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if '"ready"' not in self._reply(0.0):
            self.close()
            raise RuntimeError("the trial server did not start")

    def _reply(self, timeout_s: float) -> str:
        """The server's next line, within `timeout_s` and what importing libraries may take; "" where it stopped or
        did not answer in time (then it is killed)."""
        import selectors

        assert self._process.stdout is not None
        # one line a request, read whole: nothing waits in the pipe's reader between requests
        with selectors.DefaultSelector() as waiting:
            waiting.register(self._process.stdout, selectors.EVENT_READ)
            answered = waiting.select(timeout_s + IMPORTS_S)
        if not answered:
            self._process.kill()
            return ""
        return self._process.stdout.readline()

    def run(self, script: Path, timeout_s: float, **request: object) -> tuple[int, str]:
        """The script's exit code and output, run in a fork as `__main__` (`request`: what else `_SERVER` takes)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        out = Path(self._folder.name) / "out.txt"
        script = absolute(script)  # the fork runs it from the server's folder, or the one the request names
        self._process.stdin.write(json.dumps({"script": str(script), "out": str(out), "seconds": timeout_s,
                                              **request}) + "\n")
        self._process.stdin.flush()
        reply = self._reply(timeout_s)
        if not reply:
            raise RuntimeError("the trial server stopped or did not answer")
        return int(json.loads(reply)["code"]), out.read_text(errors="replace").strip()

    def trace(self, script: Path, timeout_s: float) -> tuple[Checked, set[int]]:
        """What `difftest.scripts.reduce.traced_check` gives of a fresh interpreter, from a fork of this one: the
        script run from the folder above its own, its libraries imported once for every script this server runs."""
        from difftest.scripts.check import Checked

        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="difftest-trace-") as folder:
            code, output = self.run(script, timeout_s, imports=script_modules(script.read_text()),
                                    cwd=str(script.parent.parent), trace=folder)
            lines = traced_lines(Path(folder))
        if code == 124:
            output = f"timed out after {timeout_s:.0f} s: {output}"
        return Checked(code, time.perf_counter() - started, output), lines

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self._process.stdin:
                self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        if self._process.poll() is None:
            self._process.kill()
        self._folder.cleanup()


# Candidate edits ------------------------------------------------------------------------------------------------------


def _region(source: str) -> tuple[int, int]:
    """The lines a trial may edit: from the first definition to the part every script shares."""
    tree = parse(source)
    first = next((_start(n) for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)),
                 None)
    lines = source.splitlines()
    marker = next((n for n, line in enumerate(lines, 1) if line.startswith(SHARED_MARKER)), len(lines) + 1)
    return (first or marker), marker


def _start(node: ast.stmt) -> int:
    return min([node.lineno, *(int(d.lineno) for d in getattr(node, "decorator_list", ()))])


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _with_comments(lines: list[str], first: int) -> int:
    """The first line of a statement with the comment lines right above it (they are about it)."""
    while first > 1 and lines[first - 2].strip().startswith("#") and \
            len(_indent(lines[first - 2])) >= len(_indent(lines[first - 1])):
        first -= 1
    return first


def _delete(lines: list[str], block: list[ast.stmt], node: ast.stmt) -> list[str]:
    first, last = _with_comments(lines, _start(node)), node.end_lineno or node.lineno
    if len(block) == 1:  # the block needs a statement
        return [*lines[:first - 1], _indent(lines[first - 1]) + "pass", *lines[last:]]
    return [*lines[:first - 1], *lines[last:]]


def _unwrap(lines: list[str], node: ast.If | ast.With | ast.Try) -> list[str] | None:
    """The compound statement's body in its place, one level out; None where its text does not allow it."""
    body = node.body
    first, last = _start(body[0]), body[-1].end_lineno or body[-1].lineno
    step = len(_indent(lines[first - 1])) - len(_indent(lines[node.lineno - 1]))
    if step <= 0 or any(line.strip() and not line[:step].isspace() for line in lines[first - 1:last]):
        return None
    inner = [line[step:] if line.strip() else line for line in lines[first - 1:last]]
    return [*lines[:node.lineno - 1], *inner, *lines[(node.end_lineno or last):]]


def candidates(source: str) -> Iterator[tuple[str, str]]:
    """(which edit: its kind and the text it removes, the edited source) for each statement of the editable region:
    deletions, largest first, then unwrappings (an `if` with no `else`, a `with`, a `try` with no `else` or
    `finally`)."""
    tree = parse(source)
    lines = source.splitlines()
    first, marker = _region(source)
    edits: list[tuple[int, str, list[str]]] = []
    seen: dict[str, int] = {}
    for block in statement_blocks(tree):
        for node in block:
            start, end = _start(node), node.end_lineno or node.lineno
            if start < first or end >= marker:
                continue
            text = "\n".join(lines[start - 1:end])
            seen[text] = seen.get(text, 0) + 1  # the same statement twice is two candidates
            key = f"{text}\n#{seen[text]}"
            edits.append((end - start + 1, f"delete\n{key}", _delete(lines, block, node)))
            elif_ = lines[node.lineno - 1].lstrip().startswith("elif")  # its body alone would run after the `if`
            unwrappable = (isinstance(node, ast.If) and not node.orelse and not elif_) or isinstance(node, ast.With) \
                or (isinstance(node, ast.Try) and not node.orelse and not node.finalbody)
            if unwrappable and (unwrapped := _unwrap(lines, node)) is not None:  # type: ignore[arg-type]
                edits.append((0, f"unwrap\n{key}", unwrapped))
    for _size, key, edited in sorted(edits, key=lambda e: -e[0]):
        yield key, "\n".join(edited) + "\n"


def undefined_names(source: str) -> set[str]:
    """Names the source reads that nothing in it defines and Python does not provide (a static NameError)."""
    tree = parse(source)
    bound = set(dir(builtins)) | {"__file__", "__name__"}
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            bound.update(node.names)
    return read - bound


def shrink(path: Path, original_output: str, budget_s: float, timeout_s: float, env: dict[str, str] | None = None,
           niceness: int = 0, server: TrialServer | None = None) -> Shrinking:
    """Shrink the (reproducing) script at `path` in place by trials within `budget_s` seconds; it keeps every edit
    that showed the same bug as `original_output`, so the script at `path` reproduces whenever this returns. The trials
    run in `server` where one is lent (another script's, which imports this one's libraries before its first trial;
    it stays open), else in a server of their own."""
    started = time.perf_counter()
    source = path.read_text()
    before = source.count("\n")
    trial = path.with_name(".trial.py")
    tried: set[str] = set()
    undefined = undefined_names(source)
    trials = kept = 0
    trial_server = server or TrialServer(path, env, niceness)
    # from the folder above the script's, as a server of its own runs them, whichever script's server this is
    where = {"cwd": str(absolute(path).parent.parent)}
    try:
        # the script as it is, first: the trials' yardstick of time, and proof that a forked run shows the bug
        trial.write_text(source)
        baseline = time.perf_counter()
        code, output = trial_server.run(trial, timeout_s, imports=script_modules(source), **where)
        if code != 1 or not same_bug(original_output, output):
            raise RuntimeError(f"the script, run in the trial server, did not show the same bug (exit {code})")
        # an edit that makes the ranks wait for each other forever (a collective removed on one path) costs this
        timeout_s = min(timeout_s, max(2.0, 4 * (time.perf_counter() - baseline)))
        # the budget is the trials': the server's imports (seconds for TorchRec on a loaded machine) and the
        # baseline are not charged to it
        trials_from = time.perf_counter()
        improved = True
        while improved and time.perf_counter() - trials_from < budget_s:  # passes, until one keeps nothing
            improved, seen = False, set()
            pending = candidates(source)
            while (edit := next(pending, None)) is not None and time.perf_counter() - trials_from < budget_s:
                key, edited = edit
                if key in seen:
                    continue  # tried in this pass, on the script before a later edit was kept
                seen.add(key)
                try:
                    reduced = tidy(drop_unused(edited))
                except SyntaxError:  # an edit whose text does not parse (a `pass` at a comment's indentation)
                    continue
                digest = hashlib.sha1(reduced.encode()).hexdigest()
                if digest in tried or reduced == source:
                    continue
                tried.add(digest)
                try:
                    compile(reduced, path.name, "exec")
                except SyntaxError:
                    continue
                if undefined_names(reduced) - undefined:
                    continue
                trial.write_text(reduced)
                trials += 1
                code, output = trial_server.run(trial, timeout_s, **where)
                if code == 1 and same_bug(original_output, output):
                    source, kept, improved = reduced, kept + 1, True
                    path.write_text(source)
                    pending = candidates(source)  # the rest of this pass, on the smaller script
    finally:
        if server is None:
            trial_server.close()
        trial.unlink(missing_ok=True)
    return Shrinking(before, source.count("\n"), trials, kept, time.perf_counter() - started)


def reduce_and_shrink(path: Path, traced: Checked, executed: set[int], timeout_s: float,
                      env: dict[str, str] | None = None, niceness: int = 0,
                      budget_s: float = 0.0, server: TrialServer | None = None) -> tuple[Reduction, Checked]:
    """The script at `path` (its traced check `traced` reproduced) reduced to what ran (`reduce_script`, checked
    alone where there are no trials), then shrunk by trials within `budget_s` (their first run proves the reduction
    in a fork; in `server` where one is lent); what stays is kept only if one fresh, sealed check shows the same bug
    and exits 1, else the whole script is. Returns the reduction and the check that stands for the script now at
    `path`."""
    from difftest.scripts.check import check_script
    from difftest.scripts.reduce import reduced_by_trace

    if budget_s <= 0:
        return reduce_script(path, traced, executed, timeout_s, env, niceness)
    started = time.perf_counter()
    source, reduced, why_not = reduced_by_trace(path, executed)  # a failed reduction: the trials start whole
    before = source.count("\n")
    path.write_text(reduced)
    try:
        shrunk = shrink(path, traced.output, budget_s, timeout_s, env, niceness, server)
        trials, kept = shrunk.trials, shrunk.kept
    except Exception as exc:  # the trials failing are ours to fix; `path` holds the last script that showed the bug
        trials_failed = f"a defect of difftest's: {type(exc).__name__}: {exc}"
        trials = kept = 0
    else:
        trials_failed = ""
    # the trials' script, else (a fork showed the bug where a fresh interpreter does not) the reduction by trace
    for candidate in dict.fromkeys([path.read_text(), reduced]):
        if candidate == source:
            break
        path.write_text(candidate)
        final = check_script(path, timeout_s, env=env, niceness=niceness)
        if final.exit_code == 1 and same_bug(traced.output, final.output):
            return Reduction(before, candidate.count("\n"), time.perf_counter() - started, True, "", trials,
                             kept if candidate != reduced else 0, trials_failed), final
        why_not = f"{NOT_THE_SAME_BUG} (exit {final.exit_code})"
    path.write_text(source)
    return Reduction(before, before, time.perf_counter() - started, False, why_not or "nothing it does not need",
                     trials, kept, trials_failed), traced
