"""Fast unit tests: generators, oracle, store, registry, CLI errors. No worker processes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from difftest.contracts.errors import UserError
from difftest.contracts.registry import all_settings, load_plugins, select_settings, tier, with_references
from difftest.contracts.setting import Repeat
from difftest.contracts.tolerance import Tolerance
from difftest.judging.oracle import compare, compare_tensor
from difftest.storage.artifacts import load_arrays
from difftest.storage.store import CaseRecord, Store
from generators.dlrm import DlrmGenerator


def test_models_are_reproducible_from_seed_and_index(tmp_path: Path) -> None:
    g = DlrmGenerator()
    a, b = g.spec(7, 3), g.spec(7, 3)
    assert a.to_json() == b.to_json()
    assert g.spec(7, 4).to_json() != a.to_json()
    state_a, state_b = g.init_state(a), g.init_state(b)
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)
    inputs_a, inputs_b = g.inputs(a, 24), g.inputs(b, 24)
    for split in ("train", "eval"):
        arrays_a, arrays_b = inputs_a[split].to_arrays(split), inputs_b[split].to_arrays(split)
        assert arrays_a.keys() == arrays_b.keys()
        assert all(np.array_equal(arrays_a[k], arrays_b[k]) for k in arrays_a)


def test_models_built_side_by_side_are_the_models_built_one_by_one_and_one_that_cannot_be_built_says_why(
        tmp_path: Path) -> None:
    from difftest.generation.generate import ModelBuilders, materialise

    load_plugins()
    g = DlrmGenerator()
    specs = [dataclasses.replace(g.spec(0, i), variant=f"v{i}") for i in range(5)]
    broken = specs[0].params["tables"][0] | {"num_embeddings": -1}  # a shape numpy refuses
    specs.insert(2, dataclasses.replace(specs[0], params=specs[0].params | {"tables": [broken]}, variant="broken"))
    builders = ModelBuilders(load_plugins(), processes=2)  # builder processes even where this machine has one core
    try:
        reasons = builders.build([(s, tmp_path / "side" / s.model_id, 24) for s in specs])
    finally:
        builders.close()
    assert [r is None for r in reasons] == [True, True, False, True, True, True]
    assert reasons[2] is not None and reasons[2].startswith("ValueError: ") and "\n" not in reasons[2]
    assert not (tmp_path / "side" / specs[2].model_id).exists()  # no half-written folder
    for spec in specs[:2] + specs[3:]:
        materialise(spec, tmp_path / "one" / spec.model_id, 24)
        side, one = tmp_path / "side" / spec.model_id, tmp_path / "one" / spec.model_id
        assert sorted(p.name for p in side.iterdir()) == sorted(p.name for p in one.iterdir())
        assert all((side / p.name).read_bytes() == p.read_bytes() for p in one.iterdir())


def test_generated_models_cover_the_spec() -> None:
    g = DlrmGenerator()
    specs = [g.spec(0, i) for i in range(20)]
    for spec in specs:
        tables = spec.params["tables"]
        unweighted = [t for t in tables if not t["weighted"]]
        weighted = [t for t in tables if t["weighted"]]
        assert 1 <= len(unweighted) <= 5 and 1 <= len(weighted) <= 5
        for t in tables:
            assert 1 <= t["num_embeddings"] <= 1000 and t["embedding_dim"] % 4 == 0
        assert set(spec.frozen) <= set(g.parameter_shapes(spec.params))
    assert {t["pooling"] for s in specs for t in s.params["tables"]} == {"SUM", "MEAN"}
    assert any(len(t["features"]) == 2 for s in specs for t in s.params["tables"])  # shared tables
    assert sum(bool(s.frozen) for s in specs) == 10  # every other model is the frozen variant


def test_inputs_have_empty_bags_duplicate_ids_and_split_evenly() -> None:
    g = DlrmGenerator()
    spec = g.spec(0, 0)
    batch = g.inputs(spec, 24)["train"]
    lengths = np.concatenate([f.lengths for f in batch.sparse.values()])
    assert (lengths == 0).any()
    assert any(len(f.values) > len(np.unique(f.values)) for f in batch.sparse.values())
    for world_size in (1, 2, 3, 4):
        shares = [batch.shard(r, world_size) for r in range(world_size)]
        for name, feature in batch.sparse.items():
            assert np.array_equal(np.concatenate([s.sparse[name].values for s in shares]), feature.values)
            assert np.array_equal(np.concatenate([s.sparse[name].lengths for s in shares]), feature.lengths)
        assert np.array_equal(np.concatenate([s.labels for s in shares]), batch.labels)
    from difftest.contracts.errors import Unsupported

    with pytest.raises(Unsupported, match="does not split over 5 ranks"):  # the setting cannot run: not a finding
        batch.shard(0, 5)


def test_oracle_metrics() -> None:
    ref = np.array([1.0, -2.0, 0.0, 4.0], dtype=np.float32)
    same = compare_tensor("eval_before/prediction", ref.copy(), ref, Tolerance())
    assert same.consistent and same.linf == 0 and same.mismatches == 0
    off = ref.copy()
    off[1] += 1e-3
    c = compare_tensor("param_after_step1/x", off, ref, Tolerance())
    assert not c.consistent and c.mismatches == 1 and c.phase == "param_after_step1" and c.tensor == "x"
    assert c.linf == pytest.approx(1e-3, rel=1e-3) and c.max_rel == pytest.approx(5e-4, rel=1e-3)
    assert compare_tensor("a/b", off, ref, Tolerance(atol=2e-3)).consistent  # re-judging needs no re-run
    nan = ref.copy()
    nan[0] = np.nan
    assert not compare_tensor("a/b", nan, ref, Tolerance()).consistent
    assert compare_tensor("a/b", nan, nan, Tolerance()).consistent  # NaN in both at the same place
    # an infinity in both at the same place is equal (inf - inf is NaN, which counted as the farthest: a rerun that
    # overflowed the same way twice was a nondeterminism), an infinity of the other sign is not
    overflowed = np.array([np.inf, -np.inf, 1.0], np.float32)
    assert compare_tensor("a/b", overflowed, overflowed.copy(), Tolerance(atol=0.0, rtol=0.0)).mismatches == 0
    assert compare_tensor("a/b", -overflowed, overflowed, Tolerance()).mismatches == 3
    assert "shape" in compare_tensor("a/b", ref[:2], ref, Tolerance()).message
    missing = compare({}, {"a/b": ref}, Tolerance())
    assert len(missing) == 1 and not missing[0].consistent and "missing" in missing[0].message


def test_store_commits_atomically_and_knows_what_is_done(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.commit(CaseRecord("m", "s/ws2", "ok"), {"eval_before/prediction": np.arange(3, dtype=np.float32)})
    store.commit(CaseRecord("m", "t/ws2", "crash", "rank 1 killed by SIGABRT"), None)
    store.commit(CaseRecord("m", "t/ws2", "crash", "again"), None)  # a rerun replaces, never duplicates
    assert store.done() == {("m", "s/ws2"), ("m", "t/ws2")}
    records = {r.setting: r for r in store.records()}
    assert records["t/ws2"].message == "again"
    assert np.array_equal(store.load_outputs(records["s/ws2"])["eval_before/prediction"], np.arange(3))
    assert not list(tmp_path.rglob(".*.tmp"))
    store.close()


def test_registry_names_are_paths_and_globs_select_families() -> None:
    load_plugins()
    names = [s.name for s in all_settings()]
    assert len(names) == len(set(names)) and names[0] == "reference"
    torchrec = select_settings("torchrec/*")
    assert len(torchrec) == 7 * 3 + 3 + 6
    # a name's ws<N> is the ranks the setting distributes over, its own processes' too (`scale`)
    assert {s.scale for s in select_settings("*/ws3")} == {3}
    with pytest.raises(UserError):
        select_settings("nothing/*")


def test_the_default_tier_covers_every_class_and_every_tier_axis_value_at_the_smallest_distributed_scale() -> None:
    load_plugins()
    full, default = tier("full"), tier("default")
    # (the calibration runs the default tier brings along are derived settings, counted apart)
    registered = [s for s in default if s in full]
    assert full == all_settings() and len(registered) < len(full) / 3
    assert select_settings(None) == default and select_settings(None, "full") == full
    # every class but those too costly for it, plus the calibration runs of the roots it is judged down to (derived:
    # not in `full`)
    assert {type(s) for s in registered} == {type(s) for s in full if type(s).in_default_tier}
    assert any(not type(s).in_default_tier for s in full)  # compiled training
    assert all(isinstance(s, Repeat) for s in default if s not in full)
    chosen = {s.name for s in default}
    for cls in {type(s) for s in full if type(s).in_default_tier}:
        members = [s for s in full if type(s) is cls]
        for axis in cls.tier_axes:
            wanted = {repr(s.params[axis]) for s in members}
            assert wanted == {repr(s.params[axis]) for s in members if s.name in chosen}, (cls.__name__, axis)
    # each sharding type, schedule and quantization scheme once, at 2 ranks where 2 is enough
    assert {s.name for s in select_settings("torchrec/*", "default")} == {
        f"torchrec/ebc/{t}/ws2" for t in ("table_wise", "row_wise", "column_wise", "table_row_wise",
                                          "table_column_wise", "data_parallel", "grid_shard", "mixed-s0", "planner")}
    pipelines = [s for s in default if s.family == "pipeline"]
    assert {s.params["schedule"] for s in pipelines} == {s.params["schedule"] for s in full if s.family == "pipeline"}
    assert {s.world_size for s in pipelines if s.params["data_parallel"] == 1} == {2}
    assert "tf/mirrored/r2" in chosen and "tf/mirrored/r1" not in chosen  # one replica is not distributed
    # simulators and one-rank judges come in as references only
    assert not any(s.judge_only for s in default if not any(t.reference == s.name for t in default))
    # a glob means what it matches, unless a tier is asked for
    assert len(select_settings("ddp/*")) == 21 and len(select_settings("ddp/*", "default")) == 7
    with pytest.raises(UserError, match="unknown tier"):
        tier("huge")


FP32_MONTE_CARLO = ("fp32-a", "fp32-b", "fp32-c")


def test_a_selection_brings_the_chain_of_settings_it_is_judged_against() -> None:
    load_plugins()
    def chain(glob: str) -> list[str]:  # what it is judged against, then the calibration runs of the chain's root
        return [s.name for s in with_references(select_settings(glob))]

    chosen = chain("rerun/repartition/gpipe/ws2/mb2/moved")
    root = "accumulate/mb2/momentum0.9/steps4"
    assert chosen == ["rerun/repartition/gpipe/ws2/mb2/moved", "repartition/gpipe/ws2/mb2/moved",
                      "repartition/gpipe/ws2/mb2/uninterrupted", root,
                      *(f"calib-{m}/{root}" for m in ("float64", "threads", "microbatch", *FP32_MONTE_CARLO))]
    assert chain("rerun/ddp/default/ws3") == ["rerun/ddp/default/ws3", "ddp/default/ws3", "reference",
                                              *(f"calib-{m}/reference" for m in ("float64", "order", "threads", "microbatch",
                                                                                 *FP32_MONTE_CARLO))]
    # mixed precision: sharded bf16 against one-rank bf16 (what sharding adds), that against fp32 (what bf16 costs);
    # the bf16 ones are judged against the reference's Monte Carlo bf16 envelope
    assert chain("fsdp2/per-layer/reshard/bf16/ws3") == [
        "fsdp2/per-layer/reshard/bf16/ws3", "fsdp2/per-layer/reshard/bf16/ws1", "reference",
        *(f"calib-{m}/reference" for m in ("float64", "bf16-a", "bf16-b", "bf16-c", "bf16-op-a", "bf16-op-b",
                                           "bf16-op-c"))]
    load_plugins(("tests.faults.planted",))  # a planted fault is judged against the clean setting it breaks
    assert chain("faults/stash_queue_one_short/stages2")[:2] == [
        "faults/stash_queue_one_short/stages2", "async-pipeline/simulator/stash/stages2/mb4"]
    assert [s.name for s in with_references(select_settings("faults/repartition_loses_key/ws2"))][1] == \
        "repartition/gpipe/ws2/mb2/uninterrupted"


def test_the_device_family_is_unsupported_with_its_reason_without_cuda_and_calibrated_at_tf32_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import settings.device as device

    load_plugins()
    assert {"cuda/reference", "cuda-tf32/reference"} <= {s.name for s in tier("default")}
    tf32 = select_settings("cuda-tf32/reference")[0]
    assert (tf32.precision, tf32.reference, select_settings("cuda/ddp/default/ws2")[0].world_size) == \
        ("tf32", "reference", 2)
    tf32_calibrations = {f"calib-tf32-{s}/reference" for s in "abc"}
    monkeypatch.setattr(device, "visible_gpus", lambda: 0)
    assert tf32.available() == "needs a CUDA device, this machine has none"
    assert not tf32_calibrations & {s.name for s in with_references([tf32])}  # nothing to calibrate for
    monkeypatch.setattr(device, "visible_gpus", lambda: 1)
    assert tf32.available() is None
    assert tf32_calibrations <= {s.name for s in with_references([tf32])}
    assert "TensorFlow" in (select_settings("cuda/tf/reference")[0].supports(None) or "")
    # a strategy whose collectives gloo does not carry on CUDA tensors is refused there, before it runs
    assert "all_gather, reduce_scatter" in (select_settings("cuda/fsdp2/per-layer/reshard/fp32/ws2")[0].available() or "")
    assert select_settings("cuda/ddp/default/ws2")[0].available() is None


def test_collectives_gloo_does_not_carry_on_cuda_are_refused_and_nothing_else() -> None:
    from difftest.contracts.devices import SHARDED, collective_refusal
    from difftest.contracts.registry import get_setting

    load_plugins()
    def refusal(name: str, device: str = "cuda", backend: str = "gloo") -> str | None:
        setting = get_setting(name)
        return collective_refusal(device, backend, setting.world_size, setting.collectives)

    assert "recv, send" in (refusal("pipeline/1f1b/ws2/stages2/mb2/balanced") or "")
    assert "all_gather, reduce_scatter" in (refusal("resume/ddp-ws2/fsdp2-ws2/k3") or "")  # its phases' groups
    assert refusal("ddp/default/ws2") is refusal("resume/ddp-ws2/ddp-ws2/k3") is None
    assert refusal("fsdp2/per-layer/reshard/bf16/ws1") is None  # one rank exchanges nothing
    assert refusal("pipeline/1f1b/ws2/stages2/mb2/balanced", backend="nccl") is None
    assert refusal("pipeline/1f1b/ws2/stages2/mb2/balanced", device="cpu") is None
    assert "does not declare" in (collective_refusal("cuda", "gloo", 2, None) or "")
    assert collective_refusal("cuda", "gloo", 2, SHARDED) is not None


def test_the_default_tier_follows_declared_families_not_the_modules_that_hold_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Moving a setting class to another module changes nothing: what judges a family is declared
    (`Setting.family`, `judged_families`), not read off `__module__`."""
    load_plugins()
    before = [s.name for s in tier("default")]
    for i, cls in enumerate({type(s) for s in all_settings()}):
        monkeypatch.setattr(cls, "__module__", f"elsewhere{i}")
    assert [s.name for s in tier("default")] == before


def test_settings_list_names_gives_one_full_name_per_line_per_tier() -> None:
    from typer.testing import CliRunner

    from difftest.cli.main import app
    from difftest.contracts.registry import derived_prefixes

    def lines(*args: str) -> list[str]:  # in this process: the registry it lists is the one compared with
        result = CliRunner().invoke(app, list(args))
        assert result.exit_code == 0, result.output[-2000:]
        return result.stdout.splitlines()

    load_plugins()
    full, default = ([s.name for s in tier(name)] for name in ("full", "default"))
    assert lines("settings", "list", "--names", "--tier", "full") == full
    assert lines("settings", "list", "--names", "--tier", "default") == default
    assert lines("settings", "list", "--names") == full
    piped = lines("settings", "list")  # not a terminal: one tab-separated line per setting
    assert piped[0].split("\t")[:3] == ["setting", "tier", "family"]
    listed = [line.split("\t") for line in piped[1:] if line.split("\t")[1] != "derived"]
    assert [row[0] for row in listed] == full
    assert {row[1] for row in listed} == {"default", "full"}
    # and one line per derived family, as in the terminal's table: a script can discover rerun/<setting>
    derived = [line.split("\t")[0] for line in piped[1:] if line.split("\t")[1] == "derived"]
    assert derived == [f"{p}/<setting>" for p in derived_prefixes()] and "rerun/<setting>" in derived
    assert [line.split("\t")[0] for line in lines("settings", "list", "--derived")] == derived


def test_progress_off_a_terminal_prints_plain_lines_with_counts_and_an_eta() -> None:
    import io

    from rich.console import Console

    from difftest.reporting.progress import SweepProgress, family_of

    stream = io.StringIO()
    names = ["reference"] * 5 + ["torchrec/ebc/row_wise/ws2"] * 20
    with SweepProgress(Console(file=stream, width=200), every=10) as progress:
        progress.planned(names, refused=5)
        for name in names:
            progress.result(name, "unsupported" if name == "reference" else "ok")
    lines = stream.getvalue().splitlines()
    assert "\x1b" not in stream.getvalue()
    assert lines[0] == "sweep: 25 cases to run (2 families)"
    assert lines[1].startswith("sweep 10/25 (40%) ok=5 unsupported=5 elapsed") and " eta " in lines[1]
    assert lines[-1].startswith("sweep 25/25 (100%) ok=20 unsupported=5")
    assert len(lines) == 4
    assert family_of("rerun/ddp/default/ws2") == "rerun/ddp" and family_of("quant/dynamic/qint8/x86") == "quant"


def test_unreadable_tensor_file_is_a_user_error(tmp_path: Path) -> None:
    bad = tmp_path / "init.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="init.safetensors"):
        load_arrays(bad)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["sweep", "/nonexistent/run"], "no run.json"),
        (["analyze", "/nonexistent/run"], "no run.json"),
        (["run", "--out", "{tmp}", "--settings", "nothing/*"], "matches no registered setting"),
        (["generate", "--out", "{tmp}", "--batch-size", "13"], "multiple of 12"),
        (["generate", "--out", "{tmp}", "--kind", "bogus"], "unknown model kind"),
        (["run", "--out", "{tmp}", "--tier", "huge"], "unknown tier"),
        (["run", "--out", "{tmp}", "--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["run", "--out", "{tmp}", "--backend", "mpi"], "use gloo or nccl"),
        (["run", "--out", "{tmp}", "--device", "cuda"], "sees no CUDA device"),
        (["run", "--out", "{tmp}", "--jobs", "4096"], "ranks at once (one per core, 1 more"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device: --device cuda is no error here")
    args = [a.replace("{tmp}", str(tmp_path / "run")) for a in args]
    result = subprocess.run([sys.executable, "-m", "difftest.cli", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "━" not in line]
    assert lines[-1].startswith("difftest: error:") and needle in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "models").exists()  # nothing generated before the error
    if args[0] == "run":
        assert not (tmp_path / "run").exists()  # rejected before anything was generated


def test_without_the_tf_extra_the_keras_kind_is_refused_with_the_install_hint(tmp_path: Path) -> None:
    # a site hook that hides tensorflow from importlib, as on a machine installed without `[tf]`
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util as u\n_find = u.find_spec\n"
        "u.find_spec = lambda name, *a, **k: None if name.split('.')[0] == 'tensorflow' else _find(name, *a, **k)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "difftest.cli", "generate", "--kind", "sequential", "--out", str(tmp_path / "r")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[tf]'" in lines[0], result.stderr
    listing = subprocess.run([sys.executable, "-m", "difftest.cli", "settings", "list"], capture_output=True,
                             text=True, timeout=120, env={**env, "COLUMNS": "400"})
    assert listing.returncode == 0 and "[tf]" in listing.stdout


@pytest.mark.parametrize("active", [None, "other-venv"])
def test_install_sh_installs_into_dot_venv_whatever_virtualenv_is_active(tmp_path: Path, active: str | None) -> None:
    import os

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    if active:
        env["VIRTUAL_ENV"] = str(tmp_path / active)
    result = subprocess.run(["bash", str(root / "install.sh")], env={**env, "DIFFTEST_INSTALL_PLAN": "1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == str(root / ".venv" / "bin" / "python")  # where the README's commands look
    assert ("not the active virtualenv" in result.stderr) == bool(active)


def test_help_lists_the_model_kinds() -> None:
    from difftest.cli.main import BUILTIN_KINDS
    from difftest.contracts.registry import generator_kinds, get_generator, traits_of

    load_plugins()  # other tests of this process may have loaded plugins of their own: compare the built-in ones
    builtin = {k for k in generator_kinds() if type(get_generator(k)).__module__.startswith("generators.")}
    zoo = {k for k in builtin if "zoo" in traits_of(k)}
    assert set(BUILTIN_KINDS) == builtin - zoo
    for command in ("generate", "run"):
        result = subprocess.run([sys.executable, "-m", "difftest.cli", command, "--help"], capture_output=True,
                                text=True, timeout=60, env={**__import__("os").environ, "COLUMNS": "200"})
        assert all(kind in result.stdout for kind in BUILTIN_KINDS), result.stdout
        assert "hf-llama" in result.stdout and "[zoo] extra" in result.stdout


@pytest.mark.parametrize(("models", "models_of", "kind", "expected"), [
    (6, None, "transformer", (6, "", None)),  # one kind: --models is its count
    (None, None, "transformer", (2, "", None)),
    (None, None, "all", (2, "torchrec-dlrm=1,transformer=1", None)),  # the default job
    (6, "transformer=1", "transformer", (6, "transformer=1", "--models-of transformer=1 wins over --models 6 for kind transformer")),
    (3, "", "all", (3, "", None)),
])
def test_run_says_how_many_models_of_which_kind(models, models_of, kind, expected) -> None:
    from difftest.cli.main import model_counts

    assert model_counts(models, models_of, kind, "torchrec-dlrm=1,transformer=1") == expected


def test_run_with_models_and_every_kind_says_which_option_wins() -> None:
    from difftest.cli.main import model_counts

    count, models_of, line = model_counts(6, None, "all", "torchrec-dlrm=1,transformer=1")
    assert (count, models_of) == (6, "torchrec-dlrm=1,transformer=1")
    assert "torchrec-dlrm 1, transformer 1" in line and "--models-of ''" in line and "\n" not in line


def test_failure_messages_keep_paths_readable_and_still_group() -> None:
    from difftest.findings.signature import normalise_message

    a = normalise_message("Fail: Load model from results/default/models/keras-dag-s0-i1/model.onnx failed:Invalid graph")
    b = normalise_message("Fail: Load model from /tmp/x/run/models/keras-dag-s3-i0-min/model.onnx failed:Invalid graph")
    assert a == b == "Fail: Load model from <run>/models/<model>/model.onnx failed:Invalid graph"
    assert normalise_message("no kernel in quant/torchrec/fp16/out-fp16") == "no kernel in quant/torchrec/fp16/out-fp16"
    assert normalise_message("see torch/distributed/pipelining/stage.py") == "see stage.py"


def test_the_report_folds_calibration_runs_and_puts_failing_settings_first() -> None:
    import pandas as pd

    from difftest.reporting.report import heatmap_rows

    load_plugins()
    cases = pd.DataFrame([("m0", "reference", "ok"), ("m0", "calib-float64/reference", "ok"),
                          ("m0", "ddp/default/ws2", "ok"), ("m0", "torchrec/ebc/grid_shard/ws2", "inconsistent"),
                          ("m1", "torchrec/ebc/grid_shard/ws2", "inconsistent"), ("m0", "fsdp1/full_shard/ws2", "error"),
                          ("m0", "calib-fp32-a/reference", "unsupported")], columns=["model", "setting", "verdict"])
    claims, calibrations = heatmap_rows(cases)
    assert claims == ["torchrec/ebc/grid_shard/ws2", "fsdp1/full_shard/ws2", "ddp/default/ws2", "reference"]
    assert calibrations == ["calib-float64/reference", "calib-fp32-a/reference"]


def test_tables_off_a_terminal_keep_full_kind_names(tmp_path: Path) -> None:
    script = ("from rich.table import Table; from difftest.cli.main import out_console; t = Table(); "
              "[t.add_column(c) for c in ('kind', *(f'column{i}' for i in range(12)))]; "
              "t.add_row('keras-transformer', *('123456' for _ in range(12))); out_console.print(t)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "keras-transformer" in result.stdout and "…" not in result.stdout


def test_the_report_template_escapes_what_a_run_wrote() -> None:
    """A message, a setting or a run folder's name is text on the page, never markup."""
    from difftest.reporting.render import render

    hostile = "<script>alert(1)</script>"
    page = render("report.html.j2", run_name=hostile, run_dir=hostile, written="now", stack=hostile, style="",
                  sweep_running=False, calibrated=0, total=1, counts=[(hostile, 1, 1)], findings=[], not_ok=0,
                  figures=[(hostile, True, hostile)], command=hostile, python=hostile)
    assert hostile not in page and page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 8


def test_minimisation_charges_each_finding_its_cases_its_share_of_references_and_builds_and_moves_to_the_smallest_win() -> None:
    from difftest.findings.minimise import ALONE, Minimisation, Trial, charges, resign

    example = DlrmGenerator().spec(0, 0)
    smaller = [params for _, params in DlrmGenerator().reductions(example)]

    def trial(variant: str, params: dict, change: str) -> Trial:
        return Trial(dataclasses.replace(example, params=params, variant=variant), "ddp/default/ws2", 24, change)

    alone, two, one = trial("m1", example.params, ALONE), trial("m2", smaller[0], "a"), trial("m3", smaller[1], "b")
    planned = {"F1": [alone, two, one], "F2": [two]}
    # F2 shares model m2 with F1: m2's reference run (a case nobody planned) is split between the two
    cost = {(t.model_id, t.setting): 1.0 for t in (alone, two, one)} | {(two.model_id, "reference"): 4.0}
    # building m2 (3 s) is split the same way; m3's (1 s) is F1's alone
    charged = charges(planned, cost, {alone.model_id: 0.0, two.model_id: 3.0, one.model_id: 1.0})
    assert charged == {"F1": 3.0 + 2.0 + 1.5 + 1.0, "F2": 1.0 + 2.0 + 1.5}

    m = Minimisation("F1", "sig", alone, alone, budget_s=100.0)
    signed = {(alone.model_id, "ddp/default/ws2"): "sig", (two.model_id, "ddp/default/ws2"): "sig", (one.model_id, "ddp/default/ws2"): "other"}
    resign(m, 1, planned["F1"], signed, charged["F1"])
    assert (m.best, m.changes, m.tries, m.seconds, m.active) == (two, ["a"], 3, 7.5, True)

    lost = Minimisation("F2", "sig", alone, alone, budget_s=100.0)
    resign(lost, 1, [dataclasses.replace(alone, change=ALONE)], {}, 1.0)
    assert not lost.active and lost.outcome == "not minimised: the example alone does not reproduce (ok)"

    spent = Minimisation("F3", "sig", two, two, budget_s=5.0, pending=[one])
    resign(spent, 2, [one], {(one.model_id, "ddp/default/ws2"): "other"}, 6.0)
    assert not spent.active and spent.outcome.startswith("budget of 5 s spent after 1 rounds")


def test_trials_are_calibrated_where_d3_alone_would_sign_the_example_otherwise() -> None:
    """An inconsistent finding's trials get the calibrated envelope where its example needed it: D3 passes the example,
    or D3's first diverging tensor is an earlier one than the calibrated oracle's (seed 5's split-backward finding: a
    Keras dense kernel within its wide envelope but beyond allclose, so the example alone, judged by D3, first diverged
    there and 'did not reproduce')."""
    from types import SimpleNamespace

    import pandas as pd

    from difftest.contracts.status import Status
    from difftest.findings.minimise import needing_envelope
    from difftest.judging.analysis import Analysis

    def row(model: str, phase: str, tensor: str, status: str, d3: str) -> dict:
        return {"model": model, "setting": "s", "kind": "dlrm", "phase": phase, "tensor": tensor, "status": status,
                "d3_status": d3}

    bad, good = Status.INCONSISTENT, Status.OK
    comparisons = pd.DataFrame([
        row("calibrated-only", "eval_before", "pooled.f0", bad, good),  # D3 passes it
        row("both-same", "eval_before", "pooled.f0", bad, bad), row("both-same", "param_after_step1", "over.0.weight", bad, bad),
        row("d3-earlier", "eval_before", "pooled.f0", good, bad), row("d3-earlier", "param_after_step1", "over.0.weight", bad, bad),
        row("failed", "", "", Status.ERROR, Status.ERROR)])
    cases = pd.DataFrame([{"model": m, "setting": "s", "d3_verdict": v} for m, v in
                          (("calibrated-only", good), ("both-same", bad), ("d3-earlier", bad), ("failed", Status.ERROR))])
    analysis = Analysis(comparisons, cases, pd.DataFrame(), pd.DataFrame(), pd.DataFrame())
    findings = [SimpleNamespace(id=m, status=Status.ERROR if m == "failed" else bad, example={"model": m, "setting": "s"})
                for m in cases["model"]]
    assert needing_envelope(analysis, findings) == {"calibrated-only", "d3-earlier"}


def test_judging_a_case_is_a_pure_function_of_its_outputs_its_references_and_its_envelope() -> None:
    from difftest.judging.analysis import judge_outputs

    expected = {"eval_before/prediction": np.ones(4, np.float32)}
    same = judge_outputs(dict(expected), expected, None, "no calibration", None, Tolerance(), {"model": "m"})
    assert (same.verdict, same.d3_verdict, same.calibrated, same.why_uncalibrated, same.worst_linf) == (
        "ok", "ok", False, "no calibration", 0.0)
    off = {"eval_before/prediction": np.array([1, 1, 1, 1.5], np.float32)}
    wrong = judge_outputs(off, expected, None, "no calibration", None, Tolerance(), {"model": "m"})
    assert (wrong.verdict, wrong.worst_linf) == ("inconsistent", 0.5)
    assert wrong.rows[0]["model"] == "m" and wrong.rows[0]["tensor"] == "prediction" and wrong.rows[0]["mismatches"] == 1


def test_every_commands_options_default_to_the_options_objects_they_fill() -> None:
    """One default per option: a command's option that an options object also has defaults to that object's value."""
    import typer

    from difftest.cli import app
    from difftest.contracts.spec import RunConfig
    from difftest.pipeline import PipelineOptions
    from difftest.runner.executor import ExecutorConfig, SweepOptions

    pipeline, sweep, executor, run = PipelineOptions(), SweepOptions(), ExecutorConfig(), RunConfig()
    expected = {
        "timeout": sweep.timeout_s, "device": sweep.device, "backend": sweep.backend, "jobs": sweep.jobs,
        "tier": sweep.tier, "settings": sweep.settings, "twice": sweep.twice,
        "atol": pipeline.tolerance.atol, "rtol": pipeline.tolerance.rtol, "oracle": pipeline.oracle,
        "minimise_budget": pipeline.minimise_budget_s, "shrink_budget": pipeline.shrink_budget_s,
        "executor": executor.kind, "address": executor.address, "cpus_per_rank": executor.cpus_per_rank,
        "steps": run.steps, "lr": run.lr, "batch_size": run.batch_size,
    }
    assert pipeline.timeout_s == sweep.timeout_s and pipeline.device == sweep.device
    # an option of the same name that means something else: bisect's timeout is a whole reproducer's on one release
    from difftest.releases.bisect import REPRODUCER_TIMEOUT_S

    own = {("bisect", "timeout"): REPRODUCER_TIMEOUT_S}
    checked = 0
    for name, command in typer.main.get_command(app).commands.items():
        for sub in getattr(command, "commands", {name: command}).values():
            for param in sub.params:
                if param.name in expected and param.param_type_name == "option":
                    # None: the run folder's own value, which the command says (generate on an existing run)
                    keeps_the_runs = param.default is None and "the run's own" in (param.help or "")
                    wanted = own.get((name, param.name), expected[param.name])
                    assert param.default == wanted or keeps_the_runs, (name, param.name, param.default)
                    checked += 1
    assert checked >= 40


def test_every_command_that_minimises_findings_also_shrinks_their_scripts() -> None:
    """Both budgets shape a finding: a command taking --minimise-budget takes --shrink-budget too."""
    import typer

    from difftest.cli import app

    minimising = {}
    for name, command in typer.main.get_command(app).commands.items():
        for sub_name, sub in getattr(command, "commands", {name: command}).items():
            options = {param.name for param in sub.params}
            if "minimise_budget" in options:
                minimising[sub_name] = "shrink_budget" in options
    assert {"run", "sweep", "quant", "analyze", "campaign"} <= set(minimising)
    assert all(minimising.values()), [name for name, shrinks in minimising.items() if not shrinks]


def test_a_run_resumes_after_difftest_adds_a_kind_it_makes_no_model_of_and_refuses_other_options(tmp_path: Path) -> None:
    """The default job names every kind, the zoos' with 0 models: a kind a later release adds (0 models) must not
    stop `difftest run` resuming the run an earlier one made; a kind with models, or another count, still does."""
    from difftest.contracts.errors import UserError
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import prepare_run

    before = RunConfig(kinds=("dlrm", "hf-llama"), models_of={"hf-llama": 0})
    prepare_run(tmp_path, before)
    added = RunConfig(kinds=("dlrm", "hf-llama", "hf-qwen3"), models_of={"hf-llama": 0, "hf-qwen3": 0})
    assert prepare_run(tmp_path, added) == before
    for other in (RunConfig(kinds=("dlrm", "hf-llama", "hf-qwen3"), models_of={"hf-llama": 0, "hf-qwen3": 1}),
                  RunConfig(kinds=("dlrm", "hf-llama"), models_of={"hf-llama": 1}), RunConfig(kinds=("dlrm",), models=3)):
        with pytest.raises(UserError, match="holds a run made with other options"):
            prepare_run(tmp_path, other)


def test_a_root_whose_kernels_refuse_float64_has_its_float64_calibration_unsupported_not_an_error(tmp_path: Path) -> None:
    """The float64 calibration runs a root's own code on a float64 model: where a kernel has no float64 version
    (transformers' experts call torch._grouped_mm) the noise cannot be measured, which is `unsupported` with torch's
    words, never an error finding; any other failure of the root stays the root's."""
    from difftest.contracts.errors import Unsupported
    from difftest.contracts.setting import RunContext, Setting
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.storage.artifacts import load_model
    from settings.calibration import Calibration

    @dataclasses.dataclass(frozen=True)
    class Refusing(Setting):
        message: str
        world_size: int = 1
        family = "refusing"

        @property
        def name(self) -> str:
            return "refusing"

        def run(self, ctx, model, inputs):  # type: ignore[no-untyped-def]
            raise RuntimeError(self.message)

    generate(tmp_path, RunConfig(seed=0, models=1, kinds=("transformer",)))
    model, inputs = load_model(next((tmp_path / "models").iterdir()))
    ctx = RunContext(0, 1, 1, "cpu", "gloo", None, 1, 0.1, 0)
    refused = "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"
    with pytest.raises(Unsupported, match="cannot run in float64 on this model: Expected mat_a"):
        Calibration(Refusing(refused), "float64").run(ctx, model, inputs)
    with pytest.raises(RuntimeError, match="got Double"):  # the root's own failure in fp32: the root's, not ours
        Calibration(Refusing(refused), "threads").run(ctx, model, inputs)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        Calibration(Refusing("mat1 and mat2 shapes cannot be multiplied"), "float64").run(ctx, model, inputs)


def test_a_finding_whose_example_has_no_emitter_tries_its_cases_of_other_kinds_then_of_other_families() -> None:
    """A finding's example under a family without an emitter (the BatchNorm-per-share finding's `accumulate` case on
    timm-resnet) gets a script from another of its cases: another kind's first, then another family's on its kind."""
    import types

    import pandas as pd

    from difftest.scripts.write import _other_cases

    rows = pd.DataFrame([
        {"model": "r0", "kind": "timm-resnet", "setting": "accumulate/mb4", "status": "inconsistent"},
        {"model": "r0", "kind": "timm-resnet", "setting": "accumulate/mb2", "status": "inconsistent"},
        {"model": "r0", "kind": "timm-resnet", "setting": "ddp/default/ws2", "status": "inconsistent"},
        {"model": "r0", "kind": "timm-resnet", "setting": "ddp/default/ws3", "status": "inconsistent"},
        {"model": "r0", "kind": "timm-resnet", "setting": "fsdp2/per-layer/reshard/fp32/ws2", "status": "error"},
        {"model": "v0", "kind": "timm-vit", "setting": "ddp/default/ws2", "status": "inconsistent"},
    ])
    finding = types.SimpleNamespace(rows=rows, status="inconsistent",
                                    example={"kind": "timm-resnet", "setting": "accumulate/mb4"})
    picked = [(row.kind, row.setting) for row in _other_cases(finding, 4)]
    assert picked == [("timm-vit", "ddp/default/ws2"), ("timm-resnet", "ddp/default/ws2")]
    assert len(_other_cases(finding, 1)) == 1


def test_tables_given_two_optimizers_get_each_its_own_and_touched_rows_alone_move() -> None:
    """The fused-optimizer family's reference: the second optimizer trains the tables the case names it (with the one
    options dict), even when a frozen model leaves the first none; a sparse step moves only the rows that had a
    gradient, and a state the step creates stays zero elsewhere."""
    import torch

    from settings._torchrec_optim_script import step_touched_rows, unfused_table_optimizers

    weight = torch.nn.Parameter(torch.ones(3, 2))
    case = {"optimizer": ("torch.optim", "SGD"), "options": {"weight_decay": 0.5}, "lr": 0.1,
            "second": ("torch.optim", "Adagrad"), "second_tables": ["t1"]}
    (only,) = unfused_table_optimizers({"t1": weight}, case)
    assert type(only).__name__ == "Adagrad"
    (sgd,) = unfused_table_optimizers({"t0": weight}, {**case, "options": {"weight_decay": 0.5, "momentum": 0.9}})
    weight.grad = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    step_touched_rows(sgd)
    assert torch.equal(weight.data[1], torch.ones(2))  # untouched: no weight decay, no momentum buffer
    assert (weight.data[[0, 2]] != 1).all()
    assert torch.equal(sgd.state[weight]["momentum_buffer"][1], torch.zeros(2))
