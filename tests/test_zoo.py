"""Model zoos as kinds (generators/zoo.py, the [zoo] extra): Hugging Face models under their library's own
tensor-parallel plan, FSDP2 per decoder layer and activation checkpointing; what a zoo model cannot take, refused with
the reason; its findings the library's, not the user's, but for what its layers compute otherwise by design (a
ResNet's BatchNorm on a split batch)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_zoo = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                               reason="the [zoo] extra (transformers, timm) is not installed")

SETTINGS = ("ddp/default/ws2,tp/colwise-rowwise/ws2,fsdp2-tp/dp2-tp2/colwise-rowwise/ws4,"
            "ac/fsdp2/reentrant/ws2,pipeline/gpipe/ws2/stages2/mb2/balanced")


def _run(out: Path, kind: str, settings: str = SETTINGS, *plugins: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftest.cli", "run", "--out", str(out), "--kind", kind,
                           "--models", "1", "--settings", settings, "--minimise-budget", "0",
                           *(f"--plugin={plugin}" for plugin in plugins)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


HF_SETTINGS = ("hf/fsdp2-ep2/all_to_all/ws2,hf/tp2-ep2/all_reduce/ws2,hf/fsdp2/cpu-offload/ws2,"
               "faults/hf_data_parallel_without_sync/ws2")


@needs_zoo
@pytest.mark.heavy
def test_a_mixture_of_experts_trains_the_same_under_its_librarys_plans_and_its_own_distributed_config(
        tmp_path: Path) -> None:
    """One run of one Mixtral under the zoo's settings, transformers' `DistributedConfig` settings and a planted
    fault (its generation, reference and calibration runs paid once, not once per check)."""
    out = tmp_path / "run"
    done = _run(out, "hf-mixtral", f"{SETTINGS},{HF_SETTINGS}", "tests.faults.planted")
    assert done.returncode == 0, done.stderr[-3000:]
    _a_mixture_of_experts_trains_the_same_under_its_librarys_tp_plan_and_in_a_pipeline(out)
    _transformers_own_distributed_config_trains_a_mixture_of_experts_as_one_process_does(out)


def _a_mixture_of_experts_trains_the_same_under_its_librarys_tp_plan_and_in_a_pipeline(out: Path) -> None:
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    for setting in ("ddp/default/ws2", "tp/colwise-rowwise/ws2", "fsdp2-tp/dp2-tp2/colwise-rowwise/ws4",
                    "ac/fsdp2/reentrant/ws2"):
        assert cases.loc[setting, "ok"] == 1, cases.to_string()
    compared = pd.read_csv(out / "comparisons.csv")
    notes = set(compared[compared["setting"] == "tp/colwise-rowwise/ws2"]["message"])
    assert notes == {"plan: lm: TransformersTensorParallel"}, notes  # transformers applied its own plan
    # its decoder layers as pipeline units, checked to compose to the model's forward
    assert cases.loc["pipeline/gpipe/ws2/stages2/mb2/balanced", "ok"] == 1, cases.to_string()


def _transformers_own_distributed_config_trains_a_mixture_of_experts_as_one_process_does(out: Path) -> None:
    """`from_pretrained(distributed_config=DistributedConfig(...))`: the experts spread over the data-parallel ranks
    (tokens exchanged all-to-all) and over the tensor-parallel ranks (outputs all-reduced) train as one process does;
    the library's CPU offload, which pins host memory, is refused where the machine cannot pin memory, in torch's
    words; and data parallelism without the config (replicas never synchronised, a planted fault) is caught."""
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    for setting in ("hf/fsdp2-ep2/all_to_all/ws2", "hf/tp2-ep2/all_reduce/ws2"):
        assert cases.loc[setting, "ok"] == 1, cases.to_string()
    assert cases.loc["faults/hf_data_parallel_without_sync/ws2", "inconsistent"] == 1, cases.to_string()
    compared = pd.read_csv(out / "comparisons.csv")
    notes = dict(zip(compared["setting"], compared["message"], strict=False))  # transformers applied its own plans
    assert notes["hf/fsdp2-ep2/all_to_all/ws2"] == "plans: the model's ep_plan (3 rules), the model's fsdp_plan (4 rules)"
    assert notes["hf/tp2-ep2/all_reduce/ws2"] == "plans: the model's tp_plan (9 rules), the model's ep_plan (3 rules)"
    refused = pd.read_csv(out / "inconsistencies.csv").set_index("setting")
    assert refused.loc["hf/fsdp2/cpu-offload/ws2", "status"] == "unsupported"
    assert "fsdp_cpu_offload pins host memory" in refused.loc["hf/fsdp2/cpu-offload/ws2", "message"]
    # the family's script loads the model through from_pretrained as the setting does, so the planted fault's
    # replicas drift apart there too, without difftest
    found = pd.read_csv(out / "findings.csv").set_index("example_setting")
    folder = out / "findings" / found.loc["faults/hf_data_parallel_without_sync/ws2", "id"]
    assert (folder / "standalone.txt").read_text().startswith("standalone.py reproduces (exit 1)")
    assert "distributed_config=DistributedConfig(" in (folder / "standalone.py").read_text()


@needs_zoo
def test_an_architecture_without_a_plan_is_refused_for_tensor_parallel_with_that_reason(tmp_path: Path) -> None:
    done = _run(tmp_path / "run", "hf-gpt2")
    assert done.returncode == 0, done.stderr[-3000:]
    refused = pd.read_csv(tmp_path / "run" / "inconsistencies.csv").set_index("setting")
    assert "GPT2LMHeadModel ships no tensor-parallel plan" in refused.loc["tp/colwise-rowwise/ws2", "message"]
    assert "gives no layer list" in refused.loc["pipeline/gpipe/ws2/stages2/mb2/balanced", "message"]
    cases = pd.read_csv(tmp_path / "run" / "summary.csv", index_col=0)
    assert cases.loc["ddp/default/ws2", "ok"] == 1 and cases.loc["ac/fsdp2/reentrant/ws2", "ok"] == 1


@needs_zoo
def test_zoo_kinds_are_the_librarys_findings_and_stay_out_of_the_default_job() -> None:
    from difftest.cli.main import _default_job_models_of, _models_of
    from difftest.contracts.registry import generator_kinds, load_plugins, traits_of

    load_plugins()
    zoo = {kind for kind in generator_kinds() if "zoo" in traits_of(kind)}
    assert {"hf-llama", "hf-mixtral", "hf-bert", "timm-vit"} <= zoo
    assert all("user" not in traits_of(kind) for kind in zoo)  # triaged against the manifest, not "your-model"
    counts = _models_of(_default_job_models_of())
    assert all(counts[kind] == 0 for kind in zoo)


@needs_zoo
def test_a_vits_view_dtensor_refuses_by_design_is_unsupported_and_its_bf16_rounding_is_noise(tmp_path: Path) -> None:
    """One run of one ViT under both settings below (its generation, reference and calibration runs paid once)."""
    out = tmp_path / "run"
    done = _run(out, "timm-vit", "tp/colwise-rowwise/ws2,fsdp2/per-layer/reshard/bf16/ws1")
    assert done.returncode == 0, done.stderr[-3000:]
    _a_view_dtensor_refuses_by_design_is_unsupported_with_its_words(out)
    _bf16_rounding_between_a_vits_modules_is_noise_not_a_finding(out)


def _a_view_dtensor_refuses_by_design_is_unsupported_with_its_words(out: Path) -> None:
    """timm's ViT reshapes its fused qkv projection to (3, heads, width): under a derived tensor-parallel plan the
    sharded width cannot be unflattened, which DTensor refuses by design (pytorch#149764); not an error of anyone's."""
    refused = pd.read_csv(out / "inconsistencies.csv").set_index("setting")
    message = refused.loc["tp/colwise-rowwise/ws2", "message"]
    assert refused.loc["tp/colwise-rowwise/ws2", "status"] == "unsupported", message
    assert "refuses, by design" in message and "Cannot unflatten unevenly sharded tensor" in message


@needs_zoo
def test_a_resnets_batchnorm_is_one_cause_with_its_fix_and_its_library_bugs_are_known(tmp_path: Path) -> None:
    """timm's ResNet: BatchNorm's per-share statistics under DDP and FSDP2 are one finding, the model's, with
    SyncBatchNorm as its fix (torch runs it on GPUs only: unsupported here, in torch's words); checkpointing's second
    update of the running statistics and FSDP2's bf16 policy on BatchNorm are known torch bugs; and the calibration
    that micro-batches refuses a model whose arithmetic depends on the batch."""
    out = tmp_path / "run"
    settings = ("ddp/default/ws2,ddp/sync-batchnorm/ws2,fsdp2/per-layer/reshard/fp32/ws2,"
                "fsdp2/per-layer/reshard/bf16/ws1,ac/single/non-reentrant/ws1")
    done = _run(out, "timm-resnet", settings)
    assert done.returncode == 0, done.stderr[-3000:]
    findings = pd.read_csv(out / "findings.csv").set_index("example_setting")
    per_share = findings[findings["title"].str.contains("share of the batch")]
    assert len(per_share) == 1 and per_share.iloc[0]["upstream"] == "your-model", findings.to_string()
    assert per_share.iloc[0]["cases"] == 2  # DDP and FSDP2 in fp32: one cause, one finding
    # evaluated as its user evaluates it (eval mode): the divergence starts in training, not before it
    assert not str(per_share.iloc[0]["first_divergence"]).startswith("eval_before"), per_share.iloc[0]
    assert "convert_sync_batchnorm" in (out / "findings.md").read_text()
    known = dict(zip(findings["known_issue"], findings["upstream"], strict=True))
    assert known.get("checkpoint-batchnorm-running-stats-twice") == "known", findings.to_string()
    assert known.get("fsdp2-mixed-precision-batchnorm") == "known", findings.to_string()
    refused = pd.read_csv(out / "inconsistencies.csv").set_index("setting")
    assert "torch refuses SyncBatchNorm on cpu" in refused.loc["ddp/sync-batchnorm/ws2", "message"]
    # the FSDP2 bug's script builds the ResNet as timm does and fails as the setting did, without difftest; the
    # library the model's other branch builds with is not imported by its ranks
    bf16 = findings[findings["known_issue"] == "fsdp2-mixed-precision-batchnorm"].iloc[0]
    verdict = (out / "findings" / bf16["id"] / "standalone.txt").read_text()
    assert verdict.startswith("standalone.py reproduces (exit 1)"), verdict
    script = (out / "findings" / bf16["id"] / "standalone.py").read_text()
    assert "timm.create_model(" in script and "'transformers'" not in script and "import difftest" not in script
    assert "BatchNorm normalises each micro-batch" in refused.loc["calib-microbatch/reference", "message"]


@needs_zoo
@pytest.mark.heavy
def test_a_zoo_models_script_builds_it_from_its_config_and_judges_the_librarys_own_plans(tmp_path: Path) -> None:
    """A Hugging Face model's standalone scripts (no difftest) build it from its config class, then train it under the
    model's own tensor-parallel plan and as its decoder chain in a pipeline: they agree with one process, as the sweep
    did (exit 0); the same tensor-parallel script with the ranks' loss planted 1.5 times larger says BUG PRESENT."""
    import generators  # noqa: F401 -- the zoo's kinds, registered
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.check import check_script
    from difftest.scripts.write import emit

    out, model = tmp_path / "run", "hf-llama-s0-i0"
    tp, pipeline = "tp/colwise-rowwise/ws2", "pipeline/gpipe/ws2/stages2/mb2/balanced"
    done = _run(out, "hf-llama", f"{tp},{pipeline}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (pd.read_csv(out / "summary.csv", index_col=0).loc[[tp, pipeline], "ok"] == 1).all()
    scripts = []
    for number, setting in enumerate((tp, pipeline)):
        spread = envelope_spread(out, model, setting)
        emitted = emit(out, f"Z{number}", "a zoo model's case", "inconsistent", out / "models" / model, setting,
                       "param_after_step1/lm.lm_head.weight", spread, Tolerance(), check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "getattr(transformers, params[\"config\"])" in text and "import difftest" not in text
        assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
            emitted.checked.output[-3000:]
        scripts.append(emitted.path)
    text = scripts[0].read_text()
    assert "model_tp_plan(module, *setting[\"own_plan\"])" in text  # the model's own plan, as transformers applies it
    loss = "    return prediction_loss(module(**inputs) if isinstance(inputs, dict) else module(inputs), labels)"
    assert text.count(loss) == 1
    larger = "return (1 + 0.5 * torch.distributed.is_initialized()) * "
    scripts[0].write_text(text.replace(loss, loss.replace("return ", larger)))
    planted = check_script(scripts[0], timeout_s=120)
    assert planted.exit_code == 1 and "BUG PRESENT" in planted.output, planted.output[-3000:]


def _bf16_rounding_between_a_vits_modules_is_noise_not_a_finding(out: Path) -> None:
    """FSDP2's bf16 policy at world size 1 is bitwise the ViT cast to bf16 in one process; its attention rounds between
    leaf modules, which only the per-operation Monte Carlo runs model: judged by them, ok (1.59x the envelope without
    them: two false findings), and those runs are in the envelope it was judged by."""
    compared = pd.read_csv(out / "comparisons.csv")
    case = compared[(compared["setting"] == "fsdp2/per-layer/reshard/bf16/ws1") & compared["tensor"].notna()]
    assert len(case) and (case["status"] == "ok").all() and case["calibrated_ratio"].max() < 1, case.describe()
    ran = pd.read_csv(out / "summary.csv", index_col=0)
    assert (ran.loc[[f"calib-bf16-op-{x}/reference" for x in "abc"], "ok"] == 1).all(), ran.to_string()


def test_a_zoo_kind_without_its_library_says_which_extra_to_install() -> None:
    from difftest import ModelAdapter
    from generators.zoo import ZooKind

    adapter = ModelAdapter("hf-nothing", lambda seed: None, lambda seed, size: (None, None), lambda p, t: None)
    said = ZooKind(adapter, "no_such_library_here").available()
    assert said == "needs no_such_library_here (install the zoo: pip install 'difftest[zoo]')"
