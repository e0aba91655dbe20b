"""torchtitan's models and its own parallelize recipes (generators/titan.py, settings/titan.py, the [titan] extra):
the recipes train torchtitan's Llama 3 as one plain process does, under each SPMD backend; a recipe that trains
otherwise is reported; the kind and the family say what to install where torchtitan is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from difftest.contracts.registry import load_plugins, traits_of
from difftest.findings import known

ROOT = Path(__file__).resolve().parents[1]

needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="the [titan] extra (torchtitan) is not installed")

RECIPES = ("titan/spmd_types/dp2-tp2/ac-selective/ws4", "titan/partial_dtensor/dp1-tp2-no-sp/ac-full/ws2",
           "titan/full_dtensor/dp2-tp1/ac-none/ws2", "titan/partial_dtensor/dp2-tp2/ac-none/ws4",
           "titan/spmd_types/dp2-tp1/ac-none/bf16/ws2")
PLANTED = "faults/titan_rank1_skips_step/ws2"
# torchtitan's pipelining_fn: a V schedule (2 stages a rank) trained without its eval(), and a 1F1B recipe evaluated
# by its schedule whose last stage skips its step (the negative control)
TRAINED_ONLY = "titan/spmd_types/dp1-tp1-pp2/dualpipev/mb4/ac-none/train-only/ws2"
PLANTED_STAGE = "faults/titan_last_stage_skips_step/ws2"
# its default SPMD backend with sequence parallel hands the next stage a non-contiguous shard: a known torch bug
NON_CONTIGUOUS = "titan/spmd_types/dp1-tp2-pp2/1f1b/mb4/ac-none/ws4"


def _run(out: Path, kind: str, settings: tuple[str, ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary, comparisons) of a run of `settings` on one model of `kind`."""
    done = subprocess.run([sys.executable, "-m", "difftest.cli", "run", "--out", str(out), "--kind", kind,
                           "--models", "1", "--settings", ",".join(settings), "--plugin", "tests.faults.planted",
                           "--minimise-budget", "0"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return _read(out)


def _read(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary, comparisons) of a run."""
    return pd.read_csv(out / "summary.csv", index_col=0), pd.read_csv(out / "comparisons.csv")


def _trained_as_one_process(cases: pd.DataFrame, compared: pd.DataFrame, recipe: str,
                            phases: frozenset[str] = frozenset({"param_after_step1", "eval_after_step1",
                                                                "eval_before"})) -> None:
    """The recipe's case is ok, judged on the trained weights and the logits by the calibrated envelope."""
    assert cases.loc[recipe, "ok"] == 1, cases.to_string()
    mine = compared[compared["setting"] == recipe]
    assert phases <= set(mine["phase"]), recipe
    assert (mine["calibrated_ratio"] < 1).all() and mine["calibrated_ratio"].notna().all(), recipe
    trained = set(mine[mine["phase"] == "param_after_step1"].tensor)
    assert {"layers.1.attention.wo.weight", "tok_embeddings.weight"} <= trained, trained


@pytest.mark.heavy
@needs_titan
def test_torchtitans_recipes_train_its_llama_as_one_process_does_a_skipped_step_is_reported_and_a_script_agrees(
        tmp_path: Path) -> None:
    """One run of every recipe below on one Llama 3 (its generation, reference and calibration runs paid once, not
    once per check): the recipes and their faults, then a recipe's standalone script."""
    out = tmp_path / "run"
    _run(out, "titan-llama3", (*RECIPES, PLANTED, TRAINED_ONLY, PLANTED_STAGE, NON_CONTIGUOUS))
    _recipes_train_as_one_process_does_and_a_skipped_step_is_reported(out)
    _a_recipes_script_trains_as_the_recipe_does_without_difftest(out)


def _recipes_train_as_one_process_does_and_a_skipped_step_is_reported(out: Path) -> None:
    cases, compared = _read(out)
    for recipe in RECIPES:
        _trained_as_one_process(cases, compared, recipe)
    _trained_as_one_process(cases, compared, TRAINED_ONLY, frozenset({"param_after_step1", "train_step1"}))
    assert not compared[compared["setting"] == TRAINED_ONLY]["phase"].str.startswith("eval_").any()
    # every stage's parameters come back to rank 0: the last stage's skipped step shows in its weights alone
    pipelined = compared[compared["setting"] == PLANTED_STAGE]
    skipped = pipelined[pipelined["phase"] == "param_after_step1"]
    off = set(skipped[skipped["calibrated_ratio"] > 1].tensor)
    assert cases.loc[PLANTED_STAGE, "inconsistent"] == 1 and "lm_head.weight" in off, cases.to_string()
    assert not any(t.startswith(("tok_embeddings.", "layers.0.")) for t in off), off
    # evaluated through schedule.eval as torchtitan's validator runs it: before the step it agrees with one process
    before = pipelined[pipelined["phase"] == "eval_before"]
    assert len(before) and (before["calibrated_ratio"] < 1).all(), before.to_string()
    failed = pd.read_csv(out / "inconsistencies.csv").set_index("setting").loc[[NON_CONTIGUOUS]]
    load_plugins()
    explained = known.match(NON_CONTIGUOUS, "error", str(failed["message"].iloc[0]), traits_of("titan-llama3"))
    assert explained is not None and explained.id == "pipelining-noncontiguous-send", failed["message"].iloc[0]
    # its script runs torchtitan's recipe without difftest and fails there as it did here
    found = pd.read_csv(out / "findings.csv").set_index("example_setting")
    said = (out / "findings" / found.loc[NON_CONTIGUOUS, "id"] / "standalone.txt").read_text()
    assert said.startswith("standalone.py reproduces (exit 1)"), said[:3000]
    # torchtitan's default bf16 parameters really compute in bf16 (off by bf16's rounding, not fp32's) and are judged
    # by the bf16 envelope
    worst = compared.groupby("setting")["linf"].max()
    assert worst["titan/spmd_types/dp2-tp1/ac-none/bf16/ws2"] > 1e-3 > 1e-5 > worst["titan/full_dtensor/dp2-tp1/ac-none/ws2"]
    # the negative control: rank 1 of the FSDP2 recipe skips its step, so its shard of the weights stays
    assert cases.loc[PLANTED, "inconsistent"] == 1, cases.to_string()


def _a_recipes_script_trains_as_the_recipe_does_without_difftest(out: Path) -> None:
    """A recipe's standalone script builds the model from torchtitan's config classes and runs torchtitan's own
    recipe on it: where the sweep agreed, so does the script (exit 0); with its ranks' loss planted 1.5 times larger
    it says BUG PRESENT."""
    import generators  # noqa: F401 -- the titan kinds, registered
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.check import check_script
    from difftest.scripts.write import emit

    model, recipe = "titan-llama3-s0-i0", "titan/full_dtensor/dp2-tp1/ac-none/ws2"
    assert recipe in RECIPES  # judged ok, by the envelope, in the run's checks before this one
    emitted = emit(out, "T0", "a recipe's case", "inconsistent", out / "models" / model, recipe,
                   "param_after_step1/tok_embeddings.weight", envelope_spread(out, model, recipe), Tolerance(),
                   check_timeout_s=180)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    text = emitted.path.read_text()
    assert "class _Recipe" in text and "import difftest" not in text and "from settings" not in text
    assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
        emitted.checked.output[-3000:]
    backward = "                loss.backward()\n"
    assert text.count(backward) == 1
    emitted.path.write_text(text.replace(backward, backward.replace("loss.backward", "(1.5 * loss).backward")))
    planted = check_script(emitted.path, timeout_s=180)
    assert planted.exit_code == 1 and "BUG PRESENT" in planted.output, planted.output[-3000:]


@needs_titan
def test_a_tied_output_projection_trains_the_same_under_two_dimensional_parallelism(tmp_path: Path) -> None:
    """Qwen 3 ties its output projection to its embedding: under partial_dtensor its logits come back a DTensor on
    the tensor-parallel mesh alone, each data-parallel share's own rows."""
    recipe = "titan/partial_dtensor/dp2-tp2/ac-none/ws4"
    _trained_as_one_process(*_run(tmp_path / "run", "titan-qwen3", (recipe,)), recipe)


def test_the_titan_kind_and_recipes_say_which_extra_to_install_without_torchtitan(monkeypatch) -> None:
    import importlib.util as util

    from difftest.contracts.registry import get_generator, get_setting, load_plugins

    load_plugins()
    found = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "torchtitan" else found(name, *a))
    assert get_generator("titan-llama3").available() == "needs torchtitan (install torchtitan: pip install " \
                                                        "'difftest[titan]')"
    assert get_setting(RECIPES[0]).available() == "needs torchtitan (pip install 'difftest[titan]')"


def test_torchtitans_recipes_refuse_models_that_are_not_torchtitans() -> None:
    from difftest import ModelSpec
    from difftest.contracts.registry import get_setting, load_plugins

    load_plugins()
    said = get_setting(RECIPES[0]).supports(ModelSpec(kind="transformer", seed=0, index=0, params={}))
    assert said == "torchtitan's recipes parallelize torchtitan's models, not kind 'transformer'"
