"""Every family with an emitter writes a standalone script on every built-in model kind it runs, on seeds other than
the default job's: an emitter that only works on seed 0's models (a table name it assumed, a layer it expected) fails
here, not in a user's run."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from difftest.contracts.registry import generator_kinds, get_setting, tier, traits_of
from difftest.contracts.setting import Setting
from difftest.contracts.spec import RunConfig
from difftest.contracts.tolerance import Tolerance
from difftest.findings import known
from difftest.findings.signature import computation_order, first_divergences
from difftest.generation.generate import generate
from difftest.judging.analysis import analyze, envelope_spread
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.scripts.write import emit
from difftest.storage.store import Store

# one seed in the e2e tier (its checked scripts included), another with the slow sweeps: one seed's sweep and ~70
# scripts take ~5 minutes of a 2-core host
SEEDS = (pytest.param(3, marks=pytest.mark.e2e), pytest.param(11, marks=pytest.mark.slow))
# an emitter's refusal names what its script cannot hold (a reason of the case's); a defect of ours says so
DEFECT = "a defect of difftest's"


# a family's setting here where its default tier's first would cost the sweep most of its time: the distributed resume
# starts five new processes a case (DDP on 2, FSDP2 on 3), two fifths of the sweep's rank-seconds on the zoo's models;
# the same emitter's two-phase script over one checkpoint, on every kind, is what this test asks of it (the sharded
# reshard's script is run in tests/test_standalone.py)
REPRESENTATIVE = {"resume": "resume/single/single/k3/fast-forward"}


def _families_with_emitters() -> list[str]:
    """One setting of each family that writes scripts: the default tier's first of it, or its `REPRESENTATIVE`."""
    chosen: dict[str, str] = {}
    for setting in tier("default"):
        if type(setting).standalone is not Setting.standalone and setting.family not in chosen:
            chosen[setting.family] = REPRESENTATIVE.get(setting.family, setting.name)
    assert set(REPRESENTATIVE.values()) <= {s.name for s in tier("default")}, REPRESENTATIVE
    return sorted(chosen.values())


def _known_to_hang(kind: str, setting: str) -> bool:
    """Whether the manifest says the setting times out on this kind on the installed releases (a library bug that
    holds a worker group for the whole timeout, and leaves no case to write a script of)."""
    versions = known.installed_versions({i.library for i in known.manifest()})
    return known.match(setting, "timeout", "no answer from rank(s)", traits_of(kind), versions=versions) is not None


@pytest.mark.parametrize("seed", SEEDS)
# a sweep, ~240 scripts written and ~20 run: past the default 600 s on a slow hour of a 2-core host
@pytest.mark.timeout(1200)
def test_every_emitter_writes_a_script_on_every_kind_on_a_seed_not_the_default_jobs(tmp_path: Path, seed: int) -> None:
    import generators  # noqa: F401 -- registers the kinds
    import settings  # noqa: F401 -- registers the settings

    kinds = tuple(generator_kinds())
    families = _families_with_emitters()
    assert len(families) >= 12, families
    run_dir = tmp_path / f"s{seed}"
    generate(run_dir, RunConfig(seed=seed, models=1, kinds=kinds))
    models = sorted(p.name for p in (run_dir / "models").iterdir())
    pairs = tuple((m, s) for m in models for s in families if not _known_to_hang(m.rsplit("-s", 1)[0], s))
    assert len(pairs) < len(models) * len(families) and all(s.startswith("dtensor/") for s in
                                                            set(families) - {s for _, s in pairs}), pairs
    run_sweep(run_dir, SweepOptions(pairs=pairs, timeout_s=180))
    runs = [run_dir]

    emitted, checked = [], []
    for run_dir in runs:
        analysis = analyze(run_dir)
        divergences = first_divergences(analysis).set_index(["model", "setting"])
        store = Store(run_dir)
        try:
            messages = {(r.model, r.setting): r.message for r in store.records()}
        finally:
            store.close()
        rows = analysis.comparisons[analysis.comparisons["tensor"] != ""]
        for (model, setting), row in analysis.cases.set_index(["model", "setting"]).iterrows():
            verdict = str(row["verdict"])
            if verdict not in ("ok", "inconsistent", "error", "crash"):
                continue  # unsupported (the setting does not run this kind) or a timeout: no case to write
            if verdict == "inconsistent":
                firsts = ["/".join(divergences.loc[(model, setting), ["phase", "tensor"]])]
            elif verdict == "ok":  # an agreement's script shows it agree (exit 0): from a trained parameter on (what
                # a training script compares), else from the case's first tensor (what an evaluation's compares)
                mine = rows[(rows["model"] == model) & (rows["setting"] == setting)]
                ordered = sorted(mine.itertuples(), key=lambda r: computation_order(r.kind, r.phase, r.tensor))
                firsts = list(dict.fromkeys([f"{r.phase}/{r.tensor}" for r in ordered
                                             if r.phase.startswith("param_after_step")][:1]
                                            + [f"{r.phase}/{r.tensor}" for r in ordered[:1]]))
            else:
                firsts = [""]
            if not firsts:
                continue  # an agreement with no tensor compared: nothing a script would show
            status = "inconsistent" if verdict == "ok" else verdict
            emitted.append((run_dir, model, setting, verdict, status, firsts, messages.get((model, setting), "")))
    assert len({(m.rsplit("-s", 1)[0], s) for _, m, s, *_ in emitted}) >= 30, "too few cases ran to say anything"

    # scripts run (each 6-16 s: its libraries imported, its ranks started, twice where it is reduced): on the two
    # kinds every emitting family but the Keras ones runs, every disagreement and failure, and one agreement per family
    # (the DLRM's where it has one)
    checked_kinds = ("dlrm", "transformer")
    candidates = sorted((checked_kinds.index(kind), model, setting, verdict) for _, model, setting, verdict, *_
                        in emitted if (kind := model.rsplit("-s", 1)[0]) in checked_kinds)
    to_check = {(model, setting) for _, model, setting, verdict in candidates if verdict != "ok"}
    agreement_of: dict[str, tuple[str, str]] = {}
    for _, model, setting, verdict in candidates:
        if verdict == "ok":
            agreement_of.setdefault(get_setting(setting).family, (model, setting))
    to_check |= set(agreement_of.values())

    def write(item: tuple) -> tuple:
        run_dir, model, setting, _, status, firsts, message = item
        check = 180.0 if (model, setting) in to_check else 0.0
        for first in firsts:
            result = emit(run_dir, f"E{zlib.crc32(f'{model} {setting}'.encode()):08x}", f"{setting} on {model}",
                          status, run_dir / "models" / model, setting, first, envelope_spread(run_dir, model, setting),
                          Tolerance(), check_timeout_s=check, message=message)
            if result.path is not None:
                break
        return item, result

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(write, emitted))
    defects = [f"{item[1]} × {item[2]}: {result.why_not}" for item, result in results
               if result.path is None and DEFECT in result.why_not]
    assert not defects, "\n".join(defects)
    written = [(item, result) for item, result in results if result.path is not None]
    assert len({get_setting(item[2]).family for item, _ in written}) >= 10, written
    for item, result in written:
        if result.checked is None:
            continue
        checked.append(item)
        expected = 0 if item[3] == "ok" else 1
        assert result.checked.exit_code == expected, (item[1:4], result.checked.output[-2000:])
    assert len(checked) >= 8, checked
