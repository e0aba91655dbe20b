"""Standalone scripts: a finding as a script that needs only the libraries under test, and reaches the setting's
verdict on the same case (`difftest.scripts.emit`, `difftest.scripts.write`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from difftest.contracts.registry import all_settings
from difftest.contracts.script import STANDALONE_FILE
from difftest.contracts.tolerance import Tolerance
from difftest.judging.analysis import analyze, envelope_spread
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.scripts.check import sealed_environment
from difftest.scripts.emit import MAX_LINES
from difftest.scripts.reduce import FULL_FILE
from difftest.scripts.write import emit, script_lines

MODEL = "dlrm-s0-i0"
# two TorchRec bugs on this model (grid_shard + MEAN, the row-wise 1 - 2^-20 scaling only the calibrated oracle
# sees) and one sharding type that computes what the single process does
TORCHREC = ("torchrec/ebc/grid_shard/ws2", "torchrec/ebc/row_wise/ws2", "torchrec/ebc/table_wise/ws2")


def test_a_standalone_script_reaches_its_settings_verdict_where_difftest_does_not_import(
        fresh_run: Path, tmp_path: Path) -> None:
    run_sweep(fresh_run, SweepOptions(pairs=tuple((MODEL, s) for s in TORCHREC), timeout_s=120))
    cases = analyze(fresh_run).cases.set_index(["model", "setting"])
    verdicts = {s: cases.loc[(MODEL, s), "verdict"] for s in TORCHREC}
    # the case must hold both outcomes, or agreement below proves nothing
    assert verdicts == {TORCHREC[0]: "inconsistent", TORCHREC[1]: "inconsistent", TORCHREC[2]: "ok"}, verdicts
    sealed = sealed_environment(tmp_path / "sealed")
    refused = subprocess.run([sys.executable, "-c", "import difftest"], env=sealed, capture_output=True, text=True)
    assert refused.returncode != 0 and "must not need it" in refused.stderr
    for number, setting in enumerate(TORCHREC):
        emitted = emit(fresh_run, f"T{number}", "a TorchRec finding", verdicts[setting], fresh_run / "models" / MODEL,
                       setting, "eval_before/pooled", envelope_spread(fresh_run, MODEL, setting), Tolerance(),
                       check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "from settings" not in text and "from generators" not in text
        assert text.count("\n") <= MAX_LINES
        assert emitted.checked.exit_code == (0 if verdicts[setting] == "ok" else 1), emitted.checked.output[-3000:]
        assert "BUG PRESENT" in emitted.checked.output or verdicts[setting] == "ok"
        # after the releases, the case in one line: what a maintainer reads before the verdicts
        said = emitted.checked.output.splitlines()
        case_line = next(i for i, line in enumerate(said) if line.startswith("python "))
        assert said[case_line + 1].startswith(f"case: {setting} on {MODEL} (tables "), said[case_line + 1]
        assert said[case_line + 1].endswith(", batch 24, 2 processes"), said[case_line + 1]
        # what triage measures to choose a finding's example is the length of the script written, before reduction
        whole = emitted.path.with_name(FULL_FILE) if emitted.path.with_name(FULL_FILE).is_file() else emitted.path
        assert script_lines(fresh_run, "a TorchRec finding", MODEL, setting, verdicts[setting], "eval_before/pooled",
                            "") == whole.read_text().count("\n")
    # exit 1 is the bug and nothing else: a script whose libraries do not import (here torch) failed on its own
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch does not import')\n")
    unrunnable = subprocess.run([sys.executable, str(fresh_run / "findings" / "T0" / STANDALONE_FILE)], text=True,
                                env={**sealed, "PYTHONPATH": f"{broken.parent}:{sealed['PYTHONPATH']}"},
                                capture_output=True, timeout=120)
    assert unrunnable.returncode == 2 and "this torch does not import" in unrunnable.stderr, unrunnable


def test_a_finding_whose_family_has_no_emitter_gets_no_script_and_a_reason(fresh_run: Path) -> None:
    pipelined = next(s for s in all_settings() if s.family == "async-pipeline" and s.world_size == 2)
    emitted = emit(fresh_run, "T9", "an async-pipeline finding", "inconsistent", fresh_run / "models" / MODEL,
                   pipelined.name, "eval_before/prediction", {}, Tolerance())
    folder = fresh_run / "findings" / "T9"
    assert emitted.path is None and not (folder / STANDALONE_FILE).exists()
    assert emitted.describe() == "no standalone script: the `async-pipeline` family has no emitter"
    assert (folder / "standalone.txt").read_text().startswith(emitted.describe())
    # its nondeterminism (a rerun of it) has none either, for the same reason: not for want of a `rerun` emitter
    emitted = emit(fresh_run, "T9", "an async-pipeline nondeterminism", "nondeterministic",
                   fresh_run / "models" / MODEL, f"rerun/{pipelined.name}", "eval_before/prediction", {}, Tolerance())
    assert emitted.describe() == "no standalone script: the `async-pipeline` family has no emitter"
    # a planted fault overrides a hook of its family's setting: a script copied from the family's module would not
    # hold the fault, so it gets none (rather than a script that says the bug is gone)
    emitted = emit(fresh_run, "T9", "a planted fault", "inconsistent", fresh_run / "models" / MODEL,
                   "faults/fsdp1_skip_predivide/full_shard/ws2", "param_after_step1/over.0.weight", {}, Tolerance())
    assert emitted.path is None and "overrides wrapped of LegacyFsdp" in emitted.why_not, emitted.why_not
    # a TorchRec case whose first divergence is past the embedding lookup is not one the script can show
    emitted = emit(fresh_run, "T9", "a TorchRec finding", "inconsistent", fresh_run / "models" / MODEL,
                   TORCHREC[0], "param_after_step1/over.0.weight", {}, Tolerance())
    assert emitted.path is None and "not at a pooled embedding" in emitted.why_not


# the quantized family on the same model: TorchRec's quantized row-wise MEAN pooling (a disagreement), table-wise
# (agrees), fp16 column-wise sharding and bf16 quantization (failures: an exception, a rank killed by SIGFPE)
QUANT = ("quant/torchrec/int8/out-fp32/row_wise/sim-ws2", "quant/torchrec/int8/out-fp32/table_wise/sim-ws2",
         "quant/torchrec/fp16/out-fp16/column_wise/sim-ws2", "quant/torchrec/bf16/out-fp32/unsharded")


def test_a_quantized_finding_and_a_failure_reach_their_settings_verdict_without_difftest(
        fresh_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_sweep(fresh_run, SweepOptions(pairs=tuple((MODEL, s) for s in QUANT), timeout_s=120))
    analysis = analyze(fresh_run)
    cases = analysis.cases.set_index(["model", "setting"])
    verdicts = {s: str(cases.loc[(MODEL, s), "verdict"]) for s in QUANT}
    recorded = analysis.comparisons.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])["message"]
    messages = {s: str(recorded.get((MODEL, s), "")) for s in QUANT}
    assert "ok" in verdicts.values() and {"inconsistent", "error", "crash"} & set(verdicts.values()), verdicts
    for number, setting in enumerate(QUANT):
        emitted = emit(fresh_run, f"Q{number}", "a quantized TorchRec finding", verdicts[setting],
                       fresh_run / "models" / MODEL, setting, "eval_before/pooled.tf0", {}, Tolerance(),
                       check_timeout_s=120, message=messages[setting])
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "from settings" not in text and text.count("\n") <= MAX_LINES
        assert emitted.checked.reproduces == (verdicts[setting] != "ok"), (setting, emitted.checked.output[-3000:])
        assert emitted.checked.exit_code == (0 if verdicts[setting] == "ok" else 1), emitted.checked.output[-3000:]
    # what its ranks leave in the temporary folder goes with the script: torch.multiprocessing leaves a failed rank's
    # traceback file there (the fp16 shards' error)
    import os

    from difftest.scripts.check import check_script
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    failed = check_script(fresh_run / "findings" / "Q2" / "standalone.py", timeout_s=120,
                          env={**os.environ, "TMPDIR": str(temporary)})
    assert failed.exit_code == 1 and list(temporary.iterdir()) == [], (failed.output[-3000:], list(temporary.iterdir()))
    # a failure script recognises its failure, and nothing else, by the exception or the signal
    from difftest.contracts.script import failure_pattern
    assert failure_pattern("crash", "rank 0 killed by SIGFPE (exit -8); log: ...") == r"signal SIGFPE\b"
    assert failure_pattern("error", "RuntimeError: The size of tensor a (80) must match") == r"RuntimeError:\ The\ size\ of\ tensor\ a"
    assert failure_pattern("error", "AssertionError: can't steal_bwd_input if 'x' ...") == \
        r"AssertionError:\ can't\ steal_bwd_input\ if"
    assert failure_pattern("inconsistent", "plan: ...") == ""
    # a case run in processes of its own fails as its process did, not as difftest's wrapper says
    assert failure_pattern("error", "ProcessesFailed: phase train rank 0 exited 1: Unsupported: Call to `torch._dynamo"
                                    ".disable()` | File …") == r"Unsupported:\ Call\ to\ `torch\._dynamo\.disable"
    # an exception raised bare: its traceback's last line is the type alone, not the line that raised it
    bare = failure_pattern("error", "AssertionError:  || File \"…/_tp_conv.py\", line 288 | raise AssertionError")
    shown = "Traceback (most recent call last):\n  File \"_tp_conv.py\", line 288\n    raise AssertionError\nAssertionError\n"
    found = re.search(bare, shown)
    assert found and shown[found.start():].split("\n")[0] == "AssertionError"
    assert not re.search(bare, "AssertionErrors happen\n    raise AssertionError\n")
    # a rerun that writes the same script, on the same data and libraries, takes the kept check and reduction instead
    # of running the script again; any other key runs it
    import json

    import difftest.scripts.reduce

    number, setting = next((n, s) for n, s in enumerate(QUANT) if verdicts[s] != "ok")
    folder = fresh_run / "findings" / f"Q{number}"
    before = {name: (folder / name).read_text() for name in (STANDALONE_FILE, "standalone.txt")}

    def again() -> Any:
        return emit(fresh_run, f"Q{number}", "a quantized TorchRec finding", verdicts[setting],
                    fresh_run / "models" / MODEL, setting, "eval_before/pooled.tf0", {}, Tolerance(),
                    check_timeout_s=120, message=messages[setting])

    def not_again(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ran the script again")

    monkeypatch.setattr(difftest.scripts.reduce, "traced_check", not_again)
    reused = again()
    assert reused.checked is not None and reused.checked.reproduces and not reused.defect
    assert {name: (folder / name).read_text() for name in before} == before
    kept = json.loads((folder / ".check.json").read_text())
    (folder / ".check.json").write_text(json.dumps({**kept, "key": "another release"}))
    assert "ran the script again" in again().why_not


# the training settings' scripts: the model's own code (`Generator.standalone_model`) and the setting's wrapper; the
# default tier's first setting of each family (plain DDP, legacy FSDP, FSDP2 per layer, accumulation under legacy
# FSDP) has its script checked on a DLRM in tests/e2e/test_scripts_everywhere.py, these are the others
FSDP2_TP = "fsdp2-tp/dp2-tp2/colwise-rowwise/ws4"
TRAINING = ("tp/colwise-rowwise/ws2", FSDP2_TP, "ddp/no-sync/ws2", "fsdp2/whole-model/reshard-to-2/fp32/ws4",
            "fsdp2/per-layer/reshard/fp32/offload/ws2", "accum/fsdp2-unsharded/micro3/ws2")


@pytest.mark.heavy
def test_a_training_settings_script_trains_as_the_setting_does(fresh_run: Path) -> None:
    """FSDP2 (resharded to 2 ranks, offloaded), DDP with no_sync() on a first micro-batch, tensor parallel and FSDP2
    over tensor parallel train this DLRM-like model as one process does on this stack (on torch 2.7 and 2.8 FSDP2 did
    not: gloo's AVG reduce-scatter summed, `gloo-reduce-scatter-avg-sums`); each script, judged by the envelope, says
    so too. The other verdict: the Keras test in test_sequential.py (legacy FSDP's NO_SHARD bug), the oldest release's (tensor parallel
    training a frozen parameter) and the planted ones below."""
    run_sweep(fresh_run, SweepOptions(pairs=tuple((MODEL, s) for s in TRAINING), timeout_s=120))
    verdicts = analyze(fresh_run).cases.set_index(["model", "setting"])["verdict"]
    for number, setting in enumerate(TRAINING):
        spread = envelope_spread(fresh_run, MODEL, setting)
        assert any(name.startswith("param_after_step1/") for name in spread), "judged by the calibrated envelope"
        emitted = emit(fresh_run, f"D{number}", "a training finding", "inconsistent", fresh_run / "models" / MODEL,
                       setting, "param_after_step1/over.0.weight", spread, Tolerance(), check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "from generators" not in text and text.count("\n") <= MAX_LINES
        assert "what rounding explains" in emitted.checked.output  # the envelope judged, not allclose
        assert emitted.checked.exit_code == (0 if verdicts[(MODEL, setting)] == "ok" else 1), \
            emitted.checked.output[-3000:]
        if setting == "ddp/no-sync/ws2":  # its agreement is the second micro-batch's all-reduce: skipped, ranks drift
            from difftest.scripts.check import check_script

            synchronising = "    (model_loss(module, data, middle, stop, dtype)"
            assert text.count(synchronising) == 1
            emitted.path.write_text(text.replace(synchronising, "    with module.no_sync():\n    " + synchronising))
            unsynchronised = check_script(emitted.path, timeout_s=120)
            assert unsynchronised.exit_code == 1 and "BUG PRESENT" in unsynchronised.output, unsynchronised.output
        if setting.startswith("accum/fsdp2"):  # its agreement is the last micro-batch's reduction: skipped
            from difftest.scripts.check import check_script

            last = "last=j == micro_steps - 1"
            assert text.count(last) == 1
            emitted.path.write_text(text.replace(last, "last=False"))
            unsynchronised = check_script(emitted.path, timeout_s=120)
            assert unsynchronised.exit_code == 1 and "BUG PRESENT" in unsynchronised.output, unsynchronised.output
    # a failure's script takes the run's steps through the setting and shows it failing as recorded, or, as here
    # where the setting does not fail so, running through: exit 0, and no judging in it
    emitted = emit(fresh_run, "D9", "a training failure", "error", fresh_run / "models" / MODEL, FSDP2_TP, "", {},
                   Tolerance(), check_timeout_s=120, message="NotImplementedError: Operator fsdp.chunk_cat.default")
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert "def judge(" not in emitted.path.read_text() and "FAILURE = 'NotImplementedError:" in emitted.path.read_text()
    assert emitted.checked.exit_code == 0 and "the setting runs through" in emitted.checked.output, \
        emitted.checked.output[-3000:]


# pipelines on the same model: a random split and two stages per rank train as the single process does, and so do
# two pipelines side by side with DDP or FSDP2 over each stage's replicas (hybrid); the zero-bubble V schedule fails
# in its eval (`pipelining-zbv-eval` on this stack)
PIPELINE = ("pipeline/gpipe/ws2/stages2/mb2/random", "pipeline/looped-bfs/ws2/stages4/mb2/balanced",
            "hybrid/1f1b/dp2xfsdp2/pp2/stages2/mb2/balanced", "hybrid/interleaved-1f1b/dp2xddp/pp2/stages4/mb2/balanced",
            "pipeline/zbv-zero-bubble/ws2/stages4/mb2/balanced")


@pytest.mark.heavy
def test_a_pipeline_script_trains_or_fails_as_the_setting_does(fresh_run: Path) -> None:
    run_sweep(fresh_run, SweepOptions(pairs=tuple((MODEL, s) for s in PIPELINE), timeout_s=120))
    analysis = analyze(fresh_run)
    verdicts = analysis.cases.set_index(["model", "setting"])["verdict"]
    recorded = analysis.comparisons.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])["message"]
    # the case must hold both outcomes, or agreement below proves nothing
    assert {str(verdicts[(MODEL, s)]) for s in PIPELINE} >= {"ok", "error"}, verdicts
    for number, setting in enumerate(PIPELINE):
        verdict, spread = str(verdicts[(MODEL, setting)]), envelope_spread(fresh_run, MODEL, setting)
        emitted = emit(fresh_run, f"P{number}", "a pipeline finding", "inconsistent" if verdict == "ok" else verdict,
                       fresh_run / "models" / MODEL, setting, "" if verdict == "error" else
                       "param_after_step1/over.0.weight", spread, Tolerance(), check_timeout_s=120,
                       message=str(recorded.get((MODEL, setting), "")))
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "from generators" not in text and text.count("\n") <= MAX_LINES
        # a failure's script holds no judging, a disagreement's no failure pattern: each what it runs
        assert ("def judge(" in text) == (verdict == "ok") and ("FAILURE =" in text) == (verdict == "error")
        assert emitted.checked.exit_code == (0 if verdict == "ok" else 1), emitted.checked.output[-3000:]
        assert verdict == "error" or "what rounding explains" in emitted.checked.output  # the envelope judged
        if "dp2xddp" in setting:  # its agreement is the replicas' synchronisation: unwrapped, they drift apart
            from difftest.scripts.check import check_script

            wrap = 'wrapped = {s: wrap_stage(m, layout["inner"], groups, "cpu") for s, m in modules.items()}'
            assert text.count(wrap) == 1
            emitted.path.write_text(text.replace(wrap, "wrapped = modules"))
            unsynchronised = check_script(emitted.path, timeout_s=120)
            assert unsynchronised.exit_code == 1 and "BUG PRESENT" in unsynchronised.output, unsynchronised.output


REPARTITION = ("repartition/gpipe/ws2/mb2/moved", "repartition/1f1b/ws2/mb4/uninterrupted")


def test_a_repartition_script_hands_the_state_over_as_the_setting_does(fresh_run: Path) -> None:
    """Re-splitting a GPipe pipeline after two steps, and 1F1B never re-split, train this DLRM-like model with momentum
    as one process does on this stack; their scripts say so too, and say BUG PRESENT once the move leaves the momentum
    buffers behind. A failure of difftest's own check of the move gets no script."""
    from difftest.scripts.check import check_script

    run_sweep(fresh_run, SweepOptions(pairs=tuple((MODEL, s) for s in REPARTITION), timeout_s=120))
    verdicts = analyze(fresh_run).cases.set_index(["model", "setting"])["verdict"]
    assert {str(verdicts[(MODEL, s)]) for s in REPARTITION} == {"ok"}, verdicts
    for number, setting in enumerate(REPARTITION):
        emitted = emit(fresh_run, f"M{number}", "a repartition finding", "inconsistent", fresh_run / "models" / MODEL,
                       setting, "param_after_step4/over.0.weight", envelope_spread(fresh_run, MODEL, setting),
                       Tolerance(), check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "from settings" not in text and text.count("\n") <= MAX_LINES
        assert ("def gather_state(" in text) == setting.endswith("/moved") and "momentum 0.9" in text
        assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
            emitted.checked.output[-3000:]
    handed = '                    optimizer.state[p]["momentum_buffer"] = handed[n][1].clone()\n'
    moved = fresh_run / "findings" / "M0" / STANDALONE_FILE
    assert text.count(handed) == 0 and moved.read_text().count(handed) == 1
    moved.write_text(moved.read_text().replace(handed, "                    pass\n"))
    forgetful = check_script(moved, timeout_s=120)
    assert forgetful.exit_code == 1 and "BUG PRESENT" in forgetful.output, forgetful.output[-3000:]
    emitted = emit(fresh_run, "M9", "a failed move", "error", fresh_run / "models" / MODEL, REPARTITION[0], "", {},
                   Tolerance(), message="InvariantViolated: moving [0, 1] -> [0, 2]: lost ['param/1.over.0.weight']")
    assert emitted.path is None and "own check of the move" in emitted.why_not, emitted.why_not


RESUME = ("resume/ddp-ws2/fsdp2-ws2/k3", "resume/single/single/k3/fast-forward", "resume/fsdp2-ws2/uninterrupted")


def test_a_resume_script_resumes_in_new_processes_as_the_setting_does(fresh_run: Path) -> None:
    """DDP's checkpoint resumed under FSDP2, a single process's fast-forwarded, and FSDP2 never interrupted train this
    DLRM-like model as one process does on this stack; their scripts, each phase in new processes, say so too (the
    single-process resume bit for bit, as difftest judges it), and say BUG PRESENT once the checkpoint leaves the
    optimizer's momentum behind. A planted fault that changes what the checkpoint carries gets no script."""
    from difftest.contracts.registry import get_setting
    from difftest.scripts.check import check_script

    run_sweep(fresh_run, SweepOptions(pairs=tuple((MODEL, s) for s in ("resume/single/uninterrupted", *RESUME)),
                                      timeout_s=180))
    verdicts = analyze(fresh_run).cases.set_index(["model", "setting"])["verdict"]
    assert {str(verdicts[(MODEL, s)]) for s in RESUME} == {"ok"}, verdicts
    for number, setting in enumerate(RESUME):
        emitted = emit(fresh_run, f"C{number}", "a resume finding", "inconsistent", fresh_run / "models" / MODEL,
                       setting, "param_after_step5/over.0.weight", envelope_spread(fresh_run, MODEL, setting),
                       get_setting(setting).tolerance(Tolerance()), check_timeout_s=180)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "from settings" not in text and text.count("\n") <= MAX_LINES
        assert ("def distribute(" in text) == ("fsdp2" in setting)
        assert ("'save': True" in text) == ("uninterrupted" not in setting)  # a checkpoint between two phases
        assert emitted.checked.exit_code == 0, emitted.checked.output[-3000:]
        assert ("allclose(atol=0.0, rtol=0.0)" in emitted.checked.output) == ("single" in setting)
    resumed = fresh_run / "findings" / "C0" / STANDALONE_FILE
    carried = "'carried': ['loader', 'model', 'optimizer', 'rng', 'scheduler']"
    assert resumed.read_text().count(carried) == 1
    resumed.write_text(resumed.read_text().replace(carried, "'carried': ['loader', 'model', 'rng', 'scheduler']"))
    forgetful = check_script(resumed, timeout_s=180)
    assert forgetful.exit_code == 1 and "BUG PRESENT" in forgetful.output, forgetful.output[-3000:]
    emitted = emit(fresh_run, "C9", "a planted fault", "inconsistent", fresh_run / "models" / MODEL,
                   "faults/resume_forgets_optimizer", "param_after_step5/over.0.weight", {}, Tolerance())
    assert emitted.path is None and "overrides carried of Resume" in emitted.why_not, emitted.why_not


def test_a_findings_report_quotes_the_lines_its_script_printed_itself_not_its_libraries() -> None:
    from difftest.scripts.check import own_lines

    printed = """python 3.11.7, torch 2.14.1, torchrec 1.9.2, numpy 2.4.6
WARNING:torchrec.distributed.utils:Compute Kernel is dense, caching params will be ignored
[rank0]:W1125 21:58:07.773000 4651 torch/fx/_symbolic_trace.py:57] is_fx_tracing will return true
Traceback (most recent call last):
  File "standalone.py", line 3, in run_distributed
torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGFPE
ProcessExitedException: process 0 terminated with signal SIGFPE
BUG PRESENT: the setting fails as it did when difftest found it"""
    printed = printed.replace("numpy 2.4.6\n", "numpy 2.4.6\ncase: torchrec/ebc/row_wise/ws2 on dlrm-s0-i0 (tables 2), "
                                              "batch 24, 2 processes\n", 1)
    assert own_lines(printed) == ["python 3.11.7, torch 2.14.1, torchrec 1.9.2, numpy 2.4.6",
                                  "case: torchrec/ebc/row_wise/ws2 on dlrm-s0-i0 (tables 2), batch 24, 2 processes",
                                  "ProcessExitedException: process 0 terminated with signal SIGFPE",
                                  "BUG PRESENT: the setting fails as it did when difftest found it"]
    judged = ("pooled.tf3: 3 of 96 elements off, 2.1x what rounding explains; at (1, 2) single process 0.5, setting 0.6\n"
              "  return func(*args, **kwargs)\nlayers.0.w: the setting gives shape (2,), not (4,)\n"
              "ok: the setting agrees with the single-process program (the bug is gone)")
    assert own_lines(judged) == [line for line in judged.splitlines() if not line.startswith(" ")]


def test_a_script_that_outlives_its_timeout_is_killed_with_the_ranks_it_started(tmp_path: Path) -> None:
    import os
    import time

    from difftest.scripts.check import check_script

    (tmp_path / "finding").mkdir()
    script = tmp_path / "finding" / "standalone.py"
    pid_file = tmp_path / "rank.pid"
    script.write_text(f"""import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
open({str(pid_file)!r}, "w").write(str(rank.pid))
print("started", flush=True)
time.sleep(600)
""")
    started = time.perf_counter()
    checked = check_script(script, timeout_s=3.0, niceness=5)
    assert time.perf_counter() - started < 30
    assert checked.exit_code == 124 and "timed out after 3 s" in checked.output and "started" in checked.output
    rank = int(pid_file.read_text())
    for _ in range(50):  # killed at once; reaped by init a moment later
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(rank)], capture_output=True, text=True).stdout.strip()
        if not state or state.startswith("Z"):
            break
        time.sleep(0.1)
    else:
        os.kill(rank, 9)
        raise AssertionError(f"the script's rank {rank} outlived the script's timeout")


PARTIAL = "partial-reduce/ws3/group2/sync2"  # partners in seeded groups of 2, everyone every 2nd of 4 steps


def test_a_partial_reduce_script_averages_as_the_setting_does(fresh_run: Path, tmp_path: Path) -> None:
    """Three replicas averaging with partners and all together agree with the simulator on this stack; the script
    says so too, and says BUG PRESENT once its global sync no longer all-reduces."""
    from difftest.scripts.check import check_script

    run_sweep(fresh_run, SweepOptions(pairs=((MODEL, PARTIAL),), timeout_s=120))
    assert analyze(fresh_run).cases.set_index(["model", "setting"]).loc[(MODEL, PARTIAL), "verdict"] == "ok"
    emitted = emit(fresh_run, "R0", "a partial-reduce finding", "inconsistent", fresh_run / "models" / MODEL, PARTIAL,
                   "replica1_after_step4/over.0.weight", envelope_spread(fresh_run, MODEL, PARTIAL), Tolerance(),
                   check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    text = emitted.path.read_text()
    assert "import difftest" not in text and "from settings" not in text and text.count("\n") <= MAX_LINES
    assert "'replica2_after_step4/over.0.weight'" in text  # every replica's parameters are compared, not only their mean
    assert emitted.checked.exit_code == 0, emitted.checked.output[-3000:]
    # the script's reference is the schedule the simulator difftest ran: its float32 tensors are the recorded ones
    # (both sides of the script share the schedule's code, so a drift from the setting would not change its verdict)
    single = tmp_path / "single.npz"
    subprocess.run([sys.executable, "-c", f"import runpy, numpy, torch; ns = runpy.run_path({str(emitted.path)!r}); "
                    f"numpy.savez({str(single)!r}, **ns['single_process'](ns['load_data'](), ns['CASE'], "
                    "torch.float32))"], check=True, capture_output=True, timeout=120)
    from safetensors.numpy import load_file

    simulated = load_file(fresh_run / "outputs" / MODEL / "partial-reduce__simulator__ws3__group2__sync2.safetensors")
    scripted = dict(np.load(single))
    assert len(scripted) > 13 and scripted.keys() <= simulated.keys(), sorted(scripted)[:5]
    for name, value in scripted.items():
        np.testing.assert_allclose(value, simulated[name], rtol=1e-6, atol=1e-7, err_msg=name)
    reduce = "    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)\n"
    assert text.count(reduce) == 1
    emitted.path.write_text(text.replace(reduce, "    flat = flat * replicas  # each replica alone\n"))
    unsynchronised = check_script(emitted.path, timeout_s=120)
    assert unsynchronised.exit_code == 1 and "BUG PRESENT" in unsynchronised.output, unsynchronised.output[-3000:]


def test_a_rerun_script_runs_its_base_twice_and_says_when_the_runs_differ(fresh_run: Path) -> None:
    """A nondeterminism finding (`rerun/…`) gets its base's script, run twice and judged run against run with no
    tolerance, as difftest judges a rerun: DDP's two runs agree on this stack (exit 0, as the sweep's verdict says);
    once each run draws its step size at random, the script says BUG PRESENT."""
    from difftest.scripts.check import check_script

    rerun = "rerun/ddp/bucket-tiny/ws2"
    run_sweep(fresh_run, SweepOptions(pairs=((MODEL, "ddp/bucket-tiny/ws2"), (MODEL, rerun)), timeout_s=120))
    assert analyze(fresh_run).cases.set_index(["model", "setting"]).loc[(MODEL, rerun), "verdict"] == "ok"
    emitted = emit(fresh_run, "N0", "a nondeterminism", "nondeterministic", fresh_run / "models" / MODEL, rerun,
                   "param_after_step1/over.0.weight", {}, Tolerance(), check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    text = emitted.path.read_text()
    assert "import difftest" not in text and "def single_process" not in text and "def judge" not in text
    assert "twice with torch.use_deterministic_algorithms(True)" in text and text.count("\n") <= MAX_LINES
    assert emitted.checked.exit_code == 0 and "two runs of the setting agree exactly" in emitted.checked.output, \
        emitted.checked.output[-3000:]
    step = 'lr=optimizer["lr"],'
    assert text.count(step) == 1
    emitted.path.write_text(text.replace(step, 'lr=optimizer["lr"] * (1 + int.from_bytes(os.urandom(2), "little") / 2**16),'))
    drawn = check_script(emitted.path, timeout_s=120)
    assert drawn.exit_code == 1 and "BUG PRESENT: two runs of the setting differ" in drawn.output, drawn.output[-3000:]
    assert "elements differ; at" in drawn.output


def test_a_script_holds_collections_nested_inside_the_model_where_the_model_has_them(tmp_path: Path) -> None:
    """TorchRec's own DLRM keeps its tables at `sparse_arch.embedding_bag_collection`: the script builds them under that
    path (plan and weights keyed as the model's), and shows the row-wise scaling the setting shows."""
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate

    run, model, setting = tmp_path / "run", "torchrec-dlrm-s5-i0", "torchrec/ebc/row_wise/ws2"
    generate(run, RunConfig(seed=5, models=1, kinds=("torchrec-dlrm",)))
    run_sweep(run, SweepOptions(pairs=((model, setting),), timeout_s=120))
    cases = analyze(run).cases.set_index(["model", "setting"])
    assert cases.loc[(model, setting), "verdict"] == "inconsistent"
    emitted = emit(run, "T0", "a TorchRec finding", "inconsistent", run / "models" / model, setting,
                   "eval_before/pooled.f0", envelope_spread(run, model, setting), Tolerance(), check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert "'collection': 'sparse_arch.embedding_bag_collection'" in emitted.path.read_text()
    assert emitted.checked.exit_code == 1 and "BUG PRESENT" in emitted.checked.output, emitted.checked.output[-3000:]
