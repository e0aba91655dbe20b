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
