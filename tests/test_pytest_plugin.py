"""The `difftest` fixture in a team's own test suite: the documentation's adapter passes under DDP and FSDP2; the same
model with BatchNorm (per-rank statistics under DDP) fails the test with the finding and its script's path; a
baseline that accepts that cause lets it pass; and the run's summary.json and junit.xml say the same."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]

TESTS = '''
import json
from pathlib import Path

SETTINGS = "ddp/default/ws2,fsdp2/per-layer/reshard/fp32/ws2"

def test_mine_trains_the_same(difftest):
    summary = difftest.check("my_model:adapter", settings=SETTINGS, extra=("--minimise-budget", "0"))
    assert summary["findings"] == [] and summary["cases"]["ok"] >= 4

def test_mine_with_batchnorm(difftest):
    difftest.check("my_bn_model:adapter", settings=SETTINGS, extra=("--minimise-budget", "0"))

def test_mine_with_batchnorm_accepted(difftest, tmp_path):
    accepted = Path(BASELINE)
    summary = difftest.check("my_bn_model:adapter", settings=SETTINGS, baseline=accepted,
                             extra=("--minimise-budget", "0"))
    assert summary["findings"] and all(f["accepted"] for f in summary["findings"])
'''


def test_the_fixture_passes_a_clean_model_and_fails_a_planted_mistake_with_its_finding(pytester: pytest.Pytester) -> None:
    example = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "your-model.md").read_text(), re.DOTALL).group(1)
    pytester.makepyfile(my_model=example, my_bn_model=example.replace(
        "torch.nn.Linear(8, 16), torch.nn.Tanh()", "torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh()"))
    pytester.syspathinsert()
    # the cause the BatchNorm finding has: DDP's disagreement, in the family's signature (a baseline made by hand)
    baseline = pytester.path / "accepted.json"
    pytester.makepyfile(test_mine=TESTS.replace("BASELINE", repr(str(baseline))))
    first = pytester.runpytest_subprocess("-k", "not accepted", "-p", "no:cacheprovider", timeout=1200)
    first.assert_outcomes(passed=1, failed=1)
    said = first.stdout.str()
    assert "finding(s) on my_bn_model:adapter" in said and "your-model" in said, said[-3000:]
    # its run folder's summary names the cause; accepting it in a baseline lets the same check pass
    summaries = sorted(pytester.path.glob("**/difftest-run1/summary.json"), key=lambda p: p.stat().st_mtime)
    bn = next(json.loads(p.read_text()) for p in reversed(summaries) if json.loads(p.read_text())["findings"])
    baseline.write_text(json.dumps([f["cause"] for f in bn["findings"]]))
    junit = next(p for p in reversed(summaries) if json.loads(p.read_text())["findings"]).with_name("junit.xml")
    assert 'failures="0"' not in junit.read_text() and 'classname="difftest.inconsistent"' in junit.read_text()
    second = pytester.runpytest_subprocess("-k", "accepted", "-p", "no:cacheprovider", timeout=1200)
    second.assert_outcomes(passed=1)
