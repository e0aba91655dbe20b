"""`difftest campaign`: rounds of fresh models, a cause met again is counted and never minimised twice, a new one is
minimised and scripted in the round that first shows it, and an interrupted campaign resumes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from difftest.campaign import load_seen, rounds_done
from difftest.cli import app
from tests.conftest import PLANTED

SETTINGS = "torchrec/ebc/grid_shard/ws2,faults/shard_off_by_one_row/ws2"


def _campaign(folder: Path, *extra: str) -> str:
    result = CliRunner().invoke(app, ["campaign", str(folder), "--kind", "dlrm", "--settings", SETTINGS, "--plugin",
                                      PLANTED, "--minimize-budget", "15", *extra])
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
    assert (first / finding / "minimize.json").is_file() and (first / finding / "standalone.txt").is_file()
    assert not (second / finding / "minimize.json").exists() and not (second / finding / "standalone.txt").exists()
    assert all(not (second / f.name / "minimize.json").exists() for f in second.iterdir())
    # an interrupted round (begun, not marked done) is resumed, nothing run again; then the campaign goes on
    (rounds[1] / "round.done").unlink()
    again = _campaign(folder, "--cases", "27", "--keep-outputs")
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
                                    PLANTED, "--minimize-budget", "15", "--cases", "45", "--max-disk", "0.000001"])
    assert over.exit_code != 0 and "past --max-disk" in str(over.exception), (over.output, over.exception)


def test_a_campaign_of_another_stack_is_one_line_and_fresh_keeps_it_aside(tmp_path: Path) -> None:
    """A campaign folder begun on other library versions is refused in one line naming the change; `--fresh` moves it
    aside (kept) and begins anew; a full disk stops a campaign in one line, what it committed kept."""
    import errno

    import pytest

    from difftest.campaign import STACK_FILE, CampaignConfig, run_campaign, start
    from difftest.errors import UserError

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

    def full_disk(where: Path, seed: int, focus: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    with pytest.raises(UserError, match="disk is full .* in round 1; .* run the same command to resume"):
        run_campaign(folder, config, full_disk, cases=10)
