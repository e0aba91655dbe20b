"""`difftest campaign DIR`: bug hunting for hours, told only what is new.

A campaign is a folder of rounds. Each round is an ordinary run folder (`rounds/r0001-s<seed>/`): models drawn from a
fresh seed, swept under the campaign's settings, judged and triaged as every run is. What a round finds is compared
with every signature the campaign has seen (`signatures.json`, one entry per root cause: a manifest entry's id, else
the finding's signature) and with the manifest: a known or already seen cause is counted, never minimised or given a
script again; a new one is minimised, gets its checked standalone script and ISSUE.md in its round, and is announced
in one line. A campaign stops at its time or case budget and resumes after any interruption: a round's run folder
resumes as every run does (nothing committed runs again), and a round counts once it is marked done. A campaign
belongs to the difftest release and library stack it began on (`stack.json`): its signatures and counts mean nothing
across stacks, so another stack is told in one line, and `--fresh` moves the old campaign aside and starts anew.
Disk stays bounded: once a round is counted, the outputs of its ok cases are deleted (their verdicts and distances
stay in its CSVs; `pruned.json` says so), and a campaign past its disk budget stops with one line.
"""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from difftest.campaign.sampling import (
    Cell,
    CellRecord,
    RoundPlan,
    Sampling,
    cell_totals,
    draw,
    records_from_json,
    records_to_json,
    round_cells,
)
from difftest.contracts.errors import UserError
from difftest.generation.generate import RUN_FILE
from difftest.pipeline import PipelineOptions
from difftest.reporting.ci_summary import cause_key
from difftest.storage.artifacts import atomic_write_text

CAMPAIGN_FILE = "campaign.json"
STACK_FILE = "stack.json"  # the difftest release and the library versions the campaign began on
SIGNATURES_FILE = "signatures.json"
ROUND_DONE = "round.done"  # in a round's folder once its findings are counted
PLAN_FILE = "plan.json"  # in a round's folder before it runs: what it was drawn to run (`RoundPlan`)
CELLS_FILE = "cells.json"  # in a round's folder once counted: what each (family × kind) cell gave (`CellRecord`)


@dataclass(frozen=True)
class CampaignConfig:
    """What every round of a campaign runs: a campaign folder keeps it, and a resumed campaign must ask the same."""

    settings: str | None = None
    tier: str | None = None
    kind: str = "all"
    models: int = 1  # per kind and round
    first_seed: int = 1000  # round r draws its models from seed first_seed + r
    minimise_budget_s: float = PipelineOptions.minimise_budget_s
    plugins: tuple[str, ...] = ()
    sampling: str = str(Sampling.GUIDED)  # how rounds pick their cells (`difftest.campaign.sampling`)
    families_per_round: int = 4

    @classmethod
    def load(cls, folder: Path) -> CampaignConfig | None:
        path = folder / CAMPAIGN_FILE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            if "minimize_budget_s" in raw:  # its name in campaigns begun before the spelling was one
                raw["minimise_budget_s"] = raw.pop("minimize_budget_s")
            return cls(**{**raw, "plugins": tuple(raw.get("plugins", ()))})
        except (ValueError, TypeError) as exc:
            raise UserError(f"{path}: not a difftest campaign ({exc}); start a new campaign in another folder") from None


@dataclass
class Seen:
    """One root cause the campaign has met."""

    key: str  # the manifest entry's id, else the finding's signature
    title: str
    upstream: str  # known, related, unreported (the manifest's), or new
    first_round: int
    first_seen: float  # when (epoch seconds)
    cases: int = 0
    rounds: list[int] = field(default_factory=list)
    example: str = ""  # the round folder and finding id of its first showing: where its script and ISSUE.md are

    @property
    def minimised_here(self) -> bool:
        """Whether the campaign itself minimised it (a cause no manifest entry explains)."""
        return self.upstream == "new"


def load_seen(folder: Path) -> dict[str, Seen]:
    path = folder / SIGNATURES_FILE
    if not path.is_file():
        return {}
    try:
        return {key: Seen(**entry) for key, entry in json.loads(path.read_text()).items()}
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path}: damaged ({exc}); every round's findings are in rounds/*/findings.csv: move it "
                        "aside and rerun the campaign to count them again") from None


def save_seen(folder: Path, seen: dict[str, Seen]) -> None:
    atomic_write_text(json.dumps({k: asdict(v) for k, v in seen.items()}, indent=1), folder / SIGNATURES_FILE)


@dataclass
class RoundResult:
    number: int
    folder: Path
    cases: int
    seconds: float
    new: list[Seen]
    counted: int  # findings of causes already seen or known
    plan: RoundPlan | None = None


@dataclass(frozen=True)
class Universe:
    """The cells a campaign draws from: every (setting family × model kind) pair where some selected setting of the
    family runs on this machine and supports some model variant of the kind; `settings_of` a family's selected
    settings (their references and calibrations the sweep adds by itself)."""

    cells: list[Cell]
    settings_of: dict[str, list[str]]


def plugin_folders(folder: Path) -> tuple[str, ...]:
    """Where the campaign's rounds found their plugin modules (each round's run.json: `run_plugin_folders`): a campaign
    begun with `--plugin my_settings` in that module's folder resumes from any other."""
    from difftest.contracts.spec import run_plugin_folders

    found = [f for where in sorted((folder / "rounds").glob(f"*/{RUN_FILE}")) for f in run_plugin_folders(where)]
    return tuple(dict.fromkeys(found))


def universe(config: CampaignConfig, folder: Path | None = None) -> Universe:
    """The cells `config` draws from; its plugins are looked for where the rounds of the campaign in `folder` found
    them too."""
    from difftest.campaign.sampling import INDEX_CYCLE
    from difftest.contracts.registry import (
        generator_kinds,
        get_generator,
        kind_unavailable,
        load_plugins,
        select_settings,
    )
    from difftest.contracts.setting import SettingRole

    load_plugins(config.plugins, plugin_folders(folder) if folder is not None else ())
    settings = [s for s in select_settings(config.settings, config.tier)
                if s.role is not SettingRole.CALIBRATION and s.available() is None]
    judged = {s.family for s in settings if s.role is SettingRole.JUDGED}  # a family of roots alone judges nothing
    settings_of: dict[str, list[str]] = {}
    for s in settings:
        if s.family in judged:
            settings_of.setdefault(s.family, []).append(s.name)
    kinds = [k for k in (generator_kinds() if config.kind == "all" else [config.kind]) if kind_unavailable(k) is None]
    cells = []
    for kind in kinds:
        variants = [get_generator(kind).spec(config.first_seed, index) for index in range(INDEX_CYCLE)]
        for family in sorted(settings_of):
            if any(s.family == family and s.supports(v) is None for s in settings for v in variants):
                cells.append(Cell(family, kind))
    if not cells:
        raise UserError(f"campaign: no selected setting supports any model of kind {config.kind!r} on this machine; "
                        "`difftest settings list` shows what runs here")
    return Universe(cells, settings_of)


def family_of(setting: str) -> str:
    """The family a setting name belongs to (a calibration's or reference's too)."""
    from difftest.contracts.registry import get_setting

    try:
        return get_setting(setting).family
    except UserError:  # a plugin's setting this process has not loaded
        return setting.split("/")[0]


def cell_records(folder: Path) -> dict[Cell, CellRecord]:
    """What every counted round gave, per cell."""
    return cell_totals([records_from_json((where / CELLS_FILE).read_text()) for where in rounds_done(folder)
                        if (where / CELLS_FILE).is_file()])


def round_plan(folder: Path, where: Path, config: CampaignConfig, space: Universe, number: int) -> RoundPlan:
    """The plan a round was drawn (kept in its folder: a resumed round runs what it began), else a new draw from
    what the counted rounds gave."""
    if (where / PLAN_FILE).is_file():
        return RoundPlan.load(where / PLAN_FILE)
    plan = draw(space.cells, cell_records(folder), Sampling(config.sampling), space.settings_of,
                config.families_per_round, number, config.first_seed)
    where.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.to_json(), where / PLAN_FILE)
    return plan


@dataclass
class CampaignEvents:
    """What a campaign tells as it goes (the CLI prints it)."""

    round_started: Callable[[int, Path, RoundPlan], None] = lambda number, folder, plan: None
    new_signature: Callable[[Seen], None] = lambda seen: None
    round_done: Callable[[RoundResult], None] = lambda result: None
    pruned: Callable[[Path, int, int], None] = lambda where, files, freed: None  # a round's ok outputs deleted
    # the campaign stopped before its hours were spent: (seconds left, the longest round's seconds)
    out_of_time: Callable[[float, float], None] = lambda left, longest: None


def made_by() -> dict[str, Any]:
    """This difftest's release and the libraries a finding can live in, as `difftest --version` shows them."""
    from difftest.storage import stack

    return {"difftest": stack.difftest_version(), **stack.current()["libraries"]}


def stack_change(before: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two `made_by` records, as `name old -> new` (absent: "none")."""
    return ", ".join(f"{name} {before.get(name, 'none')} -> {now.get(name, 'none')}"
                     for name in sorted(set(before) | set(now)) if before.get(name) != now.get(name))


def round_size(ranks: int) -> tuple[int, int]:
    """Models per kind and setting families per round for a machine of `ranks` cores: 1 and 4 up to 7 cores, more
    above. A round ends with its slowest case, and its generation, judging and triage run between sweeps: rounds of
    one model and four families kept 16 cores at 415 cases/min against 361 on 2 of them, rounds of 4 models and 8
    families at 1265 (`python -m benchmarks.campaign_cores`, benchmarks/RESULTS.md)."""
    return max(1, ranks // 4), max(4, ranks // 2)


def start(folder: Path, config: CampaignConfig, fresh: bool = False) -> CampaignConfig:
    """Make the campaign folder, or check that an existing one asks the same and was made on this stack (one line
    otherwise). `fresh`: an existing campaign is moved aside (`<folder>.old-<time>`) and a new one begun."""
    if fresh and folder.exists():
        kept = folder.with_name(f"{folder.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        folder.rename(kept)
    existing = CampaignConfig.load(folder)
    if existing is not None:
        if existing != config:
            raise UserError(f"{folder} holds a campaign with other options ({json.dumps(asdict(existing))}); run it "
                            "with the same options to resume it, or start a new one in another folder")
        recorded, now = _recorded_stack(folder), made_by()
        if recorded is not None and recorded != now:
            raise UserError(f"{folder} holds a campaign begun on another stack ({stack_change(recorded, now)}): its "
                            "signatures and counts would mix stacks; rerun with --fresh to start anew (the old "
                            "campaign is moved aside, kept), or give another folder")
        if recorded is None:  # begun by a difftest that kept no record: this stack adopts it
            atomic_write_text(json.dumps(now, indent=1), folder / STACK_FILE)
        return existing
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json.dumps(asdict(config), indent=1), folder / CAMPAIGN_FILE)
    atomic_write_text(json.dumps(made_by(), indent=1), folder / STACK_FILE)
    return config


def _recorded_stack(folder: Path) -> dict[str, Any] | None:
    path = folder / STACK_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: damaged ({exc}); rerun with --fresh to start anew (the old campaign is kept)") from None
    return recorded if isinstance(recorded, dict) else None


def rounds_done(folder: Path) -> list[Path]:
    return sorted(p.parent for p in (folder / "rounds").glob(f"*/{ROUND_DONE}"))


def round_folder(folder: Path, config: CampaignConfig, number: int) -> Path:
    return folder / "rounds" / f"r{number:04d}-s{config.first_seed + number}"


def begun(where: Path) -> bool:
    """Whether a round's run was begun in `where` (its run.json written): run again, only its rest runs."""
    return (where / RUN_FILE).is_file()


def round_lengths(folder: Path) -> list[float]:
    """The seconds each counted round of the campaign took, those resumed after an interruption left out (their
    seconds are the rest's, not a round's)."""
    records = [json.loads((p / ROUND_DONE).read_text()) for p in rounds_done(folder)]
    return [float(r["seconds"]) for r in records if not r.get("resumed")]


def cases_done(folder: Path) -> int:
    return sum(int(json.loads((p / ROUND_DONE).read_text())["cases"]) for p in rounds_done(folder))


def run_round(folder: Path, config: CampaignConfig, number: int, run: Callable[..., Any],
              events: CampaignEvents, prune: bool = True, space: Universe | None = None) -> RoundResult:
    """One round: its plan drawn (`round_plan`), then `run(round_folder, seed, focus, plan)` generates, sweeps and
    analyses a run folder (the CLI's job, its minimisation and scripts only for findings `focus` accepts) and returns
    its pipeline result; its findings are then counted against what the campaign has seen, what each cell gave
    recorded, and (`prune`) the outputs of its ok cases deleted."""
    seed = config.first_seed + number
    where = round_folder(folder, config, number)
    plan = round_plan(folder, where, config, space or universe(config, folder), number)
    events.round_started(number, where, plan)
    started, resumed = time.time(), begun(where)
    seen = load_seen(folder)
    result = run(where, seed, lambda f: f.known is None and cause_key(f) not in seen, plan)
    new, counted = [], 0
    for f in result.findings:
        key = cause_key(f)
        if key in seen:
            entry = seen[key]
            counted += 1
        else:
            entry = seen[key] = Seen(key, f.known.title if f.known else f.title, str(f.upstream), number, time.time(),
                                     example=f"{where.name}/findings/{f.id}")
            if f.known is None:
                new.append(entry)
                events.new_signature(entry)
            else:
                counted += 1
        if number not in entry.rounds:  # a round counted before its interruption is not counted twice
            entry.cases += len(f.rows)
            entry.rounds = sorted(set(entry.rounds) | {number})
    save_seen(folder, seen)
    # the causes this round showed the campaign first, known to the manifest or not (also where an interruption came
    # between counting them and this line): what guided sampling rewards
    new_settings = [list(f.rows["setting"]) for f in result.findings if seen[cause_key(f)].first_round == number]
    atomic_write_text(records_to_json(round_cells(
        result.analysis.cases, result.analysis.comparisons, plan.kind, new_settings, family_of)), where / CELLS_FILE)
    cases = len(result.analysis.cases)
    atomic_write_text(json.dumps({"cases": cases, "seed": seed, "seconds": time.time() - started,
                                  "finished": time.time(), "resumed": resumed}), where / ROUND_DONE)
    done = RoundResult(number, where, cases, time.time() - started, new, counted, plan)
    events.round_done(done)
    if prune:
        prune_round(where, events)  # after the round counts: an interruption in between leaves it whole, pruned later
    return done


def prune_round(where: Path, events: CampaignEvents) -> None:
    """Delete the outputs of a counted round's ok cases (the store's rows and the round's CSVs keep their verdicts
    and distances; the cases its analysis found not ok — inconsistencies.csv — keep theirs) and mark it pruned."""
    import pandas as pd

    from difftest.contracts.status import Status
    from difftest.storage.integrity import PRUNED_FILE
    from difftest.storage.store import Store

    if (where / PRUNED_FILE).is_file():
        return
    not_ok = pd.read_csv(where / "inconsistencies.csv", usecols=["model", "setting"])
    keep = set(zip(not_ok["model"], not_ok["setting"], strict=True))
    store = Store(where)
    try:
        files = [store.outputs_dir / r.outputs for r in store.records()
                 if r.status == Status.OK and r.outputs and (r.model, r.setting) not in keep]
    finally:
        store.close()
    freed = 0
    for path in files:
        if path.is_file():
            freed += path.stat().st_size
            path.unlink()
    atomic_write_text(json.dumps({"deleted": len(files), "bytes": freed, "why": "outputs of ok cases, deleted once "
                                  "the campaign counted the round"}), where / PRUNED_FILE)
    events.pruned(where, len(files), freed)


def disk_used(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_campaign(folder: Path, config: CampaignConfig, run: Callable[..., Any], hours: float | None = None,
                 cases: int | None = None, events: CampaignEvents | None = None,
                 fresh: bool = False, max_disk_bytes: float | None = None,
                 keep_outputs: bool = False) -> list[RoundResult]:
    """Rounds until `hours` (of this call) or `cases` (of the whole campaign) are spent; a round begun and not done
    (an interrupted call) is the first to run, and resumes. A full disk stops the campaign with one line: what the
    round committed stays, and the same command resumes it once there is room. Past `max_disk_bytes` (counted after
    each round, its ok outputs pruned unless `keep_outputs`) the campaign stops with one line too."""
    events = events or CampaignEvents()
    config = start(folder, config, fresh)
    for done_round in rounds_done(folder) if not keep_outputs else []:  # counted, interrupted before its pruning
        prune_round(done_round, events)
    deadline = time.time() + hours * 3600 if hours is not None else None
    space = universe(config, folder)
    results: list[RoundResult] = []
    number = len(rounds_done(folder)) + 1

    def cases_left() -> bool:
        return cases is None or cases_done(folder) < cases

    def may_begin() -> bool:  # a round begun and interrupted resumes whenever time is left: only its rest runs
        if begun(round_folder(folder, config, number)):
            return deadline is None or time.time() < deadline
        return round_fits(time.time(), deadline, round_lengths(folder))

    while may_begin() and cases_left():
        if max_disk_bytes is not None and (used := disk_used(folder)) > max_disk_bytes:
            raise UserError(f"{folder} holds {used / 1e9:.2f} GB, past --max-disk {max_disk_bytes / 1e9:g} GB (the "
                            f"ok cases' outputs of its {len(rounds_done(folder))} rounds already deleted): the campaign "
                            "stopped; move rounds aside or raise --max-disk, and the same command goes on")
        try:
            results.append(run_round(folder, config, number, run, events, prune=not keep_outputs, space=space))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise UserError(f"{folder}: the disk is full ({exc.strerror}) in round {number}; the campaign stopped "
                            f"with {len(rounds_done(folder))} round(s) counted and what round {number} committed "
                            "kept: free space and run the same command to resume") from None
        number += 1
    lengths = round_lengths(folder)
    if deadline is not None and lengths and time.time() < deadline and cases_left():
        events.out_of_time(deadline - time.time(), max(lengths))
    return results


def round_fits(now: float, deadline: float | None, seconds: list[float]) -> bool:
    """Whether another round may begin, a pure function: before the deadline (`--hours`), and, once the campaign has
    counted whole rounds (`seconds`, each one's: `round_lengths`), with time left for one as long as the longest of
    them: a campaign aims to end within its hours, not a round past them. A campaign's first round begins whenever
    time is left."""
    if deadline is None:
        return True
    return now < deadline and (not seconds or now + max(seconds) <= deadline)


def report_rows(folder: Path) -> list[Seen]:
    """Every cause the campaign has seen, the new ones first, then by first round."""
    return sorted(load_seen(folder).values(), key=lambda s: (s.upstream != "new", s.first_round, s.key))
