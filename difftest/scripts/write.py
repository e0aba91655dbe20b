"""The pipeline step after minimisation: each finding's `standalone.py` (`difftest.scripts.emit`), written for its
minimal case and run once where difftest does not import, or why it has none; `findings.md` says which and why.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftest.contracts.errors import Unsupported
from difftest.contracts.script import DATA_FILE, STANDALONE_FILE, STANDALONE_VERDICT_FILE, Script, StandaloneCase
from difftest.runner.scheduler import machine_ranks
from difftest.scripts.check import AGREEING_LINE, Checked, own_lines, sealed_environment
from difftest.scripts.emit import render_script, write_script
from difftest.scripts.reduce import FULL_FILE
from difftest.storage.paths import absolute

if TYPE_CHECKING:
    from collections.abc import Iterator
    from concurrent.futures import Future

    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.minimise import Minimisation
    from difftest.findings.triage import Finding
    from difftest.scripts.reduce import Reduction
    from difftest.scripts.shrink import TrialServer


@dataclass(frozen=True)
class Emitted:
    """One finding's standalone script, or why it has none."""

    finding_id: str
    family: str
    path: Path | None
    why_not: str = ""
    checked: Checked | None = None
    # difftest failed to write it (its emitter raised): counted and told as a defect of ours, not as the library's
    defect: bool = False
    reduction: Reduction | None = None  # what reducing the script to what its case runs came to

    @property
    def our_defect(self) -> bool:
        """Whether difftest, not the library, kept this finding from a checked script: its emitter raised, or the
        written script failed on its own (exit 2: a mistake of ours or a missing library; 124: no answer in time)."""
        return self.defect or (self.checked is not None and self.checked.exit_code not in (0, 1))

    def describe(self) -> str:
        if self.path is None:
            return f"{NO_SCRIPT}{self.why_not}"
        if self.checked is None:
            return f"{STANDALONE_FILE} written, not checked: {self.why_not}" if self.why_not else \
                f"{STANDALONE_FILE} written, not run"
        code = self.checked.exit_code
        if self.checked.reproduces or code in (0, 1):
            verdict = "reproduces (exit 1)" if self.checked.reproduces else {0: "does not reproduce (exit 0)"}.get(
                code, "exits 1 without saying BUG PRESENT")
            return f"{STANDALONE_FILE} {verdict} in {self.checked.seconds:.1f} s"
        lines = [line.strip() for line in self.checked.output.splitlines() if line.strip()]
        why = (lines[-1] if lines else "it printed nothing")[:300]
        return (f"{STANDALONE_FILE} could not run (exit {code}) in {self.checked.seconds:.1f} s, {OUR_DEFECT}{why}")


def emit(run_dir: Path, finding_id: str, title: str, status: str, model_dir: Path, setting_name: str,
         first_divergence: str, spread: dict[str, float], tolerance: Tolerance, check_timeout_s: float = 0.0,
         message: str = "") -> Emitted:
    """Write `findings/<finding_id>/standalone.py` for the case (`model_dir` × `setting_name`) and, with a timeout,
    run it once in a sealed environment; or say why there is none."""
    from difftest.contracts.registry import get_setting

    folder = run_dir / "findings" / finding_id
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (STANDALONE_FILE, DATA_FILE, STANDALONE_VERDICT_FILE, FULL_FILE):
        (folder / stale).unlink(missing_ok=True)
    setting = get_setting(setting_name)
    case = _standalone_case(run_dir, finding_id, title, status, model_dir, setting_name, first_divergence, spread,
                            tolerance, message)
    try:
        path = write_script(folder, case, _emitted(setting_name, case))
    except Unsupported as exc:
        emitted = Emitted(finding_id, setting.family, None, str(exc))
    except Exception as exc:  # the emitter's own failure: a defect of difftest's, never the end of the run
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        emitted = Emitted(finding_id, setting.family, None, f"{OUR_DEFECT}the `{setting.family}` emitter raised "
                          f"{type(exc).__name__}: {first}", defect=True)
    else:
        emitted = Emitted(finding_id, setting.family, path)
    _record(folder, emitted)
    return _check_all([emitted], check_timeout_s)[0] if check_timeout_s > 0 else emitted


def script_lines(run_dir: Path, title: str, model: str, setting_name: str, status: str, first_divergence: str,
                 message: str) -> int | None:
    """How many lines the standalone script of the run's case (`model` × `setting_name`) has before its reduction (a
    fraction of a second for the built-in kinds: nothing runs); None where the case has none (its family has no
    emitter, the emitter cannot express it or fails, its model is not on disk)."""
    from difftest.contracts.tolerance import Tolerance

    try:
        case = _standalone_case(run_dir, "", title, status, run_dir / "models" / model, setting_name,
                                first_divergence, {}, Tolerance(), message)
        return render_script(case, _emitted(setting_name, case)).count("\n")
    # whatever keeps this case from a script (a user's module exiting on import included), its emission says why
    # when it is the one written
    except (Exception, SystemExit):
        return None


def _standalone_case(run_dir: Path, finding_id: str, title: str, status: str, model_dir: Path, setting_name: str,
                     first_divergence: str, spread: dict[str, float], tolerance: Tolerance,
                     message: str) -> StandaloneCase:
    """The case as its setting's emitter is given it."""
    from difftest.contracts.registry import get_setting
    from difftest.contracts.spec import RunConfig
    from difftest.runner.pool import simulated_local_size
    from difftest.storage.artifacts import load_model

    setting = get_setting(setting_name)
    model, inputs = load_model(model_dir)
    config = RunConfig.load(run_dir / "run.json")
    return StandaloneCase(finding_id, title, status, model.spec, model.generator, model.init_state,
                          {"train": inputs.train, "eval": inputs.eval}, first_divergence, spread, tolerance,
                          simulated_local_size(setting.world_size), config.lr, message, model_dir, config.seed,
                          config.steps, setting=setting_name)


def _emitted(setting_name: str, case: StandaloneCase) -> Script:
    """The script part the setting's emitter makes of the case; raises `Unsupported` where the family has no emitter
    or the emitter cannot express the case."""
    from difftest.contracts.registry import get_setting

    setting = get_setting(setting_name)
    # building the model again (a converter's warnings) says nothing new here: the sweep's logs have it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        script = setting.standalone(case)
    if script is None:
        raise Unsupported(f"the `{setting.family}` family has no emitter")
    return script


# the priority of a script run while the minimiser still works: below its trials (CFS gives nice 10 a tenth of a core
# beside nice 0), above nothing
BACKGROUND_NICENESS = 10
NO_SCRIPT = "no standalone script: "  # how `standalone.txt` begins where the finding has none, then why
OUR_DEFECT = "a defect of difftest's: "  # where it has none because difftest failed (after NO_SCRIPT)


def recorded_run(folder: Path) -> tuple[str, list[str], int] | None:
    """What running the folder's script gave (`standalone.txt`): its one-line verdict, the lines it printed itself
    less those of the tensors it found in agreement, and how many those were; None where it has no script or it was
    not run."""
    path = folder / STANDALONE_VERDICT_FILE
    if not path.is_file() or not (folder / STANDALONE_FILE).is_file():
        return None
    verdict, _, output = path.read_text().partition("\n\n")
    if not output.strip():
        return None
    lines = own_lines(output)
    telling = [line for line in lines if not AGREEING_LINE.search(line)]
    return verdict.strip(), telling, len(lines) - len(telling)


def why_no_script(folder: Path) -> str | None:
    """Why the finding in `folder` has no script, as its emitter said (a family without one, a case it cannot
    express); None where it has one or none was attempted."""
    path = folder / STANDALONE_VERDICT_FILE
    if (folder / STANDALONE_FILE).is_file() or not path.is_file():
        return None
    first = path.read_text().split("\n", 1)[0]
    return first.removeprefix(NO_SCRIPT) if first.startswith(NO_SCRIPT) else None


def _record(folder: Path, emitted: Emitted) -> None:
    reduced = f"; {emitted.reduction.describe()}" if emitted.reduction is not None else ""
    text = emitted.describe() + reduced + ("\n\n" + emitted.checked.output if emitted.checked else "") + "\n"
    (folder / STANDALONE_VERDICT_FILE).write_text(text)


def _check(e: Emitted, timeout_s: float, niceness: int = 0, shrink_budget_s: float = 0.0,
           servers: TraceServers | None = None) -> Emitted:
    """Run a written script traced, and where it reproduces reduce it to what its case runs (`difftest.scripts.reduce`,
    the reduced script checked fresh); record what the script now in place printed. With `servers`, a script of the
    torch stack is traced in a fork of a server that imported its libraries once (`TraceServers`); what stands for it
    is a fresh interpreter's run all the same: the reduced script's check where the reduction is kept; where the
    reduced script did not show the bug, the whole script traced fresh (and reduced from that run where it
    reproduces), as without servers; where nothing could be removed, the whole script's fresh check. A fork that does
    not show the bug (an agreement, a failure, a timeout) costs its run before the fresh one. With a shrink budget,
    the traced run and the trials run in one lent server: the libraries' import is paid once for all of them."""
    import dataclasses

    if e.path is None:
        return e
    key = _check_key(e.path, shrink_budget_s)
    if (reused := _earlier_check(e, key)) is not None:  # a rerun's: the same script, data and libraries
        _record(e.path.parent, reused)
        return reused
    env = sealed_environment(e.path.parent / ".sealed")
    try:
        if servers is not None and shrink_budget_s > 0:
            with servers.lease(e.path) as server:  # traced and shrunk in one server that imported the libraries once
                checked, reduction = _traced_and_reduced(e.path, timeout_s, env, niceness, shrink_budget_s, servers,
                                                         server)
        else:
            checked, reduction = _traced_and_reduced(e.path, timeout_s, env, niceness, shrink_budget_s, servers)
    except Exception as exc:  # checking one script failed in difftest's own code: that finding says so, the run goes on
        done = dataclasses.replace(e, defect=True, why_not=f"{OUR_DEFECT}{type(exc).__name__}: {exc}")
        _record(e.path.parent, done)
        return done
    done = dataclasses.replace(e, checked=checked, reduction=reduction)
    _record(e.path.parent, done)
    if checked.exit_code in (0, 1):  # an answer (not a timeout, not a script that could not run) is worth keeping
        _keep_check(done, key)
    return done


def _traced_and_reduced(path: Path, timeout_s: float, env: dict[str, str], niceness: int, shrink_budget_s: float,
                        servers: TraceServers | None, lent: TrialServer | None = None) -> tuple[Checked, Reduction | None]:
    """`_check`'s runs: the traced one (in a fork where `servers` has one, of `lent` where the script holds one), the
    reduction and its fresh check; the check that stands for the script at `path` and the reduction, if any."""
    from difftest.scripts.check import check_script
    from difftest.scripts.reduce import NOT_THE_SAME_BUG, traced_check
    from difftest.scripts.shrink import reduce_and_shrink

    forked = servers.trace(path, timeout_s, lent) if servers is not None else None
    lent = None if servers is None or servers.stopped else lent  # a server that failed is not lent to the trials
    reduction = None
    if forked is not None and forked[0].reproduces:
        reduction, checked = reduce_and_shrink(path, *forked, timeout_s, env, niceness, shrink_budget_s, lent)
    if reduction is not None and not reduction.kept and not reduction.why_not.startswith(NOT_THE_SAME_BUG):
        # nothing to remove, or a reduction that could not be made: a fresh run of the whole script decides
        checked = check_script(path, timeout_s, env=env, niceness=niceness)
    elif reduction is None or not reduction.kept:  # the fork's path was not a fresh run's: trace one
        checked, executed = traced_check(path, timeout_s, env, niceness)
        if checked.reproduces:
            reduction, checked = reduce_and_shrink(path, checked, executed, timeout_s, env, niceness, shrink_budget_s,
                                                   lent)
    return checked, reduction


# the libraries a script's traced run may import in a shared fork server, and the standard library: the torch stack's
# and the ONNX converters' (a converted Keras model's script), whose imports leave at most an idle thread waiting (torch
# one, ONNX Runtime one); a fork after TensorFlow's import is not safe
FORKABLE = ("numpy", "torch", "torchrec", "fbgemm_gpu", "onnx", "onnx2torch", "onnx2pytorch", "onnxruntime")


class TraceServers:
    """Fork servers (`difftest.scripts.shrink.TrialServer`) shared by a run's checks, at most one per check running
    at once and never more than `MOST_TRACE_SERVERS` (each holds its libraries in memory), sealed as a check is: a
    script's traced run costs what it computes, not the seconds its libraries' import takes (TorchRec's: 3 of a
    TorchRec script's 6 s), which each server pays once for every script it runs."""

    def __init__(self, niceness: int = 0) -> None:
        import tempfile
        import threading

        self._niceness = niceness  # the servers', so their imports too: those of a run's scripts yield to its trials
        self._idle: list[TrialServer] = []
        self._started = 0
        self._lock = threading.Lock()
        self._folder = tempfile.TemporaryDirectory(prefix="difftest-trace-servers-")
        self._env = sealed_environment(Path(self._folder.name))
        # one server failing (not starting, stopping, answering garbled) ends forking for the run: the scripts then
        # run fresh, as they would without servers, rather than each finding its own broken server
        self._stopped = False

    def trace(self, script: Path, timeout_s: float, lent: TrialServer | None = None) -> tuple[Checked, set[int]] | None:
        """The script's traced run in a fork (of `lent`, a server this script holds, else of one lent for the run), or
        None where its libraries are not all forkable, every server is busy, none runs or the server failed (then
        stopped, as every server is: `stopped`)."""
        try:
            if lent is not None:
                return lent.trace(script, timeout_s)
            with self.lease(script) as server:
                return None if server is None else server.trace(script, timeout_s)
        except Exception:  # the server did not answer or answered garbled: a fresh run instead
            self._stop(lent)
            return None

    @property
    def stopped(self) -> bool:
        return self._stopped

    @contextlib.contextmanager
    def lease(self, script: Path) -> Iterator[TrialServer | None]:
        """A server for the script's runs while the block runs (an idle one, or one started for it), or None where its
        libraries are not all forkable, every server is busy or none runs. A server that fails to start, or an
        exception out of the block, stops forking for the run: the scripts then run fresh, as without servers."""
        import sys

        from difftest.scripts.shrink import TrialServer, script_modules

        script = absolute(script)  # the fork runs it from the folder above its own
        try:
            modules = script_modules(script.read_text())
            forkable = all(m.split(".")[0] in FORKABLE or m.split(".")[0] in sys.stdlib_module_names for m in modules)
        except (SyntaxError, ValueError, TypeError, OSError):  # its imports cannot be read: a fresh run says how it fails
            forkable = False
        with self._lock:
            lent = forkable and not self._stopped and (bool(self._idle) or self._started < MOST_TRACE_SERVERS)
            server = self._idle.pop() if lent and self._idle else None  # else one is started below
            self._started += lent and server is None
        if not lent:
            yield None
            return
        try:
            server = server or TrialServer(script, self._env, self._niceness)
        except Exception:  # it did not start: fresh runs from here on
            self._stop(None)
            yield None
            return
        try:
            yield server
        except BaseException:
            self._stop(server)
            raise
        if not server.alive:  # it stopped answering in the block (a trial's failure, told in its finding)
            self._stop(server)
            return
        with self._lock:
            if not self._stopped:
                self._idle.append(server)
                return
        server.close()  # the run closed the servers while this one was lent

    def _stop(self, server: TrialServer | None) -> None:
        with self._lock:
            self._stopped = True
        if server is not None:
            server.close()

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, []
        for server in idle:
            server.close()
        self._folder.cleanup()


# servers at most, whatever the cores: each holds torch (and TorchRec) in memory until the run's scripts are done
MOST_TRACE_SERVERS = 4


# what checking a finding's script gave, kept beside it: a rerun that writes the same script, on the same data and
# libraries, takes it instead of running and reducing the script again
CHECK_RECORD = ".check.json"
def _check_key(path: Path, shrink_budget_s: float) -> str:
    """The script's text, its data's arrays (an .npz's bytes hold the time it was written), the shrink budget and
    this process's stack (the interpreter, the libraries' releases, the CPU: `difftest.storage.stack`)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256(path.read_bytes())
    data = path.with_name(DATA_FILE)
    if data.is_file():
        with np.load(data) as arrays:
            for name in sorted(arrays.files):
                array = arrays[name]
                digest.update(f"{name} {array.dtype} {array.shape}".encode())
                digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(f"{shrink_budget_s} {_this_stack()}".encode())
    return digest.hexdigest()


@functools.cache
def _this_stack() -> str:
    """`difftest.storage.stack.current()`, asked once per process."""
    import json

    from difftest.storage import stack

    return json.dumps(stack.current(), sort_keys=True)


def _earlier_check(e: Emitted, key: str) -> Emitted | None:
    """The kept check of the same script (`CHECK_RECORD` under `key`), its reduced form put back in place; None where
    there is none."""
    import dataclasses
    import json

    from difftest.scripts.reduce import Reduction

    assert e.path is not None
    try:
        kept = json.loads(e.path.with_name(CHECK_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key:
        return None
    reduction = Reduction(**kept["reduction"]) if kept.get("reduction") else None
    if reduction is not None:  # as the reduction left the folder: the whole script beside the one in place
        e.path.with_name(FULL_FILE).write_text(e.path.read_text())
        e.path.write_text(kept["script"])
    return dataclasses.replace(e, checked=Checked(**kept["checked"]), reduction=reduction)


def _keep_check(done: Emitted, key: str) -> None:
    import dataclasses
    import json

    assert done.path is not None and done.checked is not None
    record = {"key": key, "checked": dataclasses.asdict(done.checked),
              "reduction": dataclasses.asdict(done.reduction) if done.reduction is not None else None,
              "script": done.path.read_text()}
    done.path.with_name(CHECK_RECORD).write_text(json.dumps(record))


def _check_all(emitted: list[Emitted], timeout_s: float, shrink_budget_s: float = 0.0,
               servers: TraceServers | None = None) -> list[Emitted]:
    """Run every written script once, as many at a time as the machine has cores (a script is mostly its libraries'
    import and a rank or two: it waits more than it computes); several share `servers` for their traced runs."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=machine_ranks()) as pool:
        return list(pool.map(lambda e: _check(e, timeout_s, shrink_budget_s=shrink_budget_s, servers=servers),
                             emitted))


class StandaloneScripts:
    """Each finding's standalone script, for its minimal case where it has one (judged by the envelope the minimiser
    measured on it), else for its example (judged by the run's envelope), run once each when `check_timeout_s`.

    A finding's script is written as soon as its minimisation is final (`finding_done`, the minimiser's `on_done`; a
    fraction of a second, in the minimiser's own thread) and run in the background while the minimiser works on the
    others, as many at a time as the machine has cores but at a lower priority (`BACKGROUND_NICENESS`): they take the
    cores the rounds leave idle (while a round's models are built, its verdicts signed) and hardly slow the trials,
    whose time the findings' budgets are charged. `finish` writes the rest and runs every script not yet started, as
    many at a time as the machine has cores."""

    def __init__(self, run_dir: Path, findings: list[Finding], tolerance: Tolerance, check_timeout_s: float = 0.0,
                 shrink_budget_s: float = 0.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._run_dir, self._findings, self._tolerance = run_dir, findings, tolerance
        self._check_timeout_s, self._shrink_budget_s = check_timeout_s, shrink_budget_s
        self._background = ThreadPoolExecutor(max_workers=machine_ranks())
        # at the background checks' priority: what the servers run after the minimiser is done has the cores alone
        self._servers = TraceServers(BACKGROUND_NICENESS) if check_timeout_s > 0 else None
        self._written: dict[str, Emitted] = {}
        self._checks: dict[str, Future[Emitted]] = {}

    def finding_done(self, m: Minimisation) -> None:
        finding = next((f for f in self._findings if f.id == m.finding_id), None)
        if finding is None:
            return
        self._written[finding.id] = written = self._emit(finding, m)
        if self._check_timeout_s > 0 and written.path is not None:
            self._checks[finding.id] = self._background.submit(_check, written, self._check_timeout_s,
                                                               BACKGROUND_NICENESS, self._shrink_budget_s,
                                                               self._servers)

    def finish(self, minimised: list[Minimisation]) -> list[Emitted]:
        """Every finding's script, in the order of the findings, once each has been written and run."""
        by_id = {m.finding_id: m for m in minimised}
        for f in self._findings:
            if f.id not in self._written:
                self._written[f.id] = self._emit(f, by_id.get(f.id))
        # a check still queued runs with the rest, side by side; one already started is waited for
        unstarted = [e for e in self._written.values() if e.finding_id not in self._checks
                     or self._checks[e.finding_id].cancel()]
        self._background.shutdown(wait=False)
        try:
            checked = _check_all(unstarted, self._check_timeout_s, self._shrink_budget_s, self._servers) \
                if self._check_timeout_s > 0 else unstarted
            done = {e.finding_id: e for e in checked}
            return [done[f.id] if f.id in done else self._checks[f.id].result() for f in self._findings]
        finally:
            if self._servers is not None:
                self._servers.close()

    def _emit(self, f: Finding, m: Minimisation | None) -> Emitted:
        from difftest.judging.analysis import envelope_spread

        run_dir, tolerance = self._run_dir, self._tolerance
        title = f.known.title if f.known else f.title
        if m is not None and m.best is not m.original:
            model_dir = run_dir / "findings" / f.id / "run" / "models" / m.best.model_id
            setting, spread = m.best.setting, m.spread
        else:
            model, setting = str(f.example["model"]), str(f.example["setting"])
            model_dir, spread = run_dir / "models" / model, envelope_spread(run_dir, model, setting, tolerance)
        emitted = emit(run_dir, f.id, title, f.status, model_dir, setting, f.first_divergence, spread, tolerance,
                       message=str(f.example.get("message", "")))
        if emitted.path is not None or emitted.defect:
            return emitted
        # the example's kind or family has no script (a converted model has no layer chain; a family without an
        # emitter): a case of the same finding on another kind, or under another family, may have one, unminimised,
        # and it reproduces the same cause
        for row in _other_cases(f, OTHER_CASES_TRIED):
            other = emit(run_dir, f.id, title, f.status, run_dir / "models" / row.model, row.setting,
                         row.first_divergence or f.first_divergence,
                         envelope_spread(run_dir, row.model, row.setting, tolerance), tolerance, message=str(row.message))
            if other.path is not None or other.defect:
                return other
        return emitted


# how many other cases of a finding are tried for a script when its example has none
OTHER_CASES_TRIED = 4


def _other_cases(f: Finding, most: int) -> list[Any]:
    """Among a finding's cases of its status, at most `most`: the first case of each kind but the example's, then the
    first of each family but the example's on the example's kind."""
    import pandas as pd

    from difftest.contracts.registry import get_setting

    rows = f.rows[f.rows["status"] == f.status]
    rows = rows.assign(family=[get_setting(name).family for name in rows["setting"]])
    kind, family = f.example["kind"], get_setting(str(f.example["setting"])).family
    other_kinds = rows[rows["kind"] != kind].drop_duplicates("kind")
    other_families = rows[(rows["kind"] == kind) & (rows["family"] != family)].drop_duplicates("family")
    return list(pd.concat([other_kinds, other_families]).head(most).itertuples())
