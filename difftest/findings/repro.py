"""Run one (model, setting) case alone, with what it is judged against, and say whether it still disagrees.

`difftest repro RUN MODEL SETTING` and every `findings/<id>/repro.py` call `reproduce`: the model's folder (spec,
initial weights, inputs) and the run's options are copied into a private run, the setting and its references run
through the same engine as a sweep, and the verdict comes from the same oracle.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from difftest.contracts.errors import UserError
from difftest.contracts.status import NOT_OK, Status


@dataclass
class Reproduction:
    model: str
    setting: str
    verdict: str
    message: str
    worst: pd.Series | None  # the comparison row with the largest error, when the case was compared
    reference_value: float | None = None  # at the worst element
    setting_value: float | None = None
    # `difftest.findings.signature.case_signature` of each independent divergence of the case, when it is not ok,
    # each also with the known cause that explains it (`signatures`: how triage signs a finding split by its cause)
    signatures: tuple[str, ...] = ()

    @property
    def signature(self) -> str:
        from difftest.findings.signature import KNOWN_CAUSE

        return " and ".join(s for s in self.signatures if KNOWN_CAUSE not in s)

    def matches(self, signature: str) -> bool:
        """Whether the case fails the way a finding does: same status, same place, same message pattern (among its
        independent divergences, where it has several)."""
        return self.reproduces and signature in self.signatures

    @property
    def reproduces(self) -> bool:
        return self.verdict in NOT_OK

    def describe(self) -> str:
        lines = [f"{self.model} × {self.setting}: {self.verdict}"]
        if self.worst is not None and not (isinstance(self.worst["linf"], float) and math.isnan(self.worst["linf"])):
            w = self.worst
            lines.append(f"  worst tensor {w['phase']}/{w['tensor']} (against {w['reference']}): "
                         f"L∞ {w['linf']:.6g}, {int(w['mismatches'])} of {int(w['numel'])} elements beyond D3's tolerance")
            ratio = w.get("calibrated_ratio", math.nan)
            if not (isinstance(ratio, float) and math.isnan(ratio)):
                lines.append(f"  calibrated oracle: {w['calibrated_linf']:.6g} from the float64 result, {ratio:.3g}× "
                             "the envelope of legitimate results (above 1 is a finding)")
            if self.reference_value is not None:
                lines.append(f"  at its worst element: reference {self.reference_value!r}, setting {self.setting_value!r}")
        if self.message and self.verdict != Status.OK:
            lines.append(f"  {self.message[:600]}")
        if self.signature:
            lines.append(f"  signature: {self.signature}")
        return "\n".join(lines)


def reproduce(run_dir: Path, model: str, setting: str, *, workdir: Path | None = None, timeout_s: float = 120.0,
              device: str = "cpu", plugins: tuple[str, ...] = (),
              contrast: dict[str, set[tuple[str, str]]] | None = None) -> Reproduction:
    """Run `setting` on `model` of `run_dir` (a run folder, or a finding's copy of one) in a fresh private run.

    `contrast`: the parameter values the original run found a bug to follow (`difftest.findings.triage.contrast_of`), so the
    case is signed as it was there; without it the signature names the setting's family."""
    from difftest.contracts.registry import load_run_plugins
    from difftest.judging.analysis import analyze
    from difftest.runner.executor import SweepOptions
    from difftest.runner.sweep import run_sweep

    run_dir = Path(run_dir)
    source = run_dir / "models" / model
    if not (source / "spec.json").is_file():
        raise UserError(f"{source}: no such model in the run; `ls {run_dir / 'models'}` lists them")
    loaded = load_run_plugins(run_dir, plugins)
    private = Path(tempfile.mkdtemp(prefix="difftest-repro-", dir=workdir)) / "run"
    (private / "models").mkdir(parents=True)
    shutil.copy(run_dir / "run.json", private / "run.json")
    shutil.copytree(source, private / "models" / model)
    run_sweep(private, SweepOptions(settings=setting, models=model, timeout_s=timeout_s, device=device,
                                    plugins=plugins))
    analysis = analyze(private, plugins=loaded)
    case = analysis.cases[(analysis.cases["model"] == model) & (analysis.cases["setting"] == setting)].iloc[0]
    rows = analysis.comparisons[(analysis.comparisons["model"] == model)
                                & (analysis.comparisons["setting"] == setting)]
    compared = rows.dropna(subset=["linf"])
    worst = compared.loc[compared["linf"].idxmax()] if not compared.empty else (rows.iloc[0] if not rows.empty else None)
    failed = rows[rows["status"] != Status.OK]
    from difftest.findings.signature import signatures
    from difftest.findings.triage import known_causes_here

    signed = signatures(analysis, contrast or {}, known_causes_here(private)).get((model, setting), ())
    result = Reproduction(model, setting, case["verdict"], str(failed.iloc[0]["message"]) if not failed.empty else "",
                          worst, signatures=tuple(sorted(signed)))
    if worst is not None and not compared.empty:
        values = values_at_worst_element(private, setting, worst)
        if values is not None:
            result.reference_value, result.setting_value = values
    shutil.rmtree(private.parent, ignore_errors=True)
    return result


def stored_pair(run_dir: Path, setting: str, row: pd.Series) -> tuple[np.ndarray, np.ndarray] | None:
    """(reference, setting) of a comparison row's tensor, read from the run's stored outputs; None where either side
    did not store it or the shapes differ."""
    from difftest.storage.store import Store

    store = Store(run_dir)
    try:
        records = {r.setting: r for r in store.records() if r.model == row["model"]}
        name = f"{row['phase']}/{row['tensor']}"
        if setting not in records or row["reference"] not in records:
            return None
        mine = store.load_outputs(records[setting]).get(name)
        theirs = store.load_outputs(records[row["reference"]]).get(name)
    finally:
        store.close()
    if mine is None or theirs is None or mine.shape != theirs.shape or not mine.size:
        return None
    return theirs, mine


def values_at_worst_element(run_dir: Path, setting: str, row: pd.Series) -> tuple[float, float] | None:
    """(reference, setting) at the element where a comparison row's tensor differs most (`stored_pair`)."""
    pair = stored_pair(run_dir, setting, row)
    if pair is None:
        return None
    theirs, mine = pair
    where = np.unravel_index(np.argmax(np.abs(mine.astype(np.float64) - theirs.astype(np.float64))), mine.shape)
    return theirs[where].item(), mine[where].item()


REPRO_SCRIPT = '''"""Finding {finding_id}: {title}

Runs `{setting}` on model `{model}` (its spec, initial weights and inputs are in ./run) alone, against what it is
judged against, through difftest's public API; prints both sides, the verdict and the case's signature. Exits 1
while the finding is present (the case fails with the finding's signature), 0 once the case is ok, 3 if it fails in
another way, 4 if the setting cannot run here (unsupported: the reason is printed), 2 if difftest cannot run the case
(the reason in one line: a model module that does not import here, a damaged copy, a fault of difftest's).

    python {script}
"""

import sys
from pathlib import Path

from difftest import Status, UserError, reproduce

SIGNATURE = {signature!r}
CONTRAST = {contrast!r}  # the parameter values the run found this bug to follow

if __name__ == "__main__":  # the ranks are spawned processes that import this file again
    try:
        result = reproduce(Path(__file__).resolve().parent / "run", {model!r}, {setting!r}, contrast=CONTRAST)
    except UserError as exc:  # a model module that does not import here, a damaged copy: what to do, in a line
        print(f"repro.py: {{exc}}", file=sys.stderr)
        sys.exit(2)  # never 1, which says the finding is present
    except Exception as exc:  # the case's own failures are caught inside: this is difftest not running it at all
        print(f"repro.py: {{type(exc).__name__}}: {{exc}}".splitlines()[0], file=sys.stderr)
        sys.exit(2)
    print(result.describe())
    if result.matches(SIGNATURE):
        print("the finding reproduces: same signature")
        sys.exit(1)
    if result.reproduces:
        print(f"fails, but not as the finding did: its signature was\\n  {{SIGNATURE}}")
        sys.exit(3)
    sys.exit(4 if result.verdict == Status.UNSUPPORTED else 0)
'''


def write_reproducer(run_dir: Path, target: Path, finding_id: str, title: str, model: str, setting: str, *,
                     signature: str = "", contrast: dict[str, set[tuple[str, str]]] | None = None) -> Path:
    """`target/run/{run.json, models/<model>}` and `target/repro.py`: a finding that travels on its own."""
    shutil.rmtree(target / "run", ignore_errors=True)
    (target / "run" / "models").mkdir(parents=True)
    shutil.copy(run_dir / "run.json", target / "run" / "run.json")
    shutil.copytree(run_dir / "models" / model, target / "run" / "models" / model)
    script = target / "repro.py"
    script.write_text(REPRO_SCRIPT.format(finding_id=finding_id, title=title.replace('"""', "'''"), model=model,
                                          setting=setting, script=script, signature=signature,
                                          contrast={k: sorted(v) for k, v in (contrast or {}).items()}))
    return script
