"""The main job, end to end through the real CLI: generate → sweep a tier of the built-in settings → analyse.

The default tier of settings (what `difftest run` runs; 6 min 40 s on 2 cores with its rerun) is the `e2e` test
tier, which `.ci/run` runs after the default one; the full tier of settings (every setting) is `slow`.
Both check the same facts, on the settings the tier holds.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from difftest.contracts.registry import load_plugins, tier, traits_of, with_references
from difftest.findings import known
from difftest.judging.analysis import CSV_COLUMNS


def _check_library_findings(rows: pd.DataFrame, in_tier: set[str]) -> None:
    """Every case that is not ok is a library bug difftest/findings/known_issues.toml knows (anything else is a harness bug to
    fix or a new finding to investigate and add there), and every known bug the default job shows on the installed
    releases still shows (else upstream fixed it: narrow the entry's `affects`)."""
    failing = rows[rows.status != "unsupported"].drop_duplicates(["model", "setting"])
    explained: dict[str, int] = {}
    unexplained = []
    for case in failing.itertuples():
        issue = known.match(case.setting, case.status, case.message, traits_of(case.kind), case.d3_status)
        if issue is None:
            unexplained.append(f"{case.status} {case.model} × {case.setting}: {str(case.message)[:200]}")
        else:
            explained[issue.id] = explained.get(issue.id, 0) + 1
    assert not unexplained, "not ok, and no known library issue explains it:\n" + "\n".join(unexplained)
    versions = known.installed_versions({i.library for i in known.manifest()})
    expected = {i.id: i for i in known.manifest() if i.default_job and i.reproduces_on(versions)
                and any(fnmatch.filter(in_tier, glob) for glob in i.settings)}
    gone = [f"{i.id} ({i.library} {versions[i.library]})" for i in expected.values() if i.id not in explained]
    assert not gone, f"known findings no longer reproduce on the installed releases: {gone}"


def _run(out: Path, *extra: str, timeout: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "difftest.cli", "run", "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _check_the_job(out: Path, tier_name: str, result: subprocess.CompletedProcess) -> pd.DataFrame:
    assert result.returncode == 0, result.stderr[-3000:]
    load_plugins()
    in_tier = {s.name for s in with_references(tier(tier_name))}  # with the calibration runs of its roots
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    assert set(cases.index) == in_tier
    # 2 DLRM + 2 Keras sequential models and one of each larger kind, × every setting of the tier
    kinds = pd.Series({d.name: d.name.split("-s0-")[0] for d in (out / "models").iterdir()})
    assert kinds.value_counts().to_dict() == {"dlrm": 2, "sequential": 2, "transformer": 1, "torchrec-dlrm": 1,
                                              "torchrec-deepfm": 1, "keras-dag": 1, "keras-transformer": 1}
    keras_models = int(kinds.map(lambda k: "keras" in traits_of(k)).sum())
    assert int(cases["cases"].sum()) == len(kinds) * len(in_tier)
    assert cases.loc["reference", "ok"] == len(kinds) and cases.loc["tf/reference", "ok"] == keras_models == 4
    assert cases["timeout"].sum() == 0
    rows = pd.read_csv(out / "inconsistencies.csv")
    assert list(rows.columns) == CSV_COLUMNS
    assert set(rows.status) <= {"inconsistent", "error", "crash", "unsupported"}
    # each failing case names the rank that failed first, not a peer cut loose by it
    assert not rows[rows.status == "error"].message.str.contains("Connection closed by peer|Read error").any()
    # refusals are kind mismatches, engines refusing fp16 weights, TF-MOT missing, models without the layers a
    # parallelism needs (Linear pairs, positions, a vocabulary projection for loss parallel, BatchNorm for
    # SyncBatchNorm), CPU-versus-GPU settings
    # on a machine without one, TFLite's int8 leaving every kernel of a small model in float, a fused optimizer or a
    # variable-batch lookup fbgemm's CPU build lacks, a train pipeline that needs a device stream or a model torch.fx
    # can trace, each with its reason
    refused = rows[rows.status == "unsupported"]
    assert refused.message.str.contains("kind|refuses float16|tensorflow-model-optimization|layer units|Linear"
                                        "|positions|vocabulary|CUDA device|tensorflow#53094"
                                        "|not supported in CPU mode|not supported on CPU|device stream"
                                        "|does not trace|no BatchNorm").all(), \
        refused.message.unique()
    _check_library_findings(rows, in_tier)
    # the seeds' oracles: resume (bitwise in one process), re-partitioning, PipeDream, partial reduce all hold
    oracles = cases[cases.index.str.match(r"(resume|tf-resume|repartition|async-pipeline|partial-reduce)/")]
    assert {name.split("/")[0] for name in oracles.index} == {"resume", "tf-resume", "repartition", "async-pipeline",
                                                              "partial-reduce"}, oracles.index
    assert (oracles["ok"] + oracles["unsupported"] == oracles["cases"]).all(), oracles
    unsupported = oracles[oracles["unsupported"] > 0]
    assert set(unsupported.index) == {"tf-resume/uninterrupted", "tf-resume/k3"}  # the PyTorch-only models
    assert (unsupported["unsupported"] == len(kinds) - keras_models).all()
    comparisons = pd.read_csv(out / "comparisons.csv")
    assert (comparisons.status == "ok").sum() > 1000
    # a distributed resume (DDP on 2 ranks -> FSDP2's uneven shards on 3, through DCP) is judged by its root's
    # envelope, the fp32 Monte Carlo runs included: on a model that amplifies rounding ~1e4× (the keras-transformer
    # after four momentum steps) it lands where fp32-sized errors carry the uninterrupted program, on AVX-512 and AVX2
    # kernels alike
    resumed = comparisons[comparisons.setting.str.match(r"resume/(ddp|fsdp2)-")]
    assert not resumed.empty and resumed.calibrated_ratio.notna().all() and (resumed.calibrated_ratio <= 1).all()
    # triage: every case that is not ok belongs to a finding (to two where it holds two independent divergences), far
    # fewer findings than cases
    findings = pd.read_csv(out / "findings.csv")
    not_ok = int(cases[["inconsistent", "nondeterministic", "error", "crash", "timeout"]].sum().sum())
    assert not_ok <= findings["cases"].sum() and len(findings) < not_ok
    assert set(findings["upstream"]) <= {"known", "related", "unreported"}  # every one a known library bug
    assert findings["known_issue"].is_unique  # one root cause, one finding
    stack = json.loads((out / "run.json").read_text())["stack"]
    assert stack["libraries"]["torch"].split("+")[0] == known.installed_version("torch") and stack["cpu_capability"]
    assert f"torch {stack['libraries']['torch']}" in (out / "findings.md").read_text()
    assert all((out / "findings" / fid / "repro.py").is_file() for fid in findings["id"])
    # and each as a maintainer would file it: the run's environment, the oracle, the manifest's upstream references
    for fid, references in zip(findings["id"], findings["references"].fillna(""), strict=True):
        issue = (out / "findings" / fid / "ISSUE.md").read_text()
        assert f"- torch: {stack['libraries']['torch']}" in issue and "## What was expected, and why" in issue
        assert all(ref in issue for ref in re.findall(r"[\w.-]+/[\w.-]+#\d+", references)), (fid, references)
        # and what its standalone script printed here, when it reproduced
        ran = out / "findings" / fid / "standalone.txt"
        if ran.is_file() and "reproduces (exit 1)" in ran.read_text().splitlines()[0]:
            assert "; what it printed" in issue and "\nBUG PRESENT: " in issue, fid
    assert "distinct findings" in result.stdout
    # the sweep told its findings as it found them, before its end and before triage
    live = re.findall(r"\] finding (\d+) so far: ", result.stderr)
    assert live and live[0] == "1" and result.stderr.index("finding 1 so far") < result.stderr.index("triage:")
    # each finding's example was shrunk (or it says why not) and the smaller case is what its repro.py runs
    for fid in findings["id"]:
        saved = json.loads((out / "findings" / fid / "minimise.json").read_text())
        before, after = saved["original"]["size"], saved["minimal"]["size"]
        assert saved["outcome"] and all(after[k] <= before[k] for k in before), saved
        assert f"{saved['minimal']['model']!r}" in (out / "findings" / fid / "repro.py").read_text()
    shrunk = [fid for fid in findings["id"] if "-min" in (out / "findings" / fid / "repro.py").read_text()]
    assert len(shrunk) >= len(findings) // 2
    assert (out / "report.html").stat().st_size > 1_000_000  # plotly's JavaScript is in the page
    return rows


ROOT = Path(__file__).resolve().parents[2]


def readme_command() -> list[str]:
    """The README's first command after the install, as written: `.venv/bin/difftest run` (no --out: the default
    `results/default`, a path relative to where it runs)."""
    first = (ROOT / "README.md").read_text().split("```", 2)[1].strip().splitlines()[0]
    return first.split("&&", 1)[1].split()


def _run_as_written(where: Path, timeout: int) -> subprocess.CompletedProcess:
    """The README's command, as written, from a folder that holds the checkout's `.venv` as the checkout root does
    (a link), so that its relative output folder is a fresh one."""
    if not (where / ".venv").exists():
        (where / ".venv").symlink_to(ROOT / ".venv")
    return subprocess.run(readme_command(), capture_output=True, text=True, timeout=timeout, cwd=where)


@pytest.mark.needs_tf
@pytest.mark.e2e
@pytest.mark.timeout(2100)
def test_the_readmes_command_as_written_runs_the_default_tier_checks_every_script_and_resumes(tmp_path: Path) -> None:
    assert readme_command() == [".venv/bin/difftest", "run"]
    out = tmp_path / "results" / "default"
    rows = _check_the_job(out, "default", _run_as_written(tmp_path, timeout=1500))
    # every finding has a standalone script, run from the relative run folder, and it reproduces on its own
    for folder in sorted((out / "findings").iterdir()):
        said = (folder / "standalone.txt").read_text().splitlines()[0]
        assert "reproduces (exit 1)" in said, (folder.name, said)
    # every family of settings ran on the default models, but those too costly for the default tier (compiled)
    load_plugins()
    families = {s.family for s in with_references(tier("full")) if type(s).in_default_tier}
    assert families == {s.family for s in tier("default")}

    # a rerun of the same command resumes: nothing left to run, same verdicts
    again = _run_as_written(tmp_path, timeout=600)
    assert again.returncode == 0 and not re.search(r"\b0 already done", again.stderr)
    assert "ran 0" in again.stderr.replace("\n", " ")
    assert pd.read_csv(out / "inconsistencies.csv").equals(rows)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_difftest_run_full_tier_on_the_default_models(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _check_the_job(out, "full", _run(out, "--tier", "full", timeout=2400))
