"""Reducing a standalone script to what its case runs (difftest.scripts.reduce): the pure steps on a small script
whose executed lines are known, and the tracer on a real run of it."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np

from difftest.scripts.reduce import (
    SHARED_MARKER,
    drop_docstrings,
    drop_unused,
    narrow_rank_imports,
    prune_unexecuted,
    reduce_source,
    same_bug,
    traced_check,
)

SCRIPT = textwrap.dedent(f'''\
    """What the script shows."""
    import os, re, sys
    import json

    CASE = {{"kind": "b"}}
    UNUSED = 3

    def helper(x):
        """Doubles x."""
        return 2 * x

    def never_called(x):
        return x + 1

    def setting(case):
        """The setting."""
        if case["kind"] == "a":
            value = helper(1)
            value += 1
        elif case["kind"] == "b":
            value = helper(2)
        else:
            value = never_called(3)
        if value > 100:
            print("big")
        else:
            print("small")
        return value

    {SHARED_MARKER}: start the ranks, judge, report ---
    def main():
        """Kept whole: the shared part."""
        if os.environ.get("NEVER_SET"):
            print("never")
        print("v:", setting(CASE))
        print("BUG PRESENT: yes")
        return 1

    if __name__ == "__main__":
        sys.exit(main())
    ''')


def _lines(source: str, *fragments: str) -> set[int]:
    return {n for n, line in enumerate(source.splitlines(), 1) if any(f in line for f in fragments)}


def test_the_tracer_sees_what_ran_and_the_reduction_keeps_only_that_before_the_shared_part(tmp_path: Path) -> None:
    folder = tmp_path / "finding"
    folder.mkdir()
    script = folder / "standalone.py"
    script.write_text(SCRIPT)
    checked, executed = traced_check(script, 60)
    assert checked.exit_code == 1 and "v: 4" in checked.output, checked.output
    ran = {SCRIPT.splitlines()[n - 1].strip() for n in executed}
    assert {"value = helper(2)", "return 2 * x", 'print("small")'} <= ran
    assert not {"value = helper(1)", "return x + 1", 'print("big")', 'print("never")'} & ran

    reduced = reduce_source(SCRIPT, executed)
    compile(reduced, "reduced", "exec")
    # every docstring but the script's own goes, and so does the guard that always held (`elif … == "b"`)
    for gone in ("never_called", "helper(1)", '"big"', "UNUSED", "import json", "Doubles x", '"a"', 'case["kind"]',
                 "else:", "Kept whole"):
        assert gone not in reduced, (gone, reduced)
    for kept in ('"""What the script shows."""', "\n    value = helper(2)\n", '\n    print("small")\n',
                 'print("never")', "import os, sys"):  # the shared part's code is never pruned
        assert kept in reduced, (kept, reduced)
    # and it runs, printing what the full script printed
    script.write_text(reduced)
    again, _ = traced_check(script, 60)
    assert again.exit_code == 1 and same_bug(checked.output, again.output)


def test_the_ranks_import_only_what_the_reduced_script_still_imports() -> None:
    """A branch removed takes its library out of RANK_IMPORTS (a timm model's script, the transformers its kind's other
    branch builds with); what the code left imports, anywhere in it, stays, in its order."""
    source = ("RANK_IMPORTS = ('timm', 'transformers', 'torch.distributed', 'torch.multiprocessing')\n"
              "def build():\n    import timm\n    return timm\n"
              "def start():\n    import torch.multiprocessing as mp\n    from torch.distributed import barrier\n")
    narrowed = narrow_rank_imports(source)
    assert narrowed.splitlines()[0] == "RANK_IMPORTS = ('timm', 'torch.distributed', 'torch.multiprocessing')"
    assert narrowed.splitlines()[1:] == source.splitlines()[1:]
    assert narrow_rank_imports("x = 1\n") == "x = 1\n"  # a script without the tuple is left as it is


def test_an_else_taken_replaces_its_if_and_a_block_left_empty_keeps_a_pass() -> None:
    source = textwrap.dedent('''\
        def f(flag):
            if flag:
                a = 1
                return a
            else:
                b = 2
                return b

        def g():
            for _ in range(0):
                x = 1
            return 0

        def h(flag):
            if flag:
                y = 1
        ''')
    executed = _lines(source, "def f", "if flag", "b = 2", "return b", "def g", "for _", "return 0", "def h", "if flag")
    reduced = prune_unexecuted(source, executed)
    assert "if flag" not in reduced and "a = 1" not in reduced and "y = 1" not in reduced
    assert "\n    b = 2\n    return b\n" in reduced  # moved out one level
    assert "for _" not in reduced and "x = 1" not in reduced  # a loop that never iterated goes
    assert "def h(flag):\n    pass\n" in reduced  # its one statement never ran: a pass holds the block
    compile(reduced, "reduced", "exec")


def test_a_guard_that_always_held_a_try_that_caught_nothing_and_a_function_only_what_went_named_go() -> None:
    """What ran of a script, less the `if` whose `else` never ran (its test always held), the `try` none of whose
    handlers ran, and a local function that only a statement that never ran named; a walrus in a test keeps it."""
    source = textwrap.dedent('''\
        def f(n):
            def later(x):
                return x

            if n > 0:
                m = n
            else:
                m = 0
            try:
                m += 1
            except ValueError:
                m = -1
            else:
                m += 2
            if (k := m) > 0:
                m = k
            else:
                m = later(m)
            return m

        print(f(3))
        ''')
    never = ("return x", "m = 0", "m = -1", "m = later(m)")
    executed = _lines(source, "def f", "if n > 0", "m = n", "try:", "m += 1", "m += 2", "if (k", "m = k", "return m",
                      "print(f(3))")
    executed -= _lines(source, *never)
    reduced = reduce_source(source, executed)
    assert reduced == textwrap.dedent('''\
        def f(n):
            m = n
            m += 1
            m += 2
            if (k := m) > 0:
                m = k
            return m

        print(f(3))
        '''), reduced
    namespace: dict[str, Any] = {"print": lambda value: None}
    exec(compile(reduced, "reduced", "exec"), namespace)
    assert namespace["f"](3) == 6


def test_a_definition_named_on_the_line_that_failed_stays_though_it_never_ran() -> None:
    """A failure's trace: the line `out = shape(lookup(x))` ran, `lookup` raised, `shape` was never called; removing
    `shape` would leave a NameError where the library's exception was."""
    source = textwrap.dedent('''\
        def shape(values):
            return helper(values)

        def helper(values):
            return values

        def unused():
            return 0

        def main(x):
            out = shape(lookup(x))
            return out
        ''')
    executed = _lines(source, "def main", "out = shape")
    reduced = prune_unexecuted(source, executed)
    assert "def shape" in reduced and "def helper" in reduced  # named by what stays, and what that names
    assert "def unused" not in reduced
    compile(reduced, "reduced", "exec")


def test_a_local_function_registered_to_run_after_the_failure_stays_though_it_never_ran() -> None:
    """A gradient hook defined inside a function and registered before the forward fails: it never ran, but the
    registration names it (a tensor-parallel script's reduction once lost it, and the reduced script raised NameError
    instead of the library's exception)."""
    source = textwrap.dedent('''\
        def distribute(module):
            def whole_gradient(parameter):
                parameter.grad = parameter.grad.full_tensor()

            def never_named(parameter):
                return parameter

            module.register_hook(whole_gradient)
            return module
        ''')
    executed = _lines(source, "def distribute", "def whole_gradient", "def never_named", "module.register_hook",
                      "return module")
    reduced = prune_unexecuted(source, executed)
    assert "def whole_gradient" in reduced and "full_tensor" in reduced
    assert "def never_named" not in reduced
    compile(reduced, "reduced", "exec")


def test_unused_definitions_go_until_none_is_left_and_docstrings_but_the_scripts_own() -> None:
    source = '"""Own."""\nimport a, b\nfrom c import d, e\n\ndef f():\n    """Doc."""\n    return g()\n\n' \
             'def g():\n    return d\n\ndef h():\n    return h()\n\nprint(b)\n'
    reduced = drop_unused(drop_docstrings(source))
    # f is unused, then g (only f called it), then d (only g read it); h only calls itself; a and e nobody reads
    assert reduced.split() == ['"""Own."""', "import", "b", "print(b)"], reduced


def test_the_same_bug_is_the_same_verdict_lines_to_the_digits_printed() -> None:
    original = ("python 3.11.7, torch 2.14.1\nnoise from a library\n"
                "pooled.tf0: 3 of 8 elements off, 2.1x what rounding explains; at (0, 1) single process 0.5, "
                "setting 0.25, float64 0.5\nBUG PRESENT: the setting disagrees with the single-process program\n")
    assert same_bug(original, original.replace("noise from a library", "other noise").replace("3.11.7", "3.12"))
    assert not same_bug(original, original.replace("setting 0.25", "setting 0.26"))
    assert not same_bug(original, original.replace("BUG PRESENT: the setting disagrees with the single-process "
                                                    "program", "ok: the setting agrees"))


def test_a_class_keeps_only_the_methods_and_branches_its_case_ran_and_idle_loops_go() -> None:
    source = textwrap.dedent('''\
        class Schedule:
            def __init__(self, flag):
                if flag:
                    self.a = 1
                else:
                    self.a = 2

            def step(self):
                return self.a

            def eval(self):
                return -self.a

        def freeze(names, frozen):
            for name in names:
                if name in frozen:
                    print(name)
            return names

        print(Schedule(True).step(), freeze(["w"], []))
        ''')
    executed = _lines(source, "class Schedule", "def __init__", "if flag", "self.a = 1", "def step", "return self.a",
                      "def eval", "def freeze", "for name", "if name in", "return names",
                      "print(Schedule")
    reduced = reduce_source(source, executed)
    compile(reduced, "reduced", "exec")
    assert "def eval" not in reduced and "self.a = 2" not in reduced and "else" not in reduced
    assert "def step" in reduced and "self.a = 1" in reduced
    # the loop's one statement never held for this case: the loop did nothing and goes with it
    assert "for name" not in reduced and "print(name)" not in reduced and "return names" in reduced


def _distributed_script(on_rank: list[str], constants: list[str], entry: str) -> str:
    """A script of the runtime's own shared part (what every emitted script ends with) around `on_rank`."""
    import inspect

    from difftest.contracts import script_runtime as standalone_runtime
    from difftest.scripts.emit import RUNTIME_IMPORTS

    shared = [textwrap.dedent(inspect.getsource(getattr(standalone_runtime, name))) for name in
              ("gloo_on_loopback", "rank_main", "run_distributed", "start_ranks", "judge", "load_data", entry)]
    return "\n".join([
        '"""A finding."""', *RUNTIME_IMPORTS, "", "LIBRARIES = ('numpy',)", "THE_CASE = 'a case'", "WORLD_SIZE = 2", "RANK_IMPORTS = ()",
        *constants, "CASE = {}", "", *on_rank, "",
        SHARED_MARKER + ": start the ranks, judge, report ---", *shared,
        "if __name__ == '__main__':", f"    sys.exit({entry}())", ""])


def test_a_disagreements_script_whose_ranks_return_nothing_could_not_run(tmp_path: Path) -> None:
    """No tensors from rank 0 is no verdict (exit 2), never "BUG PRESENT" from judging empty arrays."""
    from difftest.scripts.check import check_script

    script = _distributed_script(
        ["def on_rank(rank, world_size, data, case):", "    return None", "",
         "def single_process(data, case, dtype):", "    return {'x': np.ones(2)}"],
        ["TENSORS = ('x',)", "SPREAD = {}", "K = 4.0", "ATOL, RTOL = 1e-5, 1e-5"], "main")
    folder = tmp_path / "finding"
    folder.mkdir()
    (folder / "standalone.py").write_text(script)
    np.savez(folder / "standalone.npz", unused=np.zeros(1))
    checked = check_script(folder / "standalone.py", 120)
    assert checked.exit_code == 2 and "COULD NOT RUN" in checked.output, checked.output


def test_a_failures_reduced_script_still_exits_0_once_the_failure_is_gone(tmp_path: Path) -> None:
    """A failure's script traced while the bug is present runs nothing after the failing call, so reduction removes
    what the ranks do after it (their outputs among it); the reduced script must still say "ok", exit 0, on a release
    where the call no longer fails (stood for by an environment variable here)."""
    script = _distributed_script(
        ["def on_rank(rank, world_size, data, case):",
         "    if os.environ.get('LIBRARY_BUG'):",
         "        raise ValueError('the library refuses')",
         "    outputs = {'x': np.ones(2)}",
         "    return outputs if rank == 0 else None"],
        ["FAILURE = 'ValueError: the library refuses'"], "main_failing")
    folder = tmp_path / "finding"
    folder.mkdir()
    path = folder / "standalone.py"
    path.write_text(script)
    np.savez(folder / "standalone.npz", unused=np.zeros(1))
    bug = {**os.environ, "LIBRARY_BUG": "1"}
    checked, executed = traced_check(path, 120, env=bug)
    assert checked.exit_code == 1 and "BUG PRESENT" in checked.output, checked.output
    reduced = reduce_source(script, executed)
    assert "outputs = {'x'" not in reduced  # never ran while the bug was present
    path.write_text(reduced)
    from difftest.scripts.check import check_script

    assert check_script(path, 120, env=bug).exit_code == 1
    fixed = check_script(path, 120, env={k: v for k, v in os.environ.items() if k != "LIBRARY_BUG"})
    assert fixed.exit_code == 0 and "ok: the setting runs through" in fixed.output, fixed.output


def test_a_reducer_that_fails_keeps_the_full_script_and_a_check_that_fails_is_that_findings_defect_alone(
        tmp_path: Path, monkeypatch) -> None:
    """The reducer and the check are difftest's code: their failing (on 3.11, a parse in one thread beside another
    once raised "AST constructor recursion depth mismatch") is told on that finding, and the run goes on."""
    from difftest.scripts import reduce, write

    folder = tmp_path / "finding"
    folder.mkdir()
    script = folder / "standalone.py"
    script.write_text(SCRIPT)
    checked, executed = traced_check(script, 60)

    def broken(source: str, executed: set[int]) -> str:
        raise SystemError("AST constructor recursion depth mismatch (before=33, after=67)")

    monkeypatch.setattr(reduce, "reduce_source", broken)
    reduction, kept = reduce.reduce_script(script, checked, executed, 60)
    assert not reduction.kept and "the reducer failed, a defect of difftest's: SystemError" in reduction.why_not
    assert script.read_text() == SCRIPT and kept is checked  # the full script stands

    def no_tracer(*args: object, **kwargs: object) -> None:
        raise OSError("no such interpreter")

    monkeypatch.setattr(reduce, "traced_check", no_tracer)
    done = write._check(write.Emitted("F1", "family", script), 60)
    assert done.our_defect and done.checked is None
    said = (folder / "standalone.txt").read_text()
    assert said.startswith("standalone.py written, not checked: a defect of difftest's: OSError: no such interpreter")


SHRINKABLE = textwrap.dedent(f'''\
    """What the script shows."""
    import sys

    def scale(x):
        return x * 2

    def compute(x):
        # a comment about the padding below, which goes with it
        padding = sum(range(10))
        if x > 0:
            x = scale(x)
        print("a line of the library's, not a verdict")
        with open(__file__):
            x = x + 1
        return x

    {SHARED_MARKER}: start the ranks, judge, report ---
    def main():
        value = compute(3)
        print(f"t: 1 of 1 elements off, 9.9x what rounding explains; at (0,) single process 3.0, setting {{value}}")
        print("BUG PRESENT: the setting disagrees with the single-process program")
        return 1

    if __name__ == "__main__":
        sys.exit(main())
    ''')


def test_trials_remove_what_the_verdict_does_not_need_and_keep_what_changes_it(tmp_path: Path) -> None:
    """Deleting the padding, the chatter and its comment, and unwrapping the `if` and the `with`, leave the verdict
    line as it was: kept. Deleting the doubling or the increment changes the value printed: not kept. The part every
    script shares is the same text after the trials."""
    from difftest.scripts.shrink import shrink

    folder = tmp_path / "finding"
    folder.mkdir()
    script = folder / "standalone.py"
    script.write_text(SHRINKABLE)
    original = script.read_text()
    checked, _ = traced_check(script, 60)
    assert checked.exit_code == 1 and "setting 7" in checked.output, checked.output
    result = shrink(script, checked.output, budget_s=120, timeout_s=60)
    shrunk = script.read_text()
    assert "padding" not in shrunk and "a comment about" not in shrunk and "library's" not in shrunk, shrunk
    assert "if x > 0" not in shrunk and "with open" not in shrunk, shrunk
    assert "x = scale(x)" in shrunk and "x = x + 1" in shrunk and "return x * 2" in shrunk, shrunk
    marker = original.index(SHARED_MARKER)
    assert shrunk.endswith(original[marker:])
    assert result.kept == 4 and result.lines_after == result.lines_before - 5, result
    assert same_bug(checked.output, traced_check(script, 60)[0].output)


def test_with_a_shrink_budget_a_scripts_trace_and_trials_share_one_lent_server(tmp_path: Path) -> None:
    """A run's check traces a script and shrinks it by trials in one server lent by `TraceServers` (the libraries'
    import paid once, not once for the trace and again for the trials), returns it, and the next script's check
    borrows the same server: two scripts shrunk, one server started; the trials' result is the one a server of
    their own gives."""
    from difftest.scripts.shrink import TrialServer
    from difftest.scripts.write import Emitted, TraceServers, _check

    started: list[Path] = []
    start = TrialServer.__init__

    def counted(self: TrialServer, script: Path, *args: Any, **kwargs: Any) -> None:
        started.append(script)
        start(self, script, *args, **kwargs)

    servers = TraceServers()
    try:
        with patch.object(TrialServer, "__init__", counted):
            for number in (1, 2):
                script = tmp_path / f"finding{number}" / "standalone.py"
                script.parent.mkdir()
                script.write_text(SHRINKABLE)
                done = _check(Emitted(f"F{number}", "family", script), 60, shrink_budget_s=120, servers=servers)
                assert done.checked is not None and done.checked.reproduces and not done.defect, done
                assert done.reduction is not None and done.reduction.kept, done.reduction
                # the trace took the guard that always held, the trials the padding, the chatter and the `with`
                assert done.reduction.kept_edits == 3 and not done.reduction.trials_failed, done.reduction
                assert "padding" not in script.read_text() and "x > 0" not in script.read_text()
                assert "x = x + 1" in script.read_text() and "with open" not in script.read_text()
                assert len(started) == 1 and len(servers._idle) == 1, (started, servers._idle)
        # a server that dies while lent (a trial's failure is told in its finding, not raised) is not lent again
        with servers.lease(script) as server:
            assert server is not None
            server._process.kill()
            server._process.wait()
        assert servers.stopped and not servers._idle
    finally:
        servers.close()


def test_an_edit_that_leaves_a_name_undefined_is_never_run() -> None:
    from difftest.scripts.shrink import undefined_names

    assert undefined_names("def f():\n    return g()\n") == {"g"}
    assert undefined_names("import os\nfrom a import b as c\ndef f(x, *a, k=1, **kw):\n    try:\n        pass\n"
                           "    except E as e:\n        return os, c, x, a, k, kw, e, len, [y for y in x]\n") == {"E"}


def test_each_copy_of_a_repeated_statement_is_its_own_candidate_and_an_elif_is_never_unwrapped() -> None:
    from difftest.scripts.shrink import candidates

    source = textwrap.dedent(f'''\
        def f(x):
            wait()
            wait()
            if x:
                a()
            elif x > 1:
                b()
            return x

        {SHARED_MARKER}: start the ranks, judge, report ---
        ''')
    keys = [key for key, _ in candidates(source)]
    assert sum(key.startswith("delete\n    wait()") for key in keys) == 2
    assert not any(key.startswith(("unwrap\n    elif", "unwrap\n    if x:")) for key in keys)  # an `if` with an `elif`
    assert any(key.startswith("delete\n        b()") for key in keys)


def test_a_shared_fork_server_traces_as_a_fresh_run_does_and_a_fresh_run_has_the_last_word(tmp_path: Path) -> None:
    """A run's checks trace torch-stack (and ONNX-converter) scripts in forks of servers that imported their libraries once
    (`TraceServers`): the same output and executed lines as a fresh traced run; a script of other libraries is left to
    a fresh run; and what a finding records is a fresh interpreter's verdict, even where the fork showed the bug."""
    from difftest.scripts.write import Emitted, TraceServers, _check

    folder = tmp_path / "finding"
    folder.mkdir()
    script = folder / "standalone.py"
    script.write_text(SCRIPT)
    servers = TraceServers()
    try:
        forked = servers.trace(script, 60)
        assert forked is not None
        fresh = traced_check(script, 60)
        assert forked[0].exit_code == fresh[0].exit_code == 1 and same_bug(fresh[0].output, forked[0].output)
        assert forked[1] == fresh[1]
        other = folder.parent / "other" / "standalone.py"
        other.parent.mkdir()
        other.write_text("import tensorflow\n" + SCRIPT)
        assert servers.trace(other, 60) is None  # not a library to fork after
        converted = folder.parent / "converted" / "standalone.py"  # a converted Keras model's: the ONNX stack forks
        converted.parent.mkdir()
        converted.write_text(SCRIPT.replace("import json\n", "import json\nimport onnx, onnx2torch, onnxruntime\n"))
        assert "import onnx," in converted.read_text()
        in_fork = servers.trace(converted, 60)
        assert in_fork is not None and in_fork[0].reproduces

        # the bug shows only where numpy was imported before the script's own import: in the server's fork
        only_in_a_fork = folder.parent / "fork" / "standalone.py"
        only_in_a_fork.parent.mkdir()
        forked_line = "import json\nFORKED = 'numpy' in sys.modules\nimport numpy\n"
        only_in_a_fork.write_text(SCRIPT.replace("import json\n", forked_line)
                                  .replace('    print("BUG PRESENT: yes")\n    return 1',
                                           '    if not FORKED:\n        print("ok")\n        return 0\n'
                                           '    print("BUG PRESENT: yes")\n    return 1'))
        assert "if not FORKED" in only_in_a_fork.read_text()
        assert servers.trace(only_in_a_fork, 60)[0].reproduces  # type: ignore[index]
        done = _check(Emitted("F1", "family", only_in_a_fork), 60, servers=servers)
        assert done.checked is not None and done.checked.exit_code == 0 and "ok" in done.checked.output
        assert done.reduction is not None and not done.reduction.kept
        assert done.reduction.why_not.startswith("the reduced script did not show the same bug")
        assert only_in_a_fork.read_text() == only_in_a_fork.with_name("standalone.full.py").read_text()
        # and where the fork and a fresh run agree, the reduced script is kept, its fresh check standing for it
        done = _check(Emitted("F2", "family", script), 60, servers=servers)
        assert done.checked is not None and done.checked.reproduces and done.reduction is not None
        assert done.reduction.kept and "never_called" not in script.read_text()
        # a script whose every line ran has nothing to remove: its fresh check stands for it, not the fork's run
        whole = folder.parent / "whole" / "standalone.py"
        whole.parent.mkdir()
        whole.write_text(f'import sys\n\n{SHARED_MARKER}: start the ranks, judge, report ---\n'
                         'print("BUG PRESENT: yes")\nsys.exit(1)\n')
        done = _check(Emitted("F4", "family", whole), 60, servers=servers)
        assert done.reduction is not None and done.reduction.why_not == "nothing it does not run", done.reduction
        assert done.checked is not None and done.checked.reproduces and done.checked.seconds > 0.01
        # a server that stops ends forking for the run: its scripts then run fresh, as they do without servers
        assert len(servers._idle) == 1
        servers._idle[0]._process.kill()
        again = folder.parent / "again" / "standalone.py"
        again.parent.mkdir()
        again.write_text(SCRIPT)
        assert servers.trace(again, 60) is None and servers.trace(again, 60) is None
        done = _check(Emitted("F3", "family", again), 60, servers=servers)
        assert done.checked is not None and done.checked.reproduces and not done.defect
        assert done.reduction is not None and done.reduction.kept
    finally:
        servers.close()


def test_the_engine_parses_python_only_under_one_lock() -> None:
    """Scripts are written, checked and reduced in threads, and CPython 3.11 cannot build two parses' syntax trees at
    once (python/cpython#106905: "AST constructor recursion depth mismatch", which ended a finding's check in CI):
    every parse of source text in the engine goes through `difftest.contracts.syntax` (`parse`, `literal`, `source_of`:
    `inspect.getsource` of a class parses its module), which holds one lock. `ast.literal_eval` of a node already
    parsed parses nothing and is allowed."""
    import ast

    engine = Path(__file__).resolve().parents[1] / "difftest"
    unlocked = []
    for path in sorted(engine.rglob("*.py")):
        if path.name == "syntax.py" and path.parent.name == "contracts":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ast"
                    and node.func.attr in ("parse", "literal_eval")
                    and not (node.func.attr == "literal_eval" and node.args and isinstance(node.args[0], ast.Attribute))):
                unlocked.append(f"{path.relative_to(engine.parent)}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "inspect"
                    and node.func.attr in ("getsource", "getsourcelines", "findsource")):
                unlocked.append(f"{path.relative_to(engine.parent)}:{node.lineno}")
    assert not unlocked, unlocked


# shapes the line-level reduction once got wrong (a review's findings): each function prints what it computed, and the
# reduced script must print the same
TRICKY = textwrap.dedent('''\
    import functools

    def chain(kind):
        if kind == "a":
            r = "A"
        elif kind == "b":
            r = "B"
        else:
            raise ValueError(kind)
        return r

    def decorated(x):
        if x:
            @functools.lru_cache
            def g():
                return 1
        g()
        return g.cache_info().hits

    def counted(items):
        count = 0
        for _ in items:
            count += 1
        spare = [1, 2]
        del spare
        return "counted"

    def early(x):
        if x: return "early"
        return "late"

    def text():
        if True:
            message = """kept:

        as written"""
        return repr(message)

    def failing(d):
        try:
            value = d["missing"]
        except KeyError:
            return "raised"
        return "no"

    for result in (chain("a"), chain("b"), decorated(1), counted([1]), early(1), text(), failing({})):
        print(result)
    ''')


def test_a_reduced_script_computes_what_the_whole_one_did_on_shapes_reduction_once_got_wrong(tmp_path: Path) -> None:
    import subprocess
    import sys

    from difftest.scripts.reduce import _TRACER, traced_lines

    script, tracer, out = tmp_path / "script.py", tmp_path / "tracer.py", tmp_path / "lines"
    script.write_text(TRICKY)
    tracer.write_text(_TRACER)
    out.mkdir()
    whole = subprocess.run([sys.executable, str(tracer), str(script), str(out)], capture_output=True, text=True)
    assert whole.returncode == 0 and whole.stdout.splitlines()[:2] == ["A", "B"], whole.stderr
    executed = traced_lines(out)
    assert executed.arcs, "the tracer records arcs beside lines"
    reduced = reduce_source(TRICKY, executed)
    script.write_text(reduced)
    again = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert again.stdout == whole.stdout, reduced
    assert "raise ValueError(kind)" not in reduced and "elif kind" in reduced  # the else that never ran goes alone
