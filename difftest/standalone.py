"""`findings/<id>/standalone.py`: a finding as a script a library maintainer runs without difftest.

The script imports only the libraries the finding involves. Its code is copied from difftest's own modules with
`inspect.getsource`, never written a second time: the setting's family supplies the library code it runs (its plan
helpers, its model's construction, `single_process` and `on_rank`, through `Setting.standalone`), this module the
runtime every script shares (`difftest.standalone_runtime`: start the ranks on loopback, judge, report, exit 1 while
the bug is present). The case's tensors go beside it as `standalone.npz`, its parameters into the script as literals,
and what difftest measured of its rounding noise (the calibrated envelope) as the tolerance the script judges by.

This module is what a setting's emitter needs; `difftest.standalone_findings` writes and runs the scripts of a run.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from difftest import standalone_runtime
from difftest.errors import Unsupported
from difftest.status import Status

if TYPE_CHECKING:
    from difftest.batch import Batch
    from difftest.generator import Generator
    from difftest.oracle import Tolerance
    from difftest.spec import ModelSpec

# in findings/<id>/: the script that reproduces the finding without difftest, and its first
# line: what running it gave, or why the finding has none
STANDALONE_FILE = "standalone.py"
BUG_PRESENT = "BUG PRESENT"  # what a script prints, beside exit 1, while the bug is present
STANDALONE_VERDICT_FILE = "standalone.txt"
DATA_FILE = "standalone.npz"
MAX_LINES = 500  # a script a maintainer reads through (the library code is copied whole, never condensed; the longest,
# a resume's of a converted Keras model from DDP to FSDP2, has 496 lines, a hybrid pipeline's on a whole DLRM-like
# model 483, a re-partitioned one's 467)
RUNTIME_IMPORTS = ("from __future__ import annotations", "",
                   "import contextlib, logging, os, re, socket, sys, tempfile, traceback, warnings",
                   "from importlib import metadata", "from pathlib import Path", "from typing import Any", "",
                   "# the libraries' warnings and log lines (every rank's) would bury the verdict: --verbose shows them",
                   'if "--verbose" not in sys.argv:',
                   '    warnings.filterwarnings("ignore")',
                   "    logging.disable(logging.WARNING)",
                   '    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")', "",
                   "import numpy as np", "import torch")


@dataclass(frozen=True)
class StandaloneCase:
    """What an emitter is given: a finding's (minimal) case and what difftest measured of it."""

    finding_id: str
    title: str
    status: str  # the finding's verdict
    spec: ModelSpec
    generator: Generator
    init_state: dict[str, np.ndarray]
    inputs: dict[str, Batch]  # "train" and "eval"
    first_divergence: str  # "<phase>/<tensor>", "" for a failure
    # per "<phase>/<tensor>": the largest distance from the float64 result legitimate float32 runs of the root reached
    spread: dict[str, float]
    tolerance: Tolerance
    local_world_size: int
    lr: float  # the run's learning rate (a training setting's script takes the same steps)
    # a failure finding's case: the message it was recorded with (an exception's text, "rank 0 killed by SIGFPE ...")
    message: str = ""
    model_dir: Path | None = None  # the case's model folder (files a generator wrote beside the weights)
    seed: int = 0  # the run's seed (a random stage split or sharding plan is drawn from it)
    steps: int = 1  # the run's training steps (a failure's script takes as many)
    # a nondeterminism finding's case (`rerun/…`): the script runs the setting twice, deterministic algorithms on, and
    # compares the two runs bit for bit instead of with one process
    twice: bool = False

    def against(self, reference: str) -> str:
        """A summary's clause on what the setting is compared with (`reference`: "<the program>: <what is compared>");
        a failure's script runs the setting alone, a nondeterminism's twice."""
        if self.failure:
            return ", alone: the script shows how it fails"
        if self.twice:
            return (", twice with torch.use_deterministic_algorithms(True), the second run compared with the first "
                    f"(equal, no tolerance): {reference.partition(': ')[2] or reference}")
        return f", against {reference}"

    @property
    def failure(self) -> str:
        """How the setting fails, as a regex over what torch.multiprocessing raises; "" for a disagreement."""
        return failure_pattern(self.status, self.message)


@dataclass(frozen=True)
class Script:
    """The setting's part of a standalone script."""

    summary: str  # what the script runs, a sentence for its docstring
    libraries: tuple[str, ...]  # the distributions whose releases it prints (pip names)
    preamble: tuple[str, ...]  # lines after the runtime's imports: the setting's own imports and module constants
    case: dict[str, Any]  # the parameters, a literal `CASE` the functions read
    # copied in this order; among them single_process and on_rank, and a function of the runtime's name that replaces
    # it (a resume's own run_distributed)
    functions: tuple[Callable[..., Any], ...]
    tensors: dict[str, str]  # the name each compared tensor has in the script → its "<phase>/<tensor>" in the run
    data: dict[str, np.ndarray] = field(default_factory=dict)
    world_size: int = 2
    # how the script's setting fails, where it raises the library's exception unwrapped (difftest's run recorded it
    # inside a wrapper of its own): None, the case's `failure`
    failure: str | None = None
    twice: bool = False  # run twice, the runs compared with each other (a nondeterminism's script: `main_twice`)


def refuse_changed_hooks(setting: Any, family: type, *hooks: str) -> None:
    """An emitter copies its family's module, not a subclass's code: a setting that overrides one of the family's
    hooks (a planted fault, a plugin's variant) runs what the script would not, and gets no script."""
    changed = [hook for hook in ("run", *hooks) if getattr(type(setting), hook) is not getattr(family, hook)]
    if changed:
        raise Unsupported(f"{type(setting).__name__} overrides {', '.join(changed)} of {family.__name__}, which the "
                          f"script, copied from {family.__name__}'s module, would not run")


_SIGNAL = re.compile(r"killed by (SIG[A-Z]+)")
# the exception's type and its words up to the first value (a digit, a bracket, a quote; an apostrophe inside a word,
# as in "can't", is a word's): `InvalidGraph: [ONNXRuntimeError] …` too
_EXCEPTION = re.compile(r"^(?:[\w.]*\.)?([A-Z]\w*): ((?:[^\d(\[{'\"|<]|(?<=[a-z])'(?=[a-z]))*)")


def failure_pattern(status: str, message: str) -> str:
    """A regex that what `torch.multiprocessing.start_processes` raises matches while the setting fails as recorded: the signal
    that killed a rank (`process 0 terminated with signal SIGFPE`), or the exception's type and its words before the
    first value (a minimised case fails with other sizes); "" for a disagreement. A failure it cannot tell (a
    timeout, a message without an exception type) is no script's."""
    if status not in (Status.ERROR, Status.CRASH, Status.TIMEOUT):  # a disagreement (or an ok case: the script shows it agree)
        return ""
    if status == Status.CRASH and (signal := _SIGNAL.search(message)):
        return rf"signal {signal[1]}\b"
    if status == Status.ERROR and (raised := _EXCEPTION.match(message.strip())):
        return re.escape(f"{raised[1]}: {raised[2].strip()}")
    raise Unsupported(f"its failure ({status}: {message[:80]!r}) is not one a script can recognise "
                      "(a timeout, or no exception type or signal in its message)")


_TYPE_IGNORE = re.compile(r"  # type: ignore\[[^]]*\]$", re.MULTILINE)


# the blank line isort leaves after a function's local imports, and a local import of what every script imports first
_AFTER_LOCAL_IMPORTS = re.compile(r"^(\s+(?:import|from) [^\n]+\n)\n(?=\s)", re.MULTILINE)
_IMPORTED_FIRST = re.compile(r"^\s+(?:import torch|import numpy as np)\n", re.MULTILINE)


def _source(function: Callable[..., Any]) -> str:
    """The function as its module has it, less mypy's comments (the script is not type-checked) and the blank line
    after its local imports, of which those of torch and numpy go (the script imports them first): its length is a
    promise, and the code is unchanged."""
    text = _TYPE_IGNORE.sub("", textwrap.dedent(inspect.getsource(function)))
    return _IMPORTED_FIRST.sub("", _AFTER_LOCAL_IMPORTS.sub(r"\1", text)).rstrip() + "\n"


def _literal(value: Any) -> str:
    """A Python literal of `value`, one line per element of a top-level list inside it (a table per line)."""
    if isinstance(value, dict):
        scalars = ", ".join(f"{k!r}: {v!r}" for k, v in value.items() if not isinstance(v, list))
        lists = [f"{k!r}: {_literal(v)}" for k, v in value.items() if isinstance(v, list)]
        return "{" + ",\n ".join(([scalars] if scalars else []) + lists) + "}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[\n    " + ",\n    ".join(repr(v) for v in value) + "]"
    return repr(value)


def render_script(case: StandaloneCase, script: Script) -> str:
    """The whole script: docstring, imports, constants, the setting's functions, the runtime."""
    tol = case.tolerance
    failure = case.failure if script.failure is None else script.failure
    doc = [f'"""{case.title}', "", *textwrap.wrap(script.summary, 116), "",
           f"Needs only {', '.join(script.libraries)}: `python {STANDALONE_FILE}` from any folder (its data is "
           f"{DATA_FILE} beside it; `--verbose` shows the libraries' warnings and logs).", "Exit status 1 while the bug is present, 0 once it is gone.",
           f"Generated by difftest from finding {case.finding_id}; the library code below is what difftest runs.",
           '"""']
    runtime = [getattr(standalone_runtime, name) for name in standalone_runtime.RUNTIME_FUNCTIONS]
    entry = "main_failing" if failure else "main_twice" if script.twice else "main"
    own = {f.__name__ for f in script.functions}  # a setting's own `run_distributed` replaces the runtime's
    sources = {f.__name__: _source(f) for f in (*script.functions, *(f for f in runtime if f.__name__ not in own))}
    called, names = _called_from(entry, sources)
    constants = [f"LIBRARIES = {tuple(script.libraries)!r}", f"WORLD_SIZE = {script.world_size}",
                 f"RANK_IMPORTS = {_local_imports(sources[name] for name in called)!r}"]
    if failure:
        constants.append(f"FAILURE = {failure!r}  # how the setting fails (what its ranks raise, or the signal)")
    elif script.twice:
        constants += [f"TENSORS = {tuple(script.tensors)!r}",
                      "# both runs as difftest ran them, in this process and in every rank (a spawned one runs this",
                      "# module again); an op without a deterministic kernel raises, which is not this bug",
                      "torch.use_deterministic_algorithms(True)"]
    else:
        constants += [
            f"TENSORS = {tuple(script.tensors)!r}",
            "# per tensor: how far legitimate float32 runs of the single-process program (other sample orders, thread counts)",
            f"# came from its float64 result, as difftest measured (spread.<tensor> in {DATA_FILE}); judge allows K times it",
            "SPREAD: dict[str, float] = {}",
            f"K = {_oracle_k()}",
            f"ATOL, RTOL = {tol.atol!r}, {tol.rtol!r}  # judges a tensor difftest did not calibrate"]
    constants.append(f"CASE = {_literal(script.case)}")
    preamble = script.preamble
    if "Unsupported" in names:  # difftest's refusal, by a name the script has
        preamble += ("", "Unsupported = NotImplementedError  # what cannot run here: the setting would be unsupported")
    parts = ["\n".join(doc), "\n".join(RUNTIME_IMPORTS + preamble), "\n".join(constants)]
    shared = {f.__name__ for f in runtime} - own
    parts += [text for name, text in sources.items() if name in called and name not in shared]
    # a reader after the bug stops here: what follows is the same in every script difftest writes
    parts += ["# --- the rest is what every difftest script shares: start the ranks, judge, report ---\n" +
              "\n\n".join(text.rstrip("\n") for name, text in sources.items() if name in called and name in shared)]
    # exit 1 means the bug and nothing else: the script failing on its own (a mistake of ours, a missing library) is 2
    parts.append(f'if __name__ == "__main__":\n    try:\n        sys.exit({entry}())\n    except Exception:  # the '
                 'script failing on its own, not the bug\n        sys.exit(traceback.print_exc() or 2)\n')
    # one blank line between definitions: the script is read top to bottom, and its length is a promise
    return "\n\n".join(part.rstrip("\n") for part in parts) + "\n"


def _called_from(entry: str, sources: dict[str, str]) -> tuple[set[str], set[str]]:
    """The definitions among `sources` that `entry` uses, itself included, directly or through others (by the names
    their code reads): a script holds what it runs, and the same code a finding of the other sort would not. Also
    every name those definitions read."""
    reads = {name: {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)} for name, text in sources.items()}
    called: set[str] = set()
    pending = [entry]
    while pending:
        if (name := pending.pop()) in reads and name not in called:
            called.add(name)
            pending.extend(reads[name])
    return called, {n for name in called for n in reads[name]}


def _local_imports(sources: Iterable[str]) -> tuple[str, ...]:
    """The modules the functions import where they run (the library code imports lazily), in order of appearance:
    what every rank would otherwise import again after the fork."""
    found: dict[str, None] = {}
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found.update(dict.fromkeys(alias.name for alias in node.names))
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module != "__future__":
                found[node.module] = None
    first = {node.module if isinstance(node, ast.ImportFrom) else alias.name
             for node in ast.walk(ast.parse("\n".join(RUNTIME_IMPORTS))) if isinstance(node, ast.Import | ast.ImportFrom)
             for alias in node.names}  # what every script imports at its top
    return tuple(name for name in found if name not in first)


def _oracle_k() -> float:
    from difftest.envelope import K

    return K


def write_script(folder: Path, case: StandaloneCase, script: Script) -> Path:
    """`standalone.py` and `standalone.npz` in `folder`; refuses a script longer than a maintainer reads."""
    text = render_script(case, script)
    lines = text.count("\n")
    if lines > MAX_LINES:
        raise Unsupported(f"the emitted script has {lines} lines, more than {MAX_LINES}")
    compile(text, STANDALONE_FILE, "exec")  # an emitter's mistake is ours: it fails here, never in a maintainer's hands
    spread = {f"spread.{name}": np.float64(case.spread[tensor]) for name, tensor in script.tensors.items()
              if tensor in case.spread}
    np.savez(folder / DATA_FILE, **script.data, **spread)  # type: ignore[arg-type]
    path = folder / STANDALONE_FILE
    path.write_text(text)
    return path
