"""What a setting's emitter is given and returns: a finding's case (`StandaloneCase`) and the setting's part of its
standalone script (`Script`), with the names of the files a finding's script lives in. `difftest.scripts.emit`
renders them into a script."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from difftest.contracts.errors import Unsupported
from difftest.contracts.status import Status

if TYPE_CHECKING:
    from difftest.contracts.batch import Batch
    from difftest.contracts.generator import Generator
    from difftest.contracts.spec import ModelSpec
    from difftest.contracts.tolerance import Tolerance

# in findings/<id>/: the script that reproduces the finding without difftest, and its first
# line: what running it gave, or why the finding has none
STANDALONE_FILE = "standalone.py"
BUG_PRESENT = "BUG PRESENT"  # what a script prints, beside exit 1, while the bug is present
STANDALONE_VERDICT_FILE = "standalone.txt"
DATA_FILE = "standalone.npz"

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
    setting: str = ""  # the setting's registered name, for the one line the script prints of its case

    def one_line(self, processes: int) -> str:
        """The case as the script prints it first: the setting, the model and its size, the processes."""
        # a user's model has no drawn structure, and its generator's size would build it again: its parameters say it
        drawn = {} if "user" in self.generator.traits else self.generator.size(self.spec)
        parameters = sum(int(np.prod(v.shape)) for v in self.init_state.values())
        size = ", ".join(f"{k} {v}" for k, v in drawn.items() if k != "parameters") or f"{parameters} parameters"
        return (f"{self.setting or 'the setting'} on {self.spec.model_id} ({size}), batch {self.inputs['train'].size}, "
                f"{processes} process{'es' if processes > 1 else ''}")

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


class SourceText:
    """A definition a script copies as text rather than from a function of difftest's (`inspect.getsource`): a
    statement of a user's own module (a class, a function, a constant), or a line that binds a user's callables. It
    stands in a `functions` tuple by the name it defines."""

    def __init__(self, name: str, text: str, also: tuple[str, ...] = ()) -> None:
        self.__name__ = name
        self.text = text
        self.also = also  # the other names it binds (`HIDDEN, DEPTH = 64, 4`): reading one needs it too

    def __repr__(self) -> str:
        return f"SourceText({self.__name__!r})"


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


# what `difftest.runner.processes.run_in_processes` wraps a process's own failure in: the failure is the process's
_IN_PROCESSES = re.compile(r"^ProcessesFailed: phase \S+ rank \d+ exited -?\d+: ")


def failure_pattern(status: str, message: str) -> str:
    """A regex that what `torch.multiprocessing.start_processes` raises matches while the setting fails as recorded: the signal
    that killed a rank (`process 0 terminated with signal SIGFPE`), or the exception's type and its words before the
    first value (a minimised case fails with other sizes); "" for a disagreement. A failure it cannot tell (a
    timeout, a message without an exception type) is no script's."""
    if status not in (Status.ERROR, Status.CRASH, Status.TIMEOUT):  # a disagreement (or an ok case: the script shows it agree)
        return ""
    message = _IN_PROCESSES.sub("", message.strip())
    if status == Status.CRASH and (signal := _SIGNAL.search(message)):
        return rf"signal {signal[1]}\b"
    if status == Status.ERROR and (raised := _EXCEPTION.match(message.strip())):
        if not raised[2].strip():  # raised bare (`raise AssertionError`): a traceback's last line is its type alone
            return rf"(?m)^(?:[\w.]*\.)?{re.escape(raised[1])}(?::|$)"
        return re.escape(f"{raised[1]}: {raised[2].strip()}")
    raise Unsupported(f"its failure ({status}: {message[:80]!r}) is not one a script can recognise "
                      "(a timeout, or no exception type or signal in its message)")
