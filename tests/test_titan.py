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

ROOT = Path(__file__).resolve().parents[1]

needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="the [titan] extra (torchtitan) is not installed")

RECIPES = ("titan/spmd_types/dp2-tp2/ac-selective/ws4", "titan/partial_dtensor/dp1-tp2-no-sp/ac-full/ws2",
           "titan/full_dtensor/dp2-tp1/ac-none/ws2", "titan/partial_dtensor/dp2-tp2/ac-none/ws4")
KINDS = ("titan-llama3", "titan-qwen3")  # Qwen 3's output projection is tied to its embedding
PLANTED = "faults/titan_rank1_skips_step/ws2"


@needs_titan
def test_torchtitans_recipes_train_its_llama_as_one_process_does_and_a_skipped_step_is_reported(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "difftest.cli", "run", "--out", str(out),
                           "--models-of", ",".join(f"{kind}=1" for kind in KINDS),
                           "--settings", ",".join((*RECIPES, PLANTED)), "--plugin", "tests.faults.planted",
                           "--minimise-budget", "0"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    for recipe in RECIPES:
        assert cases.loc[recipe, "ok"] == len(KINDS), cases.to_string()
    compared = pd.read_csv(out / "comparisons.csv")
    for recipe in RECIPES:  # judged on the trained weights and the logits, by the calibrated envelope
        mine = compared[compared["setting"] == recipe]
        assert {"param_after_step1", "eval_after_step1", "eval_before"} <= set(mine["phase"]), recipe
        assert (mine["calibrated_ratio"] < 1).all() and mine["calibrated_ratio"].notna().all(), recipe
        weights = mine[mine["phase"] == "param_after_step1"]
        assert {"layers.1.attention.wo.weight", "lm_head.weight"} <= set(weights["tensor"])
    # the negative control: rank 1 of the FSDP2 recipe skips its step, so its shard of the weights stays
    assert cases.loc[PLANTED, "inconsistent"] == len(KINDS), cases.to_string()


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
