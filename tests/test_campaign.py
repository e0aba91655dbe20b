"""`difftest campaign`: rounds of fresh models, a cause met again is counted and never minimised twice, a new one is
minimised and scripted in the round that first shows it, and an interrupted campaign resumes."""

from __future__ import annotations

import html
import json
from pathlib import Path

from typer.testing import CliRunner

from difftest.campaign.rounds import load_seen, rounds_done
from difftest.cli.main import app
from tests.conftest import PLANTED

SETTINGS = "torchrec/ebc/grid_shard/ws2,faults/shard_off_by_one_row/ws2"


def _campaign(folder: Path, *extra: str) -> str:
    result = CliRunner().invoke(app, ["campaign", str(folder), "--kind", "dlrm", "--settings", SETTINGS, "--plugin",
                                      PLANTED, "--minimise-budget", "15", *extra])
    assert result.exit_code == 0, (result.output[-3000:], result.exception)
    return result.output


def test_a_campaign_counts_what_it_has_seen_and_works_only_on_what_is_new(tmp_path: Path) -> None:
    folder = tmp_path / "hunt"
    said = _campaign(folder, "--cases", "18", "--keep-outputs")  # two rounds of 9 cases, every output kept
    rounds = rounds_done(folder)
    assert [r.name for r in rounds] == ["r0001-s1001", "r0002-s1002"]
    seen = load_seen(folder)
    planted = next(s for s in seen.values() if "shard_off_by_one_row" in s.title or "faults" in s.key)
    assert planted.upstream == "new" and planted.first_round == 1 and planted.rounds == [1, 2], planted
    assert said.count("NEW: ") == 1  # told once, when first seen
    # minimised and scripted in the round that first showed it, counted (not minimised again) in the next
    first, second = (r / "findings" for r in rounds)
    finding = planted.example.split("/")[-1]
    # (a planted fault overrides its family's run: its standalone.txt says it gets no script, and why)
    assert (first / finding / "minimise.json").is_file() and (first / finding / "standalone.txt").is_file()
    assert not (second / finding / "minimise.json").exists() and not (second / finding / "standalone.txt").exists()
    assert all(not (second / f.name / "minimise.json").exists() for f in second.iterdir())
    # each round keeps the plan it was drawn and what each cell gave; the live page shows the cause and the families
    plan = (rounds[1] / "plan.json").read_text()
    assert {"faults", "torchrec"} <= set(json.loads(plan)["families"])
    cells = json.loads((rounds[0] / "cells.json").read_text())
    assert {(c["family"], c["kind"]) for c in cells} >= {("faults", "dlrm"), ("torchrec", "dlrm")}
    first_causes = {key for key, s in load_seen(folder).items() if s.first_round == 1}
    assert sum(c["new"] for c in cells if c["family"] == "faults") == 1
    assert sum(c["new"] for c in cells) == len(first_causes)  # each cause once, in the family its cases ran
    page = (folder / "report.html").read_text()
    assert planted.title in html.unescape(page) and "Where the time went" in page and "faults" in page
    assert 'http-equiv="refresh"' not in page  # written last when the campaign stopped
    # an interrupted round (begun, not marked done) is resumed with its own plan, nothing run again; then the campaign
    # goes on
    (rounds[1] / "round.done").unlink()
    again = _campaign(folder, "--cases", "27", "--keep-outputs")
    assert (rounds[1] / "plan.json").read_text() == plan
    assert "ran 0" in again.replace("\n", " ") and [r.name for r in rounds_done(folder)][-1] == "r0003-s1003"
    assert load_seen(folder)[planted.key].rounds == [1, 2, 3]
    assert load_seen(folder)[planted.key].cases == planted.cases + 1  # round 2 not counted twice
    # the report; and another campaign's options are one line
    assert planted.title[:40] in _campaign(folder, "--report")
    other = CliRunner().invoke(app, ["campaign", str(folder), "--cases", "40", "--kind", "transformer"])
    assert other.exit_code != 0 and "other options" in str(other.exception)
    assert json.loads((folder / "campaign.json").read_text())["kind"] == "dlrm"
    # by default a counted round keeps no ok case's outputs (the earlier rounds are pruned when the campaign goes on),
    # keeps the failing cases' and its verdicts; analysing it again is one line
    kept_before = sum(1 for _ in (rounds_done(folder)[0] / "outputs").rglob("*.safetensors"))
    pruned = _campaign(folder, "--cases", "36")
    assert "deleted the outputs of" in pruned and len(rounds_done(folder)) == 4
    for done in rounds_done(folder):
        assert (done / "pruned.json").is_file() and (done / "comparisons.csv").is_file()
    left = sum(1 for _ in (rounds_done(folder)[0] / "outputs").rglob("*.safetensors"))
    assert 0 < left < kept_before  # the planted fault's failing case keeps its outputs
    again = CliRunner().invoke(app, ["analyze", str(rounds_done(folder)[0])])
    assert again.exit_code != 0 and "deleted once judged" in str(again.exception), (again.output, again.exception)
    # past its disk budget a campaign stops with one line
    over = CliRunner().invoke(app, ["campaign", str(folder), "--kind", "dlrm", "--settings", SETTINGS, "--plugin",
                                    PLANTED, "--minimise-budget", "15", "--cases", "45", "--max-disk", "0.000001"])
    assert over.exit_code != 0 and "past --max-disk" in str(over.exception), (over.output, over.exception)


def test_a_campaign_of_another_stack_is_one_line_and_fresh_keeps_it_aside(tmp_path: Path) -> None:
    """A campaign folder begun on other library versions is refused in one line naming the change; `--fresh` moves it
    aside (kept) and begins anew; a full disk stops a campaign in one line, what it committed kept."""
    import errno

    import pytest

    from difftest.campaign.rounds import STACK_FILE, CampaignConfig, run_campaign, start
    from difftest.contracts.errors import UserError

    folder, config = tmp_path / "hunt", CampaignConfig(kind="dlrm")
    start(folder, config)
    recorded = json.loads((folder / STACK_FILE).read_text())
    assert recorded["torch"] and recorded["difftest"]
    assert start(folder, config) == config  # the same stack resumes
    (folder / STACK_FILE).write_text(json.dumps({**recorded, "torch": "2.6.0+cpu"}))
    with pytest.raises(UserError, match=r"another stack \(torch 2\.6\.0\+cpu -> .*--fresh"):
        start(folder, config)
    start(folder, config, fresh=True)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("hunt.old-")]
    assert len(kept) == 1 and json.loads((kept[0] / STACK_FILE).read_text())["torch"] == "2.6.0+cpu"
    assert json.loads((folder / STACK_FILE).read_text()) == recorded

    def full_disk(where: Path, seed: int, focus: object, plan: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    with pytest.raises(UserError, match="disk is full .* in round 1; .* run the same command to resume"):
        run_campaign(folder, config, full_disk, cases=10)


def test_a_campaign_starts_from_a_checkout_that_is_not_installed(tmp_path: Path, monkeypatch) -> None:
    """A GPU machine runs difftest from a copied checkout on PYTHONPATH, with no package metadata: the campaign's stack
    record says so instead of ending the campaign (PackageNotFoundError on the first device run)."""
    from importlib import metadata

    from difftest.campaign.rounds import STACK_FILE, CampaignConfig, start
    from difftest.storage.stack import FROM_CHECKOUT

    installed = metadata.version

    def checkout_only(name: str) -> str:
        if name == "difftest":
            raise metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(metadata, "version", checkout_only)
    start(tmp_path / "hunt", CampaignConfig(kind="dlrm"))
    assert json.loads((tmp_path / "hunt" / STACK_FILE).read_text())["difftest"] == FROM_CHECKOUT


def test_a_round_grows_with_the_cores_and_stays_small_on_a_laptop() -> None:
    """Rounds of one model and four families left 14 of 16 cores idle between stragglers (415 cases/min against 361
    on 2 cores); the default round is sized to the machine, unchanged up to 7 cores."""
    from difftest.campaign.rounds import round_size

    assert [round_size(n) for n in (1, 2, 4, 7)] == [(1, 4)] * 4
    assert round_size(16) == (4, 8) and round_size(64) == (16, 32)


def test_guided_sampling_favours_what_gave_new_causes_and_keeps_a_floor_for_the_rest() -> None:
    from difftest.campaign.sampling import BATCH_SIZES, EXPLORE, Cell, CellRecord, Sampling, chances, draw

    gave = Cell("pipeline", "dlrm")
    quiet = Cell("ddp", "dlrm")
    untried = Cell("fsdp2", "dlrm")
    dead = Cell("tensorflow", "dlrm")  # every case unsupported
    cells = [gave, quiet, untried, dead]
    records = {gave: CellRecord(rounds=2, cases=40, runnable=40, new=1),
               quiet: CellRecord(rounds=6, cases=120, runnable=120),
               dead: CellRecord(rounds=1, cases=9, runnable=0)}
    guided = chances(cells, records, Sampling.GUIDED)
    assert abs(sum(guided.values()) - 1) < 1e-9
    assert guided[gave] > guided[untried] > guided[quiet] > guided[dead]
    assert guided[dead] == EXPLORE / len(cells)  # the floor of uniform exploration, nothing more
    uniform = chances(cells, records, Sampling.UNIFORM)
    assert set(uniform.values()) == {1 / len(cells)}

    settings_of = {c.family: [f"{c.family}/a", f"{c.family}/b"] for c in cells}
    plan = draw(cells, records, Sampling.GUIDED, settings_of, 2, number=5, seed=1000)
    assert plan == draw(cells, records, Sampling.GUIDED, settings_of, 2, number=5, seed=1000)  # a resume draws alike
    assert len(plan.families) == 2 and plan.kind == "dlrm" and plan.batch_size in BATCH_SIZES
    assert plan.settings == tuple(s for f in plan.families for s in settings_of[f]) and plan.first_index == 5 % 3
    drawn = [draw(cells, records, Sampling.GUIDED, settings_of, 1, number=n, seed=1000).families[0] for n in range(400)]
    assert drawn.count("pipeline") > drawn.count("ddp") > 0 and drawn.count("tensorflow") > 0


def test_a_rounds_cells_count_cases_near_misses_and_each_new_cause_once_per_family() -> None:
    import pandas as pd

    from difftest.campaign.sampling import Cell, round_cells

    cases = pd.DataFrame({"model": ["m"] * 5,
                          "setting": ["ddp/a/ws2", "ddp/b/ws2", "ddp/c/ws2", "tp/a/ws2", "quant/a"],
                          "verdict": ["ok", "ok", "ok", "inconsistent", "unsupported"],
                          "wall_s": [1.0, 2.0, 1.5, 0.5, None]})
    comparisons = pd.DataFrame({
        "model": ["m"] * 6, "setting": ["ddp/a/ws2", "ddp/a/ws2", "ddp/b/ws2", "ddp/c/ws2", "tp/a/ws2", "quant/a"],
        "status": ["ok", "ok", "ok", "ok", "inconsistent", "ok"], "calibrated_ratio": [0.1, 0.7, 0.8, None, 5.0, None],
        "bound_ratio": [None, None, None, 0.95, None, 0.9]})
    family = lambda setting: setting.split("/")[0]
    records = round_cells(cases, comparisons, "dlrm", [["tp/a/ws2", "tp/a/ws3"]], family)
    ddp, tp, quant = (records[Cell(f, "dlrm")] for f in ("ddp", "tp", "quant"))
    # two cases came near: one round that came near; a ratio to a fixed bound (quant's, D3's) is no envelope
    assert (ddp.cases, ddp.runnable, ddp.seconds, ddp.near_miss_rounds, ddp.not_ok, ddp.new) == (3, 3, 4.5, 1, 0, 0)
    assert (tp.cases, tp.runnable, tp.near_miss_rounds, tp.not_ok, tp.new, tp.rounds) == (1, 1, 0, 1, 1, 1)
    assert (quant.near_miss_rounds, quant.runnable) == (0, 0)


def test_a_campaign_killed_mid_round_resumes_with_nothing_lost_or_repeated(tmp_path: Path) -> None:
    """`kill -9` of the campaign and its workers while round 2 sweeps: the same command resumes round 2 where its
    store stopped (its committed cases not run again), counts it once, and goes on."""
    import os
    import re
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    folder = tmp_path / "hunt"
    command = [sys.executable, "-m", "difftest.cli", "campaign", str(folder), "--kind", "dlrm", "--settings", SETTINGS,
               "--plugin", PLANTED, "--minimise-budget", "15", "--cases", "27"]
    started = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def committed(round_name: str) -> int:
        stores = list((folder / "rounds").glob(f"{round_name}/store.sqlite"))
        if not stores:
            return 0
        try:
            with sqlite3.connect(f"file:{stores[0]}?mode=ro", uri=True, timeout=1) as db:
                return int(db.execute("SELECT count(*) FROM cases").fetchone()[0])
        except sqlite3.Error:  # created, its table not yet
            return 0

    deadline = time.time() + 300
    while committed("r0002-*") < 2 and started.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(started.pid, signal.SIGKILL)
    started.wait()
    assert started.returncode == -signal.SIGKILL, "the campaign ended before it could be killed mid-round"
    assert [r.name for r in rounds_done(folder)] == ["r0001-s1001"]
    assert committed("r0002-*") >= 2
    said = _campaign(folder, "--cases", "27").replace("\n", " ")


    total, done, ran = map(int, re.search(r"sweep: (\d+) cases, (\d+) already done, ran (\d+)", said).groups())
    assert done >= 1 and done + ran == total, said  # round 2 resumed: what it had committed is not run again
    assert [r.name for r in rounds_done(folder)] == ["r0001-s1001", "r0002-s1002", "r0003-s1003"]
    assert json.loads((rounds_done(folder)[1] / "round.done").read_text())["cases"] == total
    planted = next(s for s in load_seen(folder).values() if "faults" in s.key)
    assert planted.rounds == [1, 2, 3] and planted.cases == 3  # each round's failing case counted once


def test_a_campaign_begins_a_round_only_where_one_as_long_as_the_longest_fits_its_hours() -> None:
    """`--hours` ends a campaign within them: the first round begins whenever time is left; a later one only where a
    round as long as the longest so far ends by the deadline (a round begun at 7h50 of 8 is not left to run to 8h40)."""
    from difftest.campaign.rounds import round_fits

    assert round_fits(100.0, None, [10_000.0])  # no --hours: only --cases stops it
    assert round_fits(0.0, 3600.0, [])  # the first round, whatever its length
    assert not round_fits(3600.0, 3600.0, [])  # no time left
    assert round_fits(1000.0, 3600.0, [600.0, 2600.0])  # 1000 + 2600 ends on the deadline
    assert not round_fits(1001.0, 3600.0, [600.0, 2600.0])  # the longest round, not the last one, decides
    assert not round_fits(3000.0, 3600.0, [601.0])


def test_a_campaign_told_hours_stops_before_a_round_that_would_end_past_them(tmp_path: Path, monkeypatch) -> None:
    """With `--hours`, rounds go on while one as long as the longest the campaign has counted still ends in time; then
    it says how long it left. An interrupted round resumed by a later call is no measure of a round (only its rest
    ran), so the rounds counted before it decide. The rounds here are a stand-in that only advances a clock."""
    import types

    import pandas as pd

    from difftest.campaign import rounds
    from difftest.campaign.rounds import CampaignConfig, CampaignEvents, round_lengths, run_campaign

    clock = [0.0]
    monkeypatch.setattr(rounds, "time", types.SimpleNamespace(time=lambda: clock[0]))
    lengths = iter([600.0, 1000.0, 500.0, 500.0, 500.0, 50.0])
    stopped: list[tuple[float, float]] = []

    def a_round(where: Path, seed: int, focus: object, plan: object) -> object:
        where.mkdir(parents=True, exist_ok=True)
        (where / "run.json").write_text("{}")
        clock[0] += next(lengths)  # a seventh round would raise StopIteration: the test's failure
        cases = pd.DataFrame({"setting": ["reference"], "verdict": ["ok"], "wall_s": [1.0]})
        return types.SimpleNamespace(findings=[], analysis=types.SimpleNamespace(cases=cases, comparisons=pd.DataFrame()))

    folder, config = tmp_path / "hunt", CampaignConfig(kind="dlrm")
    events = CampaignEvents(out_of_time=lambda left, longest: stopped.append((left, longest)))
    done = run_campaign(folder, config, a_round, hours=1.0, events=events, keep_outputs=True)
    # 0 → 600 → 1600 → 2100 → 2600 → 3100 s; a sixth round as long as the longest (1000 s) would end at 4100
    assert [r.seconds for r in done] == [600.0, 1000.0, 500.0, 500.0, 500.0]
    assert stopped == [(500.0, 1000.0)]
    # a round interrupted once begun (its run folder written, not counted) is resumed and takes 50 s: the next round
    # would take the campaign's longest, 1000 s, past the 900 s this call has
    (folder / "rounds" / f"r0006-s{config.first_seed + 6}").mkdir(parents=True)
    (folder / "rounds" / f"r0006-s{config.first_seed + 6}" / "run.json").write_text("{}")
    again = run_campaign(folder, config, a_round, hours=900 / 3600, events=events, keep_outputs=True)
    assert [r.number for r in again] == [6] and round_lengths(folder) == [600.0, 1000.0, 500.0, 500.0, 500.0]
    assert stopped[-1] == (850.0, 1000.0)


def test_a_campaign_resumed_from_another_folder_imports_its_plugin_where_its_rounds_found_it(
        tmp_path: Path, monkeypatch) -> None:
    """A campaign begun with `--plugin` in the plugin's own folder (importable there, not elsewhere) resumes from any
    folder: its rounds' run.json say where the plugin was imported from."""
    import os
    import sys

    import pytest

    from difftest.campaign.rounds import CampaignConfig, universe
    from difftest.contracts import registry
    from difftest.contracts.errors import UserError

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(registry, "_LOADED_PLUGINS", set(registry._LOADED_PLUGINS))  # none left for later tests
    project, folder = tmp_path / "project", tmp_path / "hunt"
    project.mkdir()
    (project / "difftest_campaign_plugin.py").write_text("LOADED = True\n")
    config = CampaignConfig(settings="ddp/*", kind="dlrm", plugins=("difftest_campaign_plugin",))
    with pytest.raises(UserError, match="difftest_campaign_plugin"):
        universe(config, folder)  # no round yet says where it is
    (folder / "rounds" / "r0001-s1001").mkdir(parents=True)
    (folder / "rounds" / "r0001-s1001" / "run.json").write_text(json.dumps({"plugin_folders": [str(project)]}))
    assert universe(config, folder).cells
    assert sys.modules["difftest_campaign_plugin"].LOADED
