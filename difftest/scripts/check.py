"""Running a standalone script as a maintainer would: from another folder, sealed (difftest's own packages do not
import), killed with its ranks past a timeout; and what it printed of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from difftest.contracts.script import BUG_PRESENT
from difftest.storage.paths import absolute


@dataclass(frozen=True)
class Checked:
    """What running an emitted script printed."""

    exit_code: int
    seconds: float
    output: str

    @property
    def reproduces(self) -> bool:
        return self.exit_code == 1 and BUG_PRESENT in self.output


def check_script(path: Path, timeout_s: float = 120.0, python: str = sys.executable,
                 env: dict[str, str] | None = None, niceness: int = 0, runner: list[str] | None = None,
                 arguments: list[str] | None = None) -> Checked:
    """Run a script the way a maintainer would (its own folder is not the current one) and keep what it said. With a
    `niceness`, the script and the ranks it starts (they inherit it) run at that lower priority. A script past its
    timeout is killed with every process it started. `runner`: a program that runs the script (a tracer), given the
    script's path and then `arguments`."""
    started = time.perf_counter()
    path = absolute(path)  # it runs from another folder: a path relative to this one would name another file
    command = [python, *(runner or []), str(path), *(arguments or [])]
    with subprocess.Popen(command, cwd=path.parent.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True) as process:
        if niceness:
            try:  # before its imports are done, so before it forks its ranks
                os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
            except (OSError, AttributeError):  # not POSIX, or gone already: it runs at normal priority
                pass
        try:
            output, _ = process.communicate(timeout=timeout_s)
            code, output = process.returncode, output.strip()
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its ranks too: they are in its session
            partial, _ = process.communicate()
            code, output = 124, f"timed out after {timeout_s:.0f} s: {partial}"
    return Checked(code, time.perf_counter() - started, output)


def sealed_environment(folder: Path) -> dict[str, str]:
    """The environment of a process (and of the ranks it spawns) in which difftest's own packages do not import:
    a `sitecustomize` on PYTHONPATH refuses them, so a script that needed them fails as it would elsewhere."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent('''\
        import importlib.abc, sys

        class _Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("difftest", "generators", "settings"):
                    raise ModuleNotFoundError(f"No module named {name!r} (a standalone script must not need it)")
                return None

        sys.meta_path.insert(0, _Refuse())
        '''))
    return {**os.environ, "PYTHONPATH": str(folder)}


# what a script prints of its own (`difftest.contracts.script_runtime`), among its libraries' warnings and its ranks' output
_OWN_LINE = re.compile(r"^(python \d|case: |\S+: (\d+ of \d+ elements (off|differ)|the setting gives shape|shape .* in the first run|"
                       r"the same in both runs)|BUG PRESENT|ok: |COULD NOT RUN)")
AGREEING_LINE = re.compile(r": (0 of \d+ elements off|the same in both runs)")


def own_lines(output: str) -> list[str]:
    """The lines a script printed itself: the releases, the case, each compared tensor's verdict, how the setting failed (the
    line before a failure's BUG PRESENT) and the verdict; a finding's report quotes them."""
    lines = output.splitlines()
    return [line for i, line in enumerate(lines) if _OWN_LINE.match(line) or (
        i + 1 < len(lines) and lines[i + 1].startswith(f"{BUG_PRESENT}: the setting fails"))]
