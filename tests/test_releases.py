"""The supported torch releases, `difftest bisect`'s plan and verdict, and `difftest diff` on two recorded runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from difftest.contracts.errors import UserError
from difftest.releases.bisect import Outcome, Step, targets, verdict
from difftest.releases.diff import diff_runs
from difftest.releases.environments import release, release_range, supported

ROOT = Path(__file__).resolve().parents[1]


def test_every_supported_line_has_its_matching_stack() -> None:
    lines = [r.minor for r in supported()]
    assert lines == [(2, minor) for minor in range(6, 15)]  # 2.6 through 2.14, one release each
    for r in supported():  # fbgemm and torchrec follow torch one to one; torchvision is 0.(minor + 15)
        assert r.fbgemm.startswith(f"1.{r.minor[1] - 5}.") and r.torchrec.startswith(f"1.{r.minor[1] - 5}.")
        assert r.torchvision.startswith(f"0.{r.minor[1] + 15}.")
    assert release("2.10").torch == "2.10.0" and release("2.10.0").fbgemm == "1.5.0"
    assert release("2.9.0").torch == "2.9.0" and release("2.9.0").torchrec == release("2.9").torchrec
    assert [r.torch for r in release_range("2.12..2.14.1")] == ["2.12.1", "2.13.0", "2.14.1"]
    assert len(release_range("2.6.0..2.14.1")) == 9


@pytest.mark.parametrize("text", ["2.5", "3.0.0", "two", "2.14.1..2.6.0"])
def test_an_unsupported_release_gets_one_line_naming_the_range(text: str) -> None:
    with pytest.raises(UserError) as raised:
        release_range(text)
    assert "\n" not in str(raised.value)
    assert "2.6.0 to 2.14.1" in str(raised.value) or "backwards" in str(raised.value)


@pytest.mark.parametrize(("wanted", "expected"), [("", "torch 2.14.1, fbgemm 1.9.0, torchrec 1.9.2"),
                                                  ("2.10", "torch 2.10.0, fbgemm 1.5.0, torchrec 1.5.1"),
                                                  ("2.5", None)])
def test_install_sh_installs_the_release_it_is_told(wanted: str, expected: str | None) -> None:
    env = {**{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}, "DIFFTEST_INSTALL_PLAN": "1",
           "DIFFTEST_TORCH": wanted}
    result = subprocess.run(["bash", str(ROOT / "install.sh")], env=env, capture_output=True, text=True, timeout=60)
    if expected is None:
        assert result.returncode != 0 and "supports torch 2.6.0 to 2.14.1" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert f"install.sh: {expected}, torchvision" in result.stderr


def test_bisect_takes_releases_ranges_and_pythons(tmp_path: Path) -> None:
    found = targets(f"2.8,2.10..2.12,{sys.executable}")
    assert [t.label for t in found] == ["2.8.0", "2.10.0", "2.11.0", "2.12.1", sys.executable]
    assert found[-1].python == Path(sys.executable) and found[0].release is not None
    with pytest.raises(UserError, match="no such python"):
        targets(str(tmp_path / "bin" / "python"))


def _steps(*outcomes: Outcome) -> list[Step]:
    return [Step(f"2.{6 + i}.0", "", o, "", 1.0) for i, o in enumerate(outcomes)]


def test_bisect_names_where_a_finding_appears_and_where_it_is_gone() -> None:
    o = Outcome
    assert verdict(_steps(o.OK, o.REPRODUCES, o.REPRODUCES, o.OK)) == \
        "first reproduces on 2.7.0 (ok on 2.6.0); gone from 2.9.0 on"
    # releases where the case could not be judged are no evidence either way
    assert verdict(_steps(o.UNSUPPORTED, o.OK, o.NOT_INSTALLABLE, o.REPRODUCES)) == \
        "first reproduces on 2.9.0 (ok on 2.7.0); still present on the newest that ran"
    assert verdict(_steps(o.REPRODUCES, o.DIFFERENT)).startswith("reproduces on the oldest release that ran (2.6.0)")
    assert verdict(_steps(o.OK, o.COULD_NOT_RUN)) == "the finding reproduces on none of the releases that ran"


def _run(root: Path, torch: str, findings: list[tuple[str, str]], cases: list[tuple[str, str, str]],
         weights: bytes = b"w") -> Path:
    """A run folder as `difftest analyze` leaves it, with only what `diff` reads."""
    root.mkdir()
    (root / "run.json").write_text(json.dumps({"stack": {"python": "3.11.7", "libraries": {"torch": torch}}}))
    model = root / "models" / "m0"
    model.mkdir(parents=True)
    (model / "spec.json").write_text("{}")
    (model / "init.safetensors").write_bytes(weights)
    pd.DataFrame([{"id": i, "signature": s, "title": s, "cases": 1} for i, s in findings],
                 columns=["id", "signature", "title", "cases"]).to_csv(root / "findings.csv", index=False)
    rows = [{"model": m, "setting": s, "status": st, "message": "boom" if st != "ok" else ""} for m, s, st in cases]
    # a case with several tensors: one row per tensor, one of them enough to make it not ok
    rows.append({"model": "m0", "setting": "ddp", "status": "ok", "message": ""})
    pd.DataFrame(rows).to_csv(root / "comparisons.csv", index=False)
    return root


def test_diff_pairs_findings_by_signature_and_lists_changed_verdicts(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", "2.10.0", [("F1", "sig-fixed"), ("F2", "sig-both")],
             [("m0", "ddp", "inconsistent"), ("m0", "fsdp", "ok"), ("m0", "tp", "error")])
    b = _run(tmp_path / "b", "2.14.1", [("F9", "sig-both"), ("F3", "sig-new")],
             [("m0", "ddp", "ok"), ("m0", "fsdp", "inconsistent"), ("m0", "tp", "error")])
    result = diff_runs(a, b)
    assert list(result.only_a["id"]) == ["F1"] and list(result.only_b["id"]) == ["F3"]
    assert result.both == [("sig-both", "F2", "F9")]
    assert result.library_changes() == ["torch 2.10.0 -> 2.14.1"]
    assert result.compared_cases == 3
    assert [(c.setting, c.before, c.after, c.message) for c in result.changed] == [
        ("ddp", "inconsistent", "ok", "boom"), ("fsdp", "ok", "inconsistent", "boom")]


def test_diff_leaves_out_a_model_that_is_not_the_same_in_both_runs(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", "2.10.0", [], [("m0", "ddp", "inconsistent")])
    b = _run(tmp_path / "b", "2.14.1", [], [("m0", "ddp", "ok")], weights=b"other")
    result = diff_runs(a, b)
    assert result.models_differ == ["m0"] and result.compared_cases == 0 and not result.changed
    with pytest.raises(UserError, match="no run.json"):
        diff_runs(a, tmp_path / "nothing")


@pytest.mark.parametrize(("code", "first", "expected"), [
    (1, "m × s: inconsistent", Outcome.REPRODUCES), (0, "m × s: ok", Outcome.OK),
    (3, "m × s: error", Outcome.DIFFERENT), (4, "m × s: unsupported", Outcome.UNSUPPORTED),
    # a reproducer written before exit code 4 said unsupported only in its first line
    (0, "m × s: unsupported", Outcome.UNSUPPORTED), (7, "Traceback", Outcome.COULD_NOT_RUN)])
def test_bisect_reads_what_a_reproducer_says(tmp_path: Path, code: int, first: str, expected: Outcome) -> None:
    from difftest.releases.bisect import probe

    script = tmp_path / "repro.py"
    script.write_text(f"import sys\nprint({first!r})\nprint('  needs torch >= 2.9')\nsys.exit({code})\n")
    stack, outcome, detail = probe(Path(sys.executable), script, timeout_s=60)
    assert outcome is expected and stack.startswith("torch ")
    assert "needs torch >= 2.9" in detail and detail.startswith("exit 7") == (code == 7)


@pytest.mark.parametrize(("code", "said", "expected"), [
    (1, "BUG PRESENT: the setting disagrees", Outcome.REPRODUCES), (0, "ok: the setting agrees", Outcome.OK),
    (2, "COULD NOT RUN the setting: ValueError: x", Outcome.COULD_NOT_RUN),
    # exit 1 without the script's own words is not the bug (an import failing on its own exits 1 too)
    (1, "Traceback", Outcome.COULD_NOT_RUN)])
def test_bisect_reads_what_a_standalone_script_says(tmp_path: Path, code: int, said: str, expected: Outcome) -> None:
    from difftest.releases.bisect import probe

    script = tmp_path / "standalone.py"
    lines = ["python 3.11, torch 2.9.1", "w: 0 of 4 elements off, 0.1x what rounding explains",
             "b: 3 of 4 elements off, 9e4x what rounding explains", said]
    script.write_text(f"import sys\nprint({chr(10).join(lines)!r})\nsys.exit({code})\n")
    _, outcome, detail = probe(Path(sys.executable), script, timeout_s=60, standalone=True)
    assert outcome is expected, detail
    assert detail.startswith("b: 3 of 4") == (expected is Outcome.REPRODUCES) and said in detail


@pytest.mark.slow
def test_bisect_runs_a_torchrec_finding_on_three_releases(tmp_path: Path) -> None:
    """A real finding (grid_shard with MEAN pooling), minimised here, re-run on three releases' environments (made
    once with uv and cached): each must run it to an answer, and the newest, where it was found, must reproduce it."""
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "difftest.cli"]
    for args in (["generate", "--out", str(run), "--kind", "dlrm", "--models", "1"],
                 ["sweep", str(run), "--settings", "torchrec/ebc/grid_shard/ws2"],
                 ["analyze", str(run), "--minimise-budget", "30"]):
        done = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    findings = pd.read_csv(run / "findings.csv", dtype=str, keep_default_na=False)
    grid = findings[findings["example_setting"].str.contains("grid_shard")]
    assert len(grid) == 1, findings[["id", "title", "example_setting"]]
    done = subprocess.run([*cli, "bisect", str(run), grid["id"].iloc[0], "--torch", "2.12..2.14.1"],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = {line.split(":")[0].strip(): line.split(":")[1].split("(")[0].strip()
                for line in (done.stderr + done.stdout).splitlines() if line.startswith("  2.")}
    assert set(outcomes) == {"2.12.1", "2.13.0", "2.14.1"}, done.stdout
    assert set(outcomes.values()) <= {"reproduces", "ok"}, done.stdout
    assert outcomes["2.14.1"] == "reproduces", done.stdout
    assert "reproduces on" in done.stdout.splitlines()[-1], done.stdout
