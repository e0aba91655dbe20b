"""A new model kind and a new setting family are one plugin file each (tests/plugins/tiny.py): generation, the sweep,
judging, triage, minimisation and progress take them through what they declare, and name neither."""

from __future__ import annotations

from pathlib import Path

from difftest.contracts.spec import RunConfig
from difftest.findings.minimise import minimise
from difftest.findings.triage import triage
from difftest.generation.generate import generate
from difftest.judging.analysis import analyze
from difftest.reporting.progress import family_of
from difftest.runner.sweep import SweepOptions, run_sweep

TINY = "tests.plugins.tiny"
ENGINE = Path(__file__).resolve().parents[1] / "difftest"


def test_a_plugin_kind_and_family_run_through_every_stage_by_what_they_declare(tmp_path: Path) -> None:
    run = tmp_path / "run"
    generate(run, RunConfig(seed=0, models=2, kinds=("tiny-mlp",), plugins=(TINY,)))
    run_sweep(run, SweepOptions(settings="reference,sum-dp/*", plugins=(TINY,), timeout_s=60))
    analysis = analyze(run, plugins=(TINY,))
    verdicts = dict(zip(zip(analysis.cases["model"], analysis.cases["setting"]), analysis.cases["verdict"]))
    models = sorted({m for m, _ in verdicts})
    assert len(models) == 2
    for model in models:  # the correct variant agrees (negative control); the planted one disagrees at every size
        assert verdicts[(model, "sum-dp/mean/ws2")] == verdicts[(model, "sum-dp/mean/ws3")] == "ok"
        assert verdicts[(model, "sum-dp/grad-sum/ws2")] == verdicts[(model, "sum-dp/grad-sum/ws3")] == "inconsistent"

    findings = triage(run, analysis)
    assert len(findings) == 1  # one bug at two world sizes on two models: one finding
    finding = findings[0]
    assert len(finding.rows) == 4
    # signed by what the family's parameters separate (not its declared sizes) and the kind's tensor class, first
    # diverging where the kind's order puts the earliest updated parameter
    assert "sum-dp [reduce='grad-sum']" in finding.signature and "ws" not in finding.signature, finding.signature
    assert finding.signature.endswith("first diverges in param_after_step/layer"), finding.signature
    assert finding.first_divergence.startswith("param_after_step1/layer0.")
    assert family_of("sum-dp/grad-sum/ws3") == "sum-dp"

    # minimisation shrinks by the kind's reductions and the family's declared sizes
    done = minimise(run, findings, analysis, budget_s=60, plugins=(TINY,))[0]
    before, after = done.size(done.original), done.size()
    assert after["layers"] < before["layers"] and after["world_size"] == 2, done.to_json()

    # and the engine's sources name neither the kind nor the family
    engine_text = "\n".join(p.read_text() for p in ENGINE.rglob("*.py"))
    assert "tiny-mlp" not in engine_text and "sum-dp" not in engine_text


def test_a_plugin_module_is_found_where_the_run_was_made_and_recorded_there(tmp_path: Path, monkeypatch) -> None:
    """A command run from another folder imports the run's plugin from the folders run.json names: the first that
    holds it as a module or package (a folder with a same-named data folder but no package is passed over), and
    run.json keeps where each plugin came from, beside the commands' folders of a run recorded before that."""
    import json
    import os
    import sys

    from difftest.contracts import registry
    from difftest.contracts.registry import load_plugins, user_plugin_folders
    from difftest.contracts.spec import config_with_commands, run_plugin_folders

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    # the plugin's folder leaves sys.path after the test: later tests in this process must not hand it to the
    # processes they start (a builder would fail to import it)
    monkeypatch.setattr(registry, "_LOADED_PLUGINS", set(registry._LOADED_PLUGINS))
    decoy, project = tmp_path / "decoy", tmp_path / "project"
    (decoy / "difftest_test_pkg").mkdir(parents=True)  # a data folder of that name: not a package to import
    (decoy / "difftest_test_pkg" / "notes.txt").write_text("not code")
    (project / "difftest_test_pkg").mkdir(parents=True)
    (project / "difftest_test_pkg" / "__init__.py").write_text("")
    (project / "difftest_test_pkg" / "models.py").write_text("LOADED = True\n")
    load_plugins(("difftest_test_pkg.models",), folders=(str(decoy), str(project)))
    assert sys.modules["difftest_test_pkg.models"].LOADED and str(project) in sys.path and str(decoy) not in sys.path
    assert str(project) in os.environ["PYTHONPATH"].split(os.pathsep)  # for the processes a run starts afresh
    assert str(project) in user_plugin_folders()
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps({"plugin_folders": [str(project)], "commands": [
        {"argv": ["difftest", "run"], "cwd": str(decoy)}, {"argv": ["difftest", "analyze"], "cwd": "/elsewhere"}]}))
    assert run_plugin_folders(run_json) == (str(project), "/elsewhere", str(decoy))
    copied = json.loads(config_with_commands(RunConfig(seed=3), run_json))
    assert copied["plugin_folders"] == [str(project)] and len(copied["commands"]) == 2 and copied["seed"] == 3
    run_json.write_text("{}")  # a run recorded before either: nothing to look in
    assert run_plugin_folders(run_json) == ()
