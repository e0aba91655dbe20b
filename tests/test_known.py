"""difftest/findings/known_issues.toml: the library findings difftest knows, and how triage matches cases to them."""

from __future__ import annotations

import dataclasses
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.contracts.adapter import MODEL_FEATURES, OUTPUT_OBJECT, AdapterGenerator
from difftest.contracts.errors import UserError
from difftest.contracts.registry import all_settings, generator_kinds, load_plugins, traits_of
from difftest.findings import known

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_still_names_settings_and_traits_that_exist() -> None:
    load_plugins()
    names = [s.name for s in all_settings()]
    # and what a user's adapter declares: its kind's traits ("user"), its layer kinds, a forward that returns an object
    traits = (set().union(*(traits_of(k) for k in generator_kinds())) | set(AdapterGenerator.traits)
              | set(MODEL_FEATURES) | {OUTPUT_OBJECT})
    issues = known.manifest()
    assert len(issues) >= 10 and len({i.id for i in issues}) == len(issues)
    stale = [f"{i.id}: {glob}" for i in issues for glob in i.settings if not fnmatch.filter(names, glob)]
    assert not stale, f"manifest globs that match no registered setting: {stale}"
    assert not [i.id for i in issues if set(i.traits) - traits], "traits no generator declares"
    for issue in issues:
        assert issue.statuses and set(issue.statuses) <= {"inconsistent", "nondeterministic", "error", "crash", "timeout"}
        assert all(r.tracker.count("/") == 1 and r.number > 0 for r in issue.references)


def test_a_semantic_difference_explains_a_finding_only_if_it_explains_every_case() -> None:
    import pandas as pd

    from difftest.findings.semantics import differences, semantic_difference_of

    load_plugins()
    names = [s.name for s in all_settings()]
    for difference in differences():
        assert difference.layer in MODEL_FEATURES
        assert all(fnmatch.filter(names, glob) for glob in (*difference.settings, *difference.exempt)), difference.id
    rows = pd.DataFrame({"model": ["bn", "bn"], "setting": ["ddp/default/ws2", "fsdp2/per-layer/reshard/fp32/ws2"],
                         "status": ["inconsistent", "inconsistent"]})
    layers = {"bn": {"BatchNorm"}, "plain": set()}
    found = semantic_difference_of(rows, layers)
    assert found is not None and found.id == "batchnorm-statistics-per-share" and "SyncBatchNorm" in found.fix
    assert semantic_difference_of(rows.assign(model="plain"), layers) is None  # no BatchNorm: not its cause
    assert semantic_difference_of(rows.assign(status="error"), layers) is None  # a failure is another cause
    # one case it does not explain (one process, tensor parallel: the batch is not split) leaves the finding open
    assert semantic_difference_of(pd.concat([rows, rows.assign(setting="tp/colwise-rowwise/ws2")]), layers) is None
    # the fix, run, is no longer the model's difference: a disagreement there is somebody's bug
    assert semantic_difference_of(rows.assign(setting="ddp/sync-batchnorm/ws2"), layers) is None
    # a model's layer kinds as an adapter reads them: BatchNorm (SyncBatchNorm too), Dropout only where it drops
    import torch

    from difftest.contracts.adapter import batch_dependent_layers

    assert batch_dependent_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SyncBatchNorm(2),
                                                      torch.nn.Dropout(0.1))) == ["BatchNorm", "Dropout"]
    assert batch_dependent_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))) == []
    dropped = semantic_difference_of(rows.assign(model="drop"), {"drop": {"Dropout"}})
    assert dropped is not None and dropped.id == "dropout-masks-per-share"


def test_a_case_is_matched_by_setting_status_message_traits_and_oracle() -> None:
    gelu = known.match("convert/onnxruntime/eval", "error", "Fail: [ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model",
                       {"keras"})
    assert gelu is not None and gelu.id == "tf2onnx-exact-gelu-erfc" and gelu.upstream == known.Upstream.KNOWN
    assert known.match("convert/onnxruntime/eval", "error", "some other failure", {"keras"}) is None
    assert known.match("convert/onnxruntime/eval", "inconsistent", "", {"keras"}) is None  # not its status
    row_wise = known.match("torchrec/ebc/row_wise/ws3", "inconsistent", "", {"torchrec"}, "ok")
    assert row_wise is not None and row_wise.calibrated_only and row_wise.upstream == known.Upstream.UNREPORTED
    # the 2^-20 scaling hides inside D3's tolerance: a row-wise case D3 also flags is something else
    assert known.match("torchrec/ebc/row_wise/ws3", "inconsistent", "", {"torchrec"}, "inconsistent") is None
    assert known.match("fsdp1/no_shard/ws2", "inconsistent", "", {"torchrec"}) is None  # needs a converted model
    assert known.match("ddp/default/ws2", "inconsistent", "", {"torchrec", "keras"}) is None


def test_an_entry_is_expected_only_on_the_releases_it_affects() -> None:
    issue = next(i for i in known.manifest() if i.library == "torch")
    assert issue.reproduces_on({"torch": "2.14.1+cu130"}) is True
    assert issue.reproduces_on({"torch": "9.0.0"}) is False  # fixed upstream by then: not expected
    assert issue.reproduces_on({}) is None
    assert known.installed_version("torch") is not None and known.installed_version("fbgemm-gpu") is not None


def test_a_case_on_a_release_outside_an_entrys_range_is_not_explained_by_it() -> None:
    """gloo's reduce-scatter AVG summed on torch 2.7-2.8: an FSDP2 disagreement there is that bug; on 2.14.1 the same
    symptom is something else, and must stay a new finding rather than hide under a bug fixed long ago."""
    def explained(torch_build: str) -> known.KnownIssue | None:
        versions = known.stack_versions({"torch": torch_build, "fbgemm-gpu-cpu": "1.9.0", "onnx": "1.17.0"})
        return known.match("fsdp2/per-layer/reshard/fp32/ws2", "inconsistent", "", {"torchrec"}, versions=versions)
    on_2_8 = explained("2.8.0+cu128")
    assert on_2_8 is not None and on_2_8.id == "gloo-reduce-scatter-avg-sums" and on_2_8.upstream == known.Upstream.KNOWN
    assert explained("2.14.1+cu130") is None and explained("2.9.1") is None
    assert known.stack_versions({"fbgemm-gpu-cpu": "1.9.0", "torch": "local-build"}) == {"fbgemm-gpu": "1.9.0"}
    # without the run's versions (a caller that does not know them) every entry may explain a case
    assert known.match("fsdp2/per-layer/reshard/fp32/ws2", "inconsistent", "", {"torchrec"}) is not None


@pytest.mark.parametrize("entry", [
    'id = "x"\ntitle = "t"\nlibrary = "torch"\naffects = "not a specifier"\nstatuses = ["error"]\nsettings = ["*"]',
    'id = "x"\ntitle = "t"\nlibrary = "torch"\naffects = ">=2"\nstatuses = ["error"]',
    'id = "x"\ntitle = "t"\nlibrary = "torch"\naffects = ">=2"\nstatuses = ["error"]\nsettings = ["*"]\nmessage = "("',
])
def test_a_malformed_manifest_is_one_line_naming_the_file_and_the_entry(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "known_issues.toml"
    path.write_text(f"[[issue]]\n{entry}\n")
    with pytest.raises(UserError) as raised:
        known.load(path)
    assert str(path) in str(raised.value) and "'x'" in str(raised.value) and "\n" not in str(raised.value)


def test_findings_one_known_bug_explains_become_one_and_say_what_they_merged() -> None:
    import pandas as pd

    from difftest.findings.triage import Finding, merge_known

    scaling = next(i for i in known.manifest() if i.id == "torchrec-rowwise-scaled-by-one-minus-2-pow-20")

    def finding(fid: str, setting: str, cases: int, issue: known.KnownIssue | None) -> Finding:
        rows = pd.DataFrame({"model": [f"m{i}" for i in range(cases)], "setting": [setting] * cases})
        return Finding(id=fid, status="inconsistent", title=fid, signature=f"sig {fid}", rows=rows, known=issue)

    found = merge_known([finding("Fb", "torchrec/ebc/table_row_wise/ws2", 3, scaling),
                         finding("Fn", "ddp/default/ws2", 1, None), finding("Fa", "torchrec/ebc/row_wise/ws2", 2, scaling)])
    assert [len(f.rows) for f in found] == [5, 1]
    one = found[0]
    # the lead's signature and its example go together: that pair is what minimisation and repro.py check
    assert one.signature == "sig Fb" and one.example["setting"] == "torchrec/ebc/table_row_wise/ws2"
    assert one.merged == [("Fb", "sig Fb", 3), ("Fa", "sig Fa", 2)] and scaling.title in one.title
    assert one.id == merge_known([finding("Fa", "x", 1, scaling), finding("Fc", "y", 1, scaling)])[0].id  # stable
    assert found[1].id == "Fn" and not found[1].merged and found[1].title == "Fn"  # no entry: where it shows
    # alone, a finding an entry explains keeps its id and is titled by that bug too
    alone = merge_known([finding("Fz", "torchrec/ebc/row_wise/ws2", 2, scaling)])[0]
    assert alone.id == "Fz" and not alone.merged and alone.title == f"inconsistent: {scaling.title}"
    # told how long each part's script is, the merge is led by the shortest among the gravest status: the same bug
    # through the plain plan rather than the one that composes it with more; the merged finding keeps its id
    lines = {"Fb": 420, "Fa": 370, "Fe": 900}
    crash = dataclasses.replace(finding("Fe", "torchrec/ebc/grid_shard/ws2", 1, scaling), status="error")
    parts = [finding("Fb", "torchrec-mc/row_wise/ws2", 3, scaling), finding("Fa", "torchrec/ebc/row_wise/ws2", 2, scaling)]
    led = merge_known([crash, *parts], lambda f: lines[f.id])[0]
    assert led.signature == "sig Fe" and led.status == "error"  # a shorter script never outranks a graver status
    led = merge_known(parts, lambda f: lines[f.id])[0]
    assert led.signature == "sig Fa" and led.example["setting"] == "torchrec/ebc/row_wise/ws2" and len(led.rows) == 5
    assert led.id == one.id and led.merged == [("Fa", "sig Fa", 2), ("Fb", "sig Fb", 3)]
    # a part with no script, or a tie, keeps the order given
    assert merge_known(parts, lambda f: None)[0].signature == "sig Fb"
    assert merge_known(parts, lambda f: 7)[0].signature == "sig Fb"
    # the part an earlier triage of the run minimised (by the merged id) leads again, whatever its script's length
    before = {one.id: ("sig Fb", "m0", "torchrec-mc/row_wise/ws2")}
    assert merge_known(parts, lambda f: lines[f.id], before)[0].signature == "sig Fb"
    # a part whose example is signed as another setting (a mixed plan's) never leads where another is signed as itself
    signed_otherwise = finding("Fm", "torchrec/ebc/mixed/ws2", 1, scaling)
    signed_otherwise.rows = signed_otherwise.rows.assign(signed_as="torchrec/ebc/row_wise/ws2")
    lines["Fm"] = 10
    assert merge_known([*parts, signed_otherwise], lambda f: lines[f.id])[0].signature == "sig Fa"


def test_a_finding_is_led_by_its_setting_with_the_shortest_script() -> None:
    import pandas as pd

    from difftest.findings.triage import _simplest_example_first

    frame = pd.DataFrame({
        # as triage orders them: a case signed as another setting (a mixed plan's) last
        "model": ["m0", "m0", "m1", "m1", "m0"],
        "setting": ["hybrid/dp2xpp2/ws4", "pipeline/ws2", "hybrid/dp2xpp2/ws4", "pipeline/ws2", "mixed/ws2"],
        "signed_as": ["hybrid/dp2xpp2/ws4", "pipeline/ws2", "hybrid/dp2xpp2/ws4", "pipeline/ws2", "row_wise/ws2"],
        "status": "inconsistent", "first_divergence": "eval/y", "message": ""}, index=[3, 0, 4, 1, 2])
    lines = {"mixed/ws2": 10, "hybrid/dp2xpp2/ws4": 460, "pipeline/ws2": 420}
    asked: list[tuple[str, str]] = []

    def lines_of(model: str, setting: str, *_: str) -> int | None:
        asked.append((model, setting))
        return lines[setting]

    led = _simplest_example_first(frame, lines_of)
    # each setting once, on its first model; a case signed as another setting is never asked, nor leads
    assert sorted(asked) == [("m0", "hybrid/dp2xpp2/ws4"), ("m0", "pipeline/ws2")]
    assert list(led.index) == [0, 3, 4, 1, 2] and led.loc[0].equals(frame.loc[0])  # labels, not positions
    # the example an earlier triage of the run minimised leads again, unmeasured, while it is one of the cases
    asked.clear()
    again = _simplest_example_first(frame, lines_of, ("sig", "m1", "hybrid/dp2xpp2/ws4"))
    assert list(again.index) == [4, 3, 0, 1, 2] and not asked
    assert list(_simplest_example_first(frame, lines_of, ("sig", "m9", "pipeline/ws2")).index) == [0, 3, 4, 1, 2]
    lines["pipeline/ws2"] = None  # no script: the first keeps its place
    assert list(_simplest_example_first(frame, lambda m, s, *_: lines[s]).index) == [3, 0, 4, 1, 2]
    one_setting = frame[frame["setting"] == "pipeline/ws2"]
    assert _simplest_example_first(one_setting, lambda *_: pytest.fail("one setting: nothing to choose")) is one_setting


def test_a_run_records_its_stack_and_keeps_an_earlier_one(tmp_path: Path) -> None:
    import json

    from difftest.contracts.spec import RunConfig
    from difftest.storage import stack

    run_file = tmp_path / "run.json"
    run_file.write_text(RunConfig(seed=3).to_json())
    assert stack.record(run_file) is None
    recorded = stack.recorded(tmp_path)
    import torch

    # torch as it names its build (`2.14.1+cu130`); the release is the one the manifest is keyed by
    assert recorded["libraries"]["torch"] == torch.__version__
    assert recorded["libraries"]["torch"].split("+")[0] == known.installed_version("torch")
    assert recorded["cpu_capability"] and recorded["python"].startswith("3.")
    assert stack.record(run_file) is None  # the same stack again: nothing changes
    raw = json.loads(run_file.read_text())
    raw["stack"]["libraries"]["torch"] = "2.10.0"
    run_file.write_text(json.dumps(raw))
    assert stack.record(run_file)["libraries"]["torch"] == "2.10.0"  # a sweep on another stack says so
    assert json.loads(run_file.read_text())["earlier_stacks"][0]["libraries"]["torch"] == "2.10.0"
    assert RunConfig.load(run_file) == RunConfig(seed=3)  # resuming still compares only how the run was made
    assert "torch " + known.installed_version("torch") in stack.describe(stack.recorded(tmp_path))


@pytest.mark.parametrize(("entry", "repro"), [
    ("pipelining-interleaved-zero-bubble-wrong-training", "pipelining_split_backward_untrained_weights.py"),
    ("pipelining-split-backward-reused-weights", "pipelining_split_backward_reused_weights.py"),
    ("dtensor-conv-halo-backward-drops-input-grad", "dtensor_conv_halo_backward_drops_input_grad.py"),
    ("dtensor-channels-last-adaptive-avg-pool", "dtensor_channels_last_adaptive_avg_pool.py"),
    ("fused-optimizer-cpu-grad-strides", "fused_optimizer_cpu_grad_strides.py"),
    ("dcp-empty-shard-old-checkpoint-heuristic", "dcp_empty_shard_old_checkpoint_heuristic.py"),
    ("torchrec-mc-unsharded-eviction-keeps-rows", "torchrec_mc_eviction_keeps_rows.py"),
    ("torchrec-mc-dense-kernel-reset-fails", "torchrec_mc_dense_kernel_fails.py"),
    ("dtensor-loss-backward-local-numel", "dtensor_loss_backward_local_numel.py"),
    ("fsdp2-dp-mesh-dims-partial-grad-averaged", "fsdp2_dp_mesh_dims_partial_grad_averaged.py"),
    ("fbgemm-cpu-rowwise-adagrad-ignores-weight-decay", "fbgemm_cpu_rowwise_adagrad_weight_decay.py"),
    ("torchrec-fused-optimizer-drops-torch-optim-options", "torchrec_fused_optimizer_drops_options.py"),
    ("torchrec-shared-optimizer-options-dict", "torchrec_shared_optimizer_options.py"),
    ("dtensor-rprop-no-strategy", "dtensor_rprop_no_strategy.py"),
])
def test_a_reproducer_shows_its_bug_exactly_where_the_manifest_says(entry: str, repro: str) -> None:
    """The traced library line behind a finding, run alone: it exits 1 on every release the entry affects and 0
    elsewhere (upstream fixed it: narrow `affects`, and the finding's cases must stop matching it)."""
    issue = next(i for i in known.manifest() if i.id == entry)
    assert f"repros/{repro}" in issue.notes
    done = subprocess.run([sys.executable, str(ROOT / "repros" / repro)], capture_output=True, text=True, timeout=120)
    expected = 1 if issue.reproduces_on(known.installed_versions({issue.library})) else 0
    assert done.returncode == expected, done.stdout + done.stderr[-2000:]
    assert ("BUG PRESENT" in done.stdout) == (expected == 1)
