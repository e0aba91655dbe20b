"""report.html in a real headless browser: Debian's Chromium, driven by Playwright."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from difftest.judging.analysis import analyze
from difftest.pipeline import triage_run
from difftest.reporting.report import write_report
from difftest.runner.sweep import SweepOptions, run_sweep
from tests.conftest import PLANTED


def _chromium() -> str:
    """The system's Chromium (Debian's `chromium`; `.ci/run` installs it where it can)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no Chromium here (apt-get install chromium, as .ci/run does): report.html not opened in a browser")
    return found


def test_report_loads_in_a_browser_without_errors_and_lists_every_finding(fresh_run: Path, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright missing: install the [test] extra")
    browser_path = _chromium()
    run_sweep(fresh_run, SweepOptions(settings="faults/shard_off_by_one_row/ws2,faults/raises/ws2,"
                                               "torchrec/ebc/table_wise/ws2,torchrec/ebc/grid_shard/ws2",
                                      plugins=(PLANTED,), timeout_s=60))
    analysis = analyze(fresh_run, plugins=(PLANTED,))
    findings = triage_run(fresh_run, analysis)
    page_path = write_report(fresh_run, analysis, findings)
    expected = pd.read_csv(fresh_run / "findings.csv")
    assert len(expected) == len(findings) >= 3
    problems: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:"))
                else problems.append(f"network request: {r.url}"))  # self-contained: nothing fetched
        page.goto(page_path.as_uri(), wait_until="load")
        page.wait_for_selector(".js-plotly-plot .main-svg")  # plotly ran and drew
        ranks = page.locator("#findings tbody tr td:first-child").all_inner_texts()
        ids = page.locator("#findings tbody tr td:nth-child(2)").all_inner_texts()  # after the rank
        plots = page.locator(".js-plotly-plot").count()
        folded = page.locator("details#calibration-runs:not([open]) .js-plotly-plot").count()
        sections = page.locator("section.finding").count()
        screenshot = tmp_path / "report.png"
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    assert problems == []
    assert ids == list(expected["id"]) and ranks == [str(r) for r in expected["rank"]] == [str(i + 1) for i in
                                                                                              range(len(ids))]
    html = page_path.read_text()  # each finding leads to what a maintainer acts on, from the run folder
    assert all(f'href="findings/{i}/ISSUE.md"' in html and f'href="findings/{i}/repro.py"' in html for i in ids)
    assert plots == 3 and folded == 1 and sections == len(findings)  # the calibration runs' map folded away
    assert screenshot.stat().st_size > 10_000
