"""difftest as a pytest plugin (registered through the `pytest11` entry point): "my model trains the same under DDP
and FSDP2" as a test of a team's own suite.

    def test_my_model_trains_the_same_sharded(difftest):
        difftest.check("my_pkg.models:adapter", settings="ddp/*/ws2,fsdp2/*/ws2")

`check` runs `difftest run --model MODULE:ATTRIBUTE` (a `difftest.ModelAdapter`, docs/your-model.md) in a folder of
the test's own (`tmp_path`), in a process of its own, and fails the test with one line per finding (its cause,
upstream status, example and the path of its standalone script), unless `baseline` (a JSON list of cause keys, or an
earlier run's summary.json) accepts its cause. It returns the run's summary.json, read. pytest's own `--junitxml`
records the outcome; the run folder also holds difftest's junit.xml, one test case per finding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from difftest.reporting.ci_summary import SUMMARY_FILE


class DifftestChecker:
    """What the `difftest` fixture hands a test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runs = 0

    def check(self, model: str, settings: str | None = None, baseline: Path | None = None,
              extra: tuple[str, ...] = (), timeout_s: float = 1800) -> dict[str, Any]:
        """Run `model` ("module:attribute") under `settings` (globs; default: the default tier); fail the test on a
        finding the baseline does not accept, or when the run itself fails."""
        self.runs += 1
        out = self.folder / f"difftest-run{self.runs}"
        command = [sys.executable, "-m", "difftest.cli", "run", "--out", str(out), "--model", model, *extra]
        command += ["--settings", settings] if settings else []
        command += ["--baseline", str(baseline)] if baseline is not None else []
        # the ranks import the model's module: they see what this test sees
        path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": path})
        summary_file = out / SUMMARY_FILE
        if done.returncode not in (0, 1) or not summary_file.is_file():
            pytest.fail(f"difftest run --model {model} could not finish (exit {done.returncode}):\n"
                        f"{(done.stderr or done.stdout)[-3000:]}", pytrace=False)
        summary: dict[str, Any] = json.loads(summary_file.read_text())
        failing = [f for f in summary["findings"] if not f["accepted"]]
        if failing:
            lines = [f"{len(failing)} finding(s) on {model} (run folder {out}):"]
            for f in failing:
                script = out / f["script"] if f["script"] else None
                lines.append(f"- {f['title']} [{f['upstream']}; cause {f['cause']}; {f['cases']} case(s), e.g. "
                             f"{f['example_setting']}]" + (f"\n  without difftest: python {script}" if script else ""))
            pytest.fail("\n".join(lines), pytrace=False)
        return summary


@pytest.fixture
def difftest(tmp_path: Path) -> DifftestChecker:
    """Run difftest on a model of yours from a test: `difftest.check("pkg.module:adapter", settings=...)`."""
    return DifftestChecker(tmp_path)
