"""`difftest bisect RUN FINDING --torch 2.6.0..2.14.1`: since which release does a finding reproduce, and is it fixed?

Each release's environment (`difftest.releases.environments.environment`: torch with the fbgemm-gpu and torchrec built for it, made
once and cached) runs the finding's own `findings/<id>/repro.py`: its minimal case, through this checkout's engine,
against what it is judged against. The script's exit code says what happened there. A local build or a nightly is a
path to its python instead of a release. With `standalone`, the finding's `standalone.py` runs instead: it needs no
difftest, so any python with torch and the finding's libraries can be a target.
"""

from __future__ import annotations

import enum
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from difftest.contracts.errors import UserError
from difftest.releases.environments import EnvironmentUnavailable, Release, environment, installed, release_range
from difftest.storage.paths import absolute


class Outcome(enum.StrEnum):
    REPRODUCES = "reproduces"
    OK = "ok"
    DIFFERENT = "fails differently"
    UNSUPPORTED = "unsupported"
    NOT_INSTALLABLE = "not installable"
    COULD_NOT_RUN = "could not run"


# findings/<id>/repro.py's exit codes (difftest.findings.repro.REPRO_SCRIPT)
EXIT_CODES = {1: Outcome.REPRODUCES, 0: Outcome.OK, 3: Outcome.DIFFERENT, 4: Outcome.UNSUPPORTED}


@dataclass(frozen=True)
class Target:
    label: str
    release: Release | None = None  # None: a python given by path (a local build, a nightly)
    python: Path | None = None


@dataclass(frozen=True)
class Step:
    target: str
    stack: str  # "torch 2.10.0+cu128, torchrec 1.5.1, fbgemm-gpu-cpu 1.5.0" as that python reports it
    outcome: Outcome
    detail: str
    seconds: float


def targets(spec: str) -> list[Target]:
    """`2.6.0..2.14.1`, `2.8,2.10`, or items that are paths to a python (`~/nightly/bin/python`), in the order given."""
    found: list[Target] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if "/" in item:
            python = Path(item).expanduser()
            if not python.is_file():
                raise UserError(f"--torch {item}: no such python; give a release (2.10.0), a range (2.6.0..2.14.1) "
                                "or the path to a python that has torch")
            found.append(Target(str(python), python=python))
        else:
            found.extend(Target(r.torch, release=r) for r in release_range(item))
    if not found:
        raise UserError("--torch names no release; e.g. --torch 2.6.0..2.14.1")
    return found


_STACK_PROBE = """
import json
from importlib import metadata
import torch
found = {"torch": torch.__version__}
for name in ("torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(found))
"""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# seconds a finding's reproducer may take on one release (it builds its own ranks; on an old release, first imports)
REPRODUCER_TIMEOUT_S = 600.0


def probe(python: Path, script: Path, timeout_s: float, standalone: bool = False) -> tuple[str, Outcome, str]:
    """(stack, outcome, one line of detail) of the finding's script (`repro.py`, or `standalone.py`) run by `python`."""
    asked = subprocess.run([str(python), "-c", _STACK_PROBE], capture_output=True, text=True, timeout=120)
    if asked.returncode != 0:
        return "", Outcome.COULD_NOT_RUN, f"torch does not import: {_last_line(asked.stderr)}"
    stack = ", ".join(f"{k} {v}" for k, v in json.loads(asked.stdout.strip().splitlines()[-1]).items())
    script = absolute(script)  # it runs from its own folder: a relative path would name another file
    try:
        done = subprocess.run([str(python), str(script)], capture_output=True, text=True, timeout=timeout_s,
                              cwd=script.parent)
    except subprocess.TimeoutExpired:
        return stack, Outcome.COULD_NOT_RUN, f"no answer within {timeout_s:.0f}s"
    printed = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if standalone:
        return (stack, *_standalone_outcome(done.returncode, printed, done.stderr))
    outcome = EXIT_CODES.get(done.returncode, Outcome.COULD_NOT_RUN)
    if outcome is Outcome.COULD_NOT_RUN:
        return stack, outcome, f"exit {done.returncode}: {_last_line(done.stderr) or _last_line(done.stdout)}"
    if outcome is Outcome.OK and printed and printed[0].endswith(": unsupported"):
        outcome = Outcome.UNSUPPORTED  # a script written before exit code 4 existed says so only in its first line
    # describe()'s lines: the verdict, the worst tensor and what the calibrated oracle made of it, or the message (an
    # unsupported case's reason)
    useful = [line for line in printed[1:] if not line.startswith(("signature:", "the finding reproduces", "at its"))]
    return stack, outcome, (" · ".join(useful[:2]) if useful else printed[0] if printed else "")[:400]


def _standalone_outcome(code: int, printed: list[str], stderr: str) -> tuple[Outcome, str]:
    """What a `standalone.py` said: exit 1 with BUG PRESENT, exit 0, or anything else (it could not run the setting,
    the setting failed another way, or the script failed on its own: exit 2)."""
    from difftest.contracts.script import BUG_PRESENT

    off = next((line for line in printed if " elements off" in line and not line.split(": ", 1)[-1].startswith("0 of")),
               "")
    last = printed[-1] if printed else ""
    if code == 1 and any(line.startswith(BUG_PRESENT) for line in printed):
        return Outcome.REPRODUCES, " · ".join(filter(None, (off, last)))[:400]
    if code == 0:
        return Outcome.OK, last[:400]
    return Outcome.COULD_NOT_RUN, f"exit {code}: {last if code == 2 and last else _last_line(stderr) or last}"[:400]


def bisect(run_dir: Path, finding: str, spec: str, cache: Path | None = None, timeout_s: float = REPRODUCER_TIMEOUT_S,
           log: Callable[[str], None] = lambda _: None, on_step: Callable[[Step], None] = lambda _: None,
           standalone: bool = False) -> list[Step]:
    from difftest.storage.integrity import check_models

    check_models(Path(run_dir))
    folder = Path(run_dir) / "findings" / finding
    script = folder / ("standalone.py" if standalone else "repro.py")
    if not script.is_file():
        if standalone and (folder / "standalone.txt").is_file():
            raise UserError(f"{finding}: {(folder / 'standalone.txt').read_text().splitlines()[0]}; bisect its "
                            "repro.py instead (leave out --standalone)")
        raise UserError(f"{script}: no such finding's reproducer; findings.csv in {run_dir} lists the findings "
                        "(run `difftest analyze` first if it has none)")
    steps = []
    for target in targets(spec):
        started = time.perf_counter()
        python = target.python
        if python is None and target.release is not None:
            try:
                python = Path(sys.executable) if installed(target.release) else \
                    environment(target.release, cache, log=log)
            except EnvironmentUnavailable as exc:
                step = Step(target.label, "", Outcome.NOT_INSTALLABLE, str(exc), time.perf_counter() - started)
                steps.append(step)
                on_step(step)
                continue
        assert python is not None
        stack, outcome, detail = probe(python, script, timeout_s, standalone)
        step = Step(target.label, stack, outcome, detail, time.perf_counter() - started)
        steps.append(step)
        on_step(step)
    return steps


def verdict(steps: list[Step]) -> str:
    """The first release where the finding reproduces, and the first after it where it is gone."""
    tested = [s for s in steps if s.outcome in (Outcome.REPRODUCES, Outcome.OK)]
    first = next((i for i, s in enumerate(tested) if s.outcome is Outcome.REPRODUCES), None)
    if first is None:
        return "the finding reproduces on none of the releases that ran"
    if first == 0:
        appears = f"reproduces on the oldest release that ran ({tested[0].target}): present since then or earlier"
    else:
        appears = f"first reproduces on {tested[first].target} (ok on {tested[first - 1].target})"
    gone = next((s for s in tested[first + 1:] if s.outcome is Outcome.OK), None)
    return appears + ("; " + (f"gone from {gone.target} on" if gone else "still present on the newest that ran"))
