"""The parallelism families of issue 5 on real gloo groups: clean settings agree with their references,
one planted fault per family (pipeline, hybrid, FSDP1, TP, FSDP2) is reported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.judging.analysis import analyze
from difftest.runner.sweep import SweepOptions, run_sweep
from generators.conversion import layer_cuts
from settings.pipeline import balanced_split, random_split
from tests.conftest import PLANTED, REFERENCE_CALIBRATIONS

CLEAN = [
    "reference", "accumulate/mb2", "accumulate/mb4",
    "fsdp2/per-layer/no-reshard/fp32/ws2", "fsdp2/whole-model/reshard/fp32/ws3",
    "fsdp2/per-layer/reshard/bf16/ws2", "fsdp1/full_shard/ws2",
    "tp/colwise-rowwise/ws2",
    "pipeline/gpipe/ws2/stages2/mb2/balanced", "pipeline/1f1b/ws2/stages2/mb4/random",
    "pipeline/interleaved-1f1b/ws2/stages4/mb2/balanced",
    "hybrid/1f1b/dp2xddp/pp2/stages2/mb2/balanced",
]
FAULTS = ["faults/pipeline_unscaled_stage/ws2/mb2", "faults/hybrid_replica_sums/dp2xddp/mb2",
          "faults/fsdp1_skip_predivide/full_shard/ws2", "faults/tp_wrong_dim/ws2", "faults/fsdp_skip_reduce_scatter/ws2"]


# the slowest clean case takes 6.5 s here; the FSDP2 fault that skips a reduce-scatter hangs until this timeout
CASE_TIMEOUT_S = 20


def test_parallel_families_agree_and_planted_faults_are_reported(fresh_run: Path) -> None:
    run_sweep(fresh_run, SweepOptions(settings=",".join(CLEAN + FAULTS), plugins=(PLANTED,), timeout_s=CASE_TIMEOUT_S))
    cases = analyze(fresh_run, plugins=(PLANTED,)).cases
    verdict = {(c.model, c.setting): c.verdict for c in cases.itertuples()}
    models = sorted({m for m, _ in verdict})
    assert len(models) == 2
    for model in models:
        for setting in CLEAN:
            assert verdict[(model, setting)] == "ok", (model, setting)
        for setting in FAULTS:
            assert verdict[(model, setting)] in {"inconsistent", "error", "timeout"}, (model, setting)
    # these train wrong without failing: they are caught by comparison, not by an exception
    for fault in FAULTS[:3]:
        assert {verdict[(m, fault)] for m in models} == {"inconsistent"}, fault


def test_partitioners() -> None:
    assert balanced_split([10, 1, 1, 10], 2) == [0, 2]
    assert balanced_split([1, 1, 1, 1, 8], 3) in ([0, 3, 4], [0, 2, 4], [0, 1, 4])
    starts = random_split(7, 4, seed=3)
    assert starts[0] == 0 and len(set(starts)) == 4 and starts == sorted(starts) and starts == random_split(7, 4, 3)


def test_layer_cuts_split_a_graph_between_layers() -> None:
    import onnx
    from onnx import TensorProto, helper

    def dense(i: int, x: str) -> list:
        return [helper.make_node("MatMul", [x, f"w{i}"], [f"seq/l{i}_dense/MatMul:0"], name=f"seq/l{i}_dense/MatMul"),
                helper.make_node("Add", [f"seq/l{i}_dense/MatMul:0", f"b{i}"], [f"seq/l{i}_dense/Add:0"],
                                 name=f"seq/l{i}_dense/Add")]

    inits = [onnx.numpy_helper.from_array(__import__("numpy").ones(s, "float32"), n)
             for n, s in (("w0", (3, 3)), ("b0", (3,)), ("w1", (3, 2)), ("b1", (2,)))]
    graph = helper.make_graph(dense(0, "x") + dense(1, "seq/l0_dense/Add:0"), "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
                              [helper.make_tensor_value_info("seq/l1_dense/Add:0", TensorProto.FLOAT, [None, 2])], inits)
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph))
    assert layer_cuts(proto) == ["seq/l0_dense/Add:0"]  # not the MatMul inside a layer


@pytest.mark.needs_tf
def test_sequence_parallel_shards_positions_where_a_converted_dense_pair_runs_over_a_sequence(tmp_path: Path) -> None:
    """Keras (seed 0, index 89): Conv1D → Dense → Dense over a sequence, which tf2onnx lowers to a Linear over
    (batch·seq, feature) rows; none of the default models has such a pair."""
    from difftest.contracts.registry import get_generator, load_plugins
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import prepare_run
    from difftest.storage.artifacts import save_model
    from difftest.storage.store import Store

    load_plugins()
    run_dir = tmp_path / "run"
    prepare_run(run_dir, RunConfig(seed=0, models=90, kinds=("sequential",)))
    generator = get_generator("sequential")
    spec = generator.spec(0, 89)
    state = generator.init_state(spec)
    save_model(run_dir / "models" / spec.model_id, spec, state, generator.inputs(spec, 24),
               generator.artifacts(spec, state))

    report = run_sweep(run_dir, SweepOptions(settings="tp/sequence-parallel/ws2,tp/sequence-parallel/ws4",
                                             timeout_s=120))
    assert report.statuses == {"ok": 3 + REFERENCE_CALIBRATIONS}
    cases = analyze(run_dir).cases
    assert set(cases.verdict) == {"ok"} and len(cases) == 3 + REFERENCE_CALIBRATIONS
    store = Store(run_dir)
    messages = {r.setting: r.message for r in store.records()}
    store.close()
    for world_size in (2, 4):
        assert "RowwiseParallel(output S(0))" in messages[f"tp/sequence-parallel/ws{world_size}"]


@pytest.mark.needs_tf
def test_fsdp2_inside_pipeline_stages_finishes_on_a_converted_keras_model(fresh_sequential_run: Path) -> None:
    """Keras s0-i0 hung all four ranks once: rank 0 alone read the canonical parameters after FSDP2 wrapped its
    stage, an all-gather its data-parallel peer never joined."""
    run_dir = fresh_sequential_run
    hybrid = ["hybrid/gpipe/dp2xfsdp2/pp2/stages2/mb2/balanced", "hybrid/1f1b/dp2xfsdp2/pp2/stages2/mb4/balanced"]
    report = run_sweep(run_dir, SweepOptions(settings=",".join(hybrid), models="*-i0", timeout_s=60))
    # the two hybrids, accumulate/mb4 and /mb8, and their reference with its calibration runs
    assert report.statuses == {"ok": 5 + REFERENCE_CALIBRATIONS}
    cases = analyze(run_dir).cases
    assert set(cases.verdict) == {"ok"} and set(hybrid) <= set(cases.setting)


def test_the_v_schedules_train_without_eval_and_ddp_replicas_under_split_backward_train_apart(tmp_path: Path) -> None:
    """ZBV trained without its eval() (which raises on these releases) is judged on its training alone and agrees on
    the native transformer, alone and with FSDP2 replicas of each stage; with DDP replicas the split backward never
    all-reduces the weight gradients (pytorch#144530), so the replicas train apart: inconsistent, and the manifest's."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings import known
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",)))
    alone = "pipeline/zbv-zero-bubble/ws2/stages4/mb2/balanced/train-only"
    hybrid = "hybrid/zbv-zero-bubble/dp2x{}/pp2/stages4/mb2/balanced/train-only"
    pairs = tuple(("transformer-s0-i0", s) for s in (alone, hybrid.format("fsdp2"), hybrid.format("ddp")))
    run_sweep(run_dir, SweepOptions(pairs=pairs, timeout_s=120))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"]
    assert verdicts[alone] == verdicts[hybrid.format("fsdp2")] == "ok", verdicts
    judged = analysis.comparisons[analysis.comparisons["setting"] == alone]
    assert judged["phase"].str.startswith("param_after_step").any()
    assert not judged["phase"].str.startswith("eval_").any()  # nothing evaluated, nothing missing
    if known.reproduces_here("pipelining-ddp-split-backward"):
        assert verdicts[hybrid.format("ddp")] == "inconsistent", verdicts
        found = next(f for f in triage(run_dir, analysis) if f.status == "inconsistent")
        assert found.known is not None and found.known.id == "pipelining-ddp-split-backward"


def test_activation_checkpointing_wraps_every_block_and_trains_as_the_reference(tmp_path: Path) -> None:
    """Checkpointed blocks (reentrant, non-reentrant, selective; alone, in DDP, in FSDP2, after a sequence-parallel
    plan) recompute the same operations: ok against the plain reference, under the plain model's parameter names,
    every block really wrapped."""
    from difftest.contracts.registry import get_generator
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer", "dlrm")))
    run_sweep(run_dir, SweepOptions(settings="ac/single/*,ac/ddp/reentrant/ws2,ac/fsdp2/selective/ws2,"
                                             "ac/tp-sp/selective/ws2"))
    cases = analyze(run_dir).cases.set_index(["model", "setting"])["verdict"]
    ac = cases[[s.startswith("ac/") for _, s in cases.index]]
    assert set(ac.xs("transformer-s0-i0").to_dict().values()) == {"ok"} and len(ac.xs("transformer-s0-i0")) == 6
    assert set(ac.xs("dlrm-s0-i0").to_dict().values()) == {"unsupported"}  # no blocks to checkpoint
    store = Store(run_dir)
    try:
        blocks = {r.setting: r.message for r in store.records() if r.model == "transformer-s0-i0"
                  and r.setting.startswith("ac/")}
    finally:
        store.close()
    kind = get_generator("transformer")
    spec = kind.spec(0, 0)
    layers = len(kind.blocks(kind.build(spec, kind.init_state(spec), "cpu", None)))
    assert all(f"checkpointed blocks: {layers}" in message for message in blocks.values()), blocks
    # its standalone script checkpoints and wraps as the setting does, and agrees too (exit 0), judged by the envelope
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.write import emit

    setting = "ac/fsdp2/selective/ws2"
    emitted = emit(run_dir, "A1", "an activation-checkpointing finding", "inconsistent",
                   run_dir / "models" / "transformer-s0-i0", setting, "param_after_step1/output.weight",
                   envelope_spread(run_dir, "transformer-s0-i0", setting), Tolerance(), check_timeout_s=180)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    text = emitted.path.read_text()
    assert "apply_activation_checkpointing" in text and "create_selective_checkpoint_contexts" in text
    assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
        emitted.checked.output[-3000:]


def test_checkpointed_pipeline_stages_train_as_one_process_and_selective_split_backward_is_a_known_bug(
        tmp_path: Path) -> None:
    """Every layer unit of each pipeline stage checkpointed: under 1F1B the stages train as one process does (judged
    by the envelope), every unit wrapped, and its script checkpoints as the setting does (exit 0); under the
    interleaved zero-bubble schedule selective checkpointing raises on the weight pass's second backward, triaged to
    the manifest's entry."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.write import emit
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",)))
    model, plain, selective = ("transformer-s0-i0", "ac/pipeline/1f1b/non-reentrant/ws2",
                               "ac/pipeline/interleaved-zero-bubble/selective/ws2")
    run_sweep(run_dir, SweepOptions(pairs=((model, plain), (model, selective))))
    analysis = analyze(run_dir)
    cases = analysis.cases.set_index(["model", "setting"])["verdict"]
    assert cases[(model, plain)] == "ok" and cases[(model, selective)] == "error"
    assert any(n.startswith("param_after_step1/") for n in envelope_spread(run_dir, model, plain))
    store = Store(run_dir)
    try:
        notes = {r.setting: r.message for r in store.records() if r.model == model}
    finally:
        store.close()
    starts = re.search(r"stage starts: \[0, (\d+)\]; checkpointed units: (\d+)", notes[plain])
    assert starts and starts[1] == starts[2] != "0", notes  # every unit of rank 0's stage wrapped
    found = next(f for f in triage(run_dir, analysis) if f.status == "error")
    assert found.known is not None and found.known.id == "pipelining-split-backward-selective-ac"
    emitted = emit(run_dir, "P1", "a checkpointed-pipeline finding", "inconsistent", run_dir / "models" / model, plain,
                   "param_after_step1/output.weight", envelope_spread(run_dir, model, plain), Tolerance(),
                   check_timeout_s=180)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
        emitted.checked.output[-3000:]
    # the failing one's script raises as the setting does: only if it checkpoints the stages itself
    failed = emit(run_dir, "P2", found.title, "error", run_dir / "models" / model, selective, "", {}, Tolerance(),
                  check_timeout_s=180, message=str(found.example["message"]))
    assert failed.checked is not None and failed.checked.reproduces, failed.checked


def test_a_block_applied_twice_trains_everywhere_but_under_split_backward_a_known_bug(tmp_path: Path) -> None:
    """A looped transformer (each block applied twice, weights shared across depth) trains as the reference under
    per-block FSDP2, a full-backward pipeline and non-reentrant checkpointing inside DDP; the zero-bubble schedule's
    split backward raises, triaged to the manifest's entry; reentrant checkpointing inside DDP is refused with DDP's
    words (by design), never an error row."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer-looped",)))
    model = "transformer-looped-s0-i0"
    agreeing = ("fsdp2/per-layer/reshard/fp32/ws2", "pipeline/1f1b/ws2/stages2/mb2/balanced", "ac/ddp/non-reentrant/ws2")
    split = "pipeline/interleaved-zero-bubble/ws2/stages4/mb2/balanced"
    run_sweep(run_dir, SweepOptions(pairs=tuple((model, s) for s in (*agreeing, split, "ac/ddp/reentrant/ws2"))))
    analysis = analyze(run_dir)
    cases = analysis.cases.set_index(["model", "setting"])["verdict"]
    assert {s: cases[(model, s)] for s in agreeing} == dict.fromkeys(agreeing, "ok")
    assert cases[(model, split)] == "error" and cases[(model, "ac/ddp/reentrant/ws2")] == "unsupported"
    store = Store(run_dir)
    try:
        refusal = next(r.message for r in store.records() if r.setting == "ac/ddp/reentrant/ws2")
    finally:
        store.close()
    assert "DDP does not support such use cases" in refusal, refusal
    found = [f for f in triage(run_dir, analysis) if f.status == "error"]
    assert [f.known.id if f.known else None for f in found] == ["pipelining-split-backward-reused-weights"], found


def test_gradient_clipping_clips_as_one_process_does_and_the_infinity_norm_on_an_empty_shard_is_a_known_bug(
        tmp_path: Path) -> None:
    """Clipping to a global norm under DDP, legacy FSDP and FSDP2 (norm 2) matches the single-process root, the norm
    each step found recorded and really above the maximum; FSDP2 with the infinity norm fails on the rank whose
    gradient shards are empty (a library bug the manifest knows), and its standalone script shows it without difftest."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.scripts.write import emit
    from difftest.storage.store import Store
    from settings.gradient_clipping import MAX_NORM

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1))
    run_sweep(run_dir, SweepOptions(settings="clip/ddp/*/ws2,clip/fsdp1/*/ws2,clip/fsdp2/*/ws2"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert all(verdicts[f"clip/{wrap}/norm2/ws2"] == "ok" for wrap in ("ddp", "fsdp1", "fsdp2")), verdicts
    assert verdicts["clip/ddp/norminf/ws2"] == verdicts["clip/fsdp1/norminf/ws2"] == "ok"
    assert verdicts["clip/fsdp2/norminf/ws2"] == "error"
    store = Store(run_dir)
    try:
        root = next(r for r in store.records() if r.setting == "clip/single/norm2/ws1")
        norm = float(store.load_outputs(root)["train_step1/grad_norm"][0])
    finally:
        store.close()
    assert norm > MAX_NORM  # the clipping really scaled the gradients
    assert {c for c in analysis.comparisons["tensor"] if c == "grad_norm"} == {"grad_norm"}  # and it was compared
    found = next(f for f in triage(run_dir, analysis) if f.status == "error")
    assert found.known is not None and found.known.id == "clip-grad-norm-inf-empty-shard"
    emitted = emit(run_dir, "C1", found.title, "error", run_dir / "models" / "dlrm-s0-i0", "clip/fsdp2/norminf/ws2", "",
                   {}, Tolerance(), check_timeout_s=180, message=str(found.example["message"]))
    assert emitted.checked is not None and emitted.checked.reproduces, emitted.checked
    assert "import difftest" not in emitted.path.read_text()  # type: ignore[union-attr]


@pytest.mark.needs_tf
def test_dense_optimizers_step_as_one_process_and_the_fused_kernels_bugs_are_the_manifests(
        fresh_sequential_run: Path) -> None:
    """AdamW (foreach) under tensor parallel and FSDP2 steps a converted Keras model as one process does, its moments
    compared too; the fused AdamW kernel under tensor parallel moves the column-wise weight by up to 2 x lr off (its
    DTensor gradient's local tensor is transposed: `fused-optimizer-cpu-grad-strides`), and the fused SGD kernel has
    no DTensor rule at all, nor Rprop's steps (foreach and single-tensor), which DDP runs; all are the manifest's, and
    the fused AdamW case's script shows it without difftest."""
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.write import emit

    run_dir = fresh_sequential_run
    run_sweep(run_dir, SweepOptions(settings="optim/adamw/tp/ws2,optim/adamw-fused/tp/ws2,optim/adamw/fsdp2/ws2,"
                                             "optim/sgd-fused/fsdp2/ws2,optim/rprop/fsdp2/ws2,optim/rprop-single/tp/ws2,"
                                             "optim/rprop/ddp/ws2", models="*-i1-frozen", timeout_s=60))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert verdicts["optim/adamw/tp/ws2"] == verdicts["optim/adamw/fsdp2/ws2"] == "ok", verdicts
    assert verdicts["optim/adamw-fused/tp/ws2"] == "inconsistent" and verdicts["optim/sgd-fused/fsdp2/ws2"] == "error"
    assert verdicts["optim/rprop/ddp/ws2"] == "ok", verdicts
    assert verdicts["optim/rprop/fsdp2/ws2"] == verdicts["optim/rprop-single/tp/ws2"] == "error", verdicts
    judged = analysis.comparisons[analysis.comparisons["setting"] == "optim/adamw/fsdp2/ws2"]
    assert {"exp_avg", "exp_avg_sq"} <= {t.rsplit(".", 1)[-1] for t in judged[judged["phase"] == "state_after_step1"]
                                         ["tensor"]}, judged[["phase", "tensor"]].to_string()  # the state is judged too
    found = {f.known.id: f for f in triage(run_dir, analysis) if f.known is not None}
    assert set(found) == {"fused-optimizer-cpu-grad-strides", "dtensor-fused-sgd-adagrad-no-strategy",
                          "dtensor-rprop-no-strategy"}, found
    wrong = found["fused-optimizer-cpu-grad-strides"]
    model = str(wrong.example["model"])
    emitted = emit(run_dir, "O1", wrong.title, "inconsistent", run_dir / "models" / model, "optim/adamw-fused/tp/ws2",
                   wrong.first_divergence, envelope_spread(run_dir, model, "optim/adamw-fused/tp/ws2", Tolerance()),
                   Tolerance(), check_timeout_s=180)
    assert emitted.checked is not None and emitted.checked.reproduces, emitted
    assert "fused" in emitted.path.read_text()  # type: ignore[union-attr]


def test_clipping_tensor_parallel_gradients_agrees_where_the_plan_covers_every_parameter(tmp_path: Path) -> None:
    """A transformer's own plan with sequence parallel puts every parameter in DTensor: clip_grad_norm_ under tensor
    parallel and under FSDP2 × tensor parallel then clips as one process does (the total norm compared too). Without
    sequence parallel its norms stay outside the plan, FSDP2 shards them on the data-parallel mesh alone, and
    clipping fails on the two meshes (a library bug the manifest knows); that case's script shows it alone."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.scripts.write import emit

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",)))
    run_sweep(run_dir, SweepOptions(settings="clip/tp-sp/norm2/ws2,clip/fsdp2-tp-sp/norm2/ws4,clip/fsdp2-tp/norm2/ws4"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert verdicts["clip/tp-sp/norm2/ws2"] == verdicts["clip/fsdp2-tp-sp/norm2/ws4"] == "ok", verdicts
    assert verdicts["clip/fsdp2-tp/norm2/ws4"] == "error", verdicts
    compared = analysis.comparisons[analysis.comparisons["setting"].isin(["clip/tp-sp/norm2/ws2",
                                                                          "clip/fsdp2-tp-sp/norm2/ws4"])]
    assert set(compared[compared["tensor"] == "grad_norm"]["setting"]) == {"clip/tp-sp/norm2/ws2",
                                                                           "clip/fsdp2-tp-sp/norm2/ws4"}
    found = next(f for f in triage(run_dir, analysis) if f.status == "error")
    assert found.known is not None and found.known.id == "clip-grad-norm-mixed-meshes"
    emitted = emit(run_dir, "C2", found.title, "error", run_dir / "models" / "transformer-s0-i0",
                   "clip/fsdp2-tp/norm2/ws4", "", {}, Tolerance(), check_timeout_s=180,
                   message=str(found.example["message"]))
    assert emitted.checked is not None and emitted.checked.reproduces, emitted.checked
    assert "clip_grad_norm_" in emitted.path.read_text()  # type: ignore[union-attr]


def test_a_pipeline_clipped_across_its_stages_as_torchtitan_does_clips_as_one_process(tmp_path: Path) -> None:
    """Each rank's stage norm reduced over the pipeline (torchtitan's way), then every stage scaled by it: under 1F1B
    and interleaved 1F1B, norms 2 and inf, and two 1F1B pipelines of FSDP2 stages side by side, the parameters and the
    total norm agree with one process clipping the whole batch's gradients; ranks clipping by their own stages' norm
    (planted) do not. A plain pipeline's script and the FSDP2 hybrid's agree alone, and the planted mistake's mirror
    in the hybrid's (no reduction over the pipeline) is caught."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.generation.generate import generate
    from difftest.judging.analysis import envelope_spread  # a clipped step moves a weight by lr × 0.01 at most: only
    from difftest.scripts.write import emit  # the calibrated envelope sees a wrong clipping, allclose cannot

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",), plugins=(PLANTED,)))
    clipped = ("clip/pipeline/1f1b/norm2/ws2", "clip/pipeline/interleaved-1f1b/norminf/ws2",
               "clip/hybrid/1f1b/dp2xfsdp2/pp2/norm2/ws4")
    run_sweep(run_dir, SweepOptions(settings=",".join((*clipped, "faults/stages_clip_alone/ws2"))))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert all(verdicts[setting] == "ok" for setting in clipped), verdicts
    assert verdicts["faults/stages_clip_alone/ws2"] == "inconsistent", verdicts
    norms = analysis.comparisons[analysis.comparisons["tensor"] == "grad_norm"]
    assert set(clipped) <= set(norms["setting"])
    for number, setting in enumerate(clipped[::2]):  # a plain pipeline's script and the FSDP2 hybrid's, the latter
        emitted = emit(run_dir, f"P{number}", "agrees", "inconsistent",  # kept for the planted mistake below
                       run_dir / "models" / "transformer-s0-i0", setting, "param_after_step1/tok_embeddings.weight",
                       envelope_spread(run_dir, "transformer-s0-i0", setting), Tolerance(), check_timeout_s=180)
        assert emitted.checked is not None and emitted.checked.exit_code == 0, (setting, emitted.checked)
    script = emitted.path.read_text()  # type: ignore[union-attr]
    planted = script.replace('clip_stages(modules.values(), layout["clipping"], groups["pp"])',
                             'clip_stages(modules.values(), layout["clipping"], None)')
    assert planted != script
    emitted.path.write_text(planted)  # type: ignore[union-attr]
    done = subprocess.run([sys.executable, str(emitted.path)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and "BUG PRESENT" in done.stdout, done.stdout + done.stderr[-2000:]


def test_accumulating_schedule_steps_with_the_default_scaling_divides_earlier_gradients_again(tmp_path: Path) -> None:
    """Two 1F1B schedule steps accumulated before each optimizer step, alone and in an FSDP2 hybrid: torchtitan's way
    (scale_grads off, the loss divided by micro-batches × steps) trains as one process does, so the harness's
    accumulation is sound; with the schedule's default scale_grads, where the manifest says torch still does it, the
    first step's gradients are divided by the micro-batch count twice (a library bug the manifest knows)."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings import known
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("transformer",)))
    default = "pipeline/1f1b/ws2/stages2/mb2/balanced/accumulate2"
    scaled = (f"{default}/loss-scaled", "hybrid/1f1b/dp2xfsdp2/pp2/stages2/mb2/balanced/accumulate2/loss-scaled")
    run_sweep(run_dir, SweepOptions(settings=",".join((default, *scaled))))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert all(verdicts[setting] == "ok" for setting in scaled), verdicts
    if known.reproduces_here("pipelining-scale-grads-accumulated-steps"):
        assert verdicts[default] == "inconsistent", verdicts
        found = [f for f in triage(run_dir, analysis) if f.status == "inconsistent"]
        assert [f.known.id if f.known else None for f in found] == ["pipelining-scale-grads-accumulated-steps"]


@pytest.mark.needs_tf
def test_a_model_run_in_dtensor_end_to_end_trains_as_one_process_and_an_empty_shard_fails_as_the_manifest_says(
        tmp_path: Path) -> None:
    """Every parameter a replicated DTensor and the inputs sharded (on the batch, or on the last dimension): two
    converted Keras models train as one process does on 2 and 3 ranks, their cross-entropy taken on the sharded
    outputs too, except where 3 ranks leave one rank an empty
    shard of a 2-channel image, whose pooling ATen refuses (a library bug the manifest knows); its standalone script
    shows it without difftest."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.scripts.write import emit

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=2, kinds=("sequential",)))
    plain = "dtensor/batch-sharded/ws*,dtensor/last-sharded/*,dtensor/*/sharded-loss/*"  # DTensor alone, no FSDP2
    run_sweep(run_dir, SweepOptions(settings=plain))
    analysis = analyze(run_dir)
    cases = analysis.cases[analysis.cases.setting.str.startswith("dtensor/")]
    verdicts = {(c.model, c.setting): c.verdict for c in cases.itertuples()}
    # the frozen model's 2-channel image sharded on its channels: over 3 and over 4 ranks one rank holds none
    failing = ("sequential-s0-i1-frozen", "dtensor/last-sharded/ws3")
    also = ("sequential-s0-i1-frozen", "dtensor/last-sharded/ws4")
    # 8 settings: 2 and 3 ranks on either dimension, 4 ranks (empty shards), the loss on DTensors over 2 and 3 ranks
    assert len(verdicts) == 16 and verdicts.pop(failing) == verdicts.pop(also) == "error", verdicts
    assert set(verdicts.values()) == {"ok"}, verdicts
    assert (analysis.comparisons[analysis.comparisons.setting.str.startswith("dtensor/")].status == "ok").sum() > 20
    found = next(f for f in triage(run_dir, analysis) if f.status == "error")
    assert found.known is not None and found.known.id == "dtensor-empty-shard-max-pool", found
    emitted = emit(run_dir, "D1", found.title, "error", run_dir / "models" / failing[0], failing[1], "", {},
                   Tolerance(), check_timeout_s=180, message=str(found.example["message"]))
    assert emitted.checked is not None and emitted.checked.reproduces, emitted.checked


@pytest.mark.needs_tf
def test_fsdp2_over_the_dtensors_own_mesh_halves_a_batch_sharded_gradient_as_the_manifest_says(tmp_path: Path) -> None:
    """The same whole-model DTensor program handed to FSDP2 on its own mesh (`fully_shard(dp_mesh_dims=...)`, and
    `replicate_with_fsdp.replicate`), each case in new processes: the converted Keras model's parameters after a step
    differ from one process's, a library bug the manifest knows, and the finding's script shows it without difftest."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.write import emit

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("sequential",)))
    wrapped = ("dtensor/batch-sharded/fully-shard/ws2", "dtensor/batch-sharded/replicate/ws2")
    run_sweep(run_dir, SweepOptions(settings=",".join(wrapped), tier="full"))
    analysis = analyze(run_dir)
    verdicts = {c.setting: c.verdict for c in analysis.cases.itertuples() if c.setting in wrapped}
    assert verdicts == dict.fromkeys(wrapped, "inconsistent"), verdicts
    findings = triage(run_dir, analysis)
    assert [f.known.id if f.known else f.title for f in findings] == ["fsdp2-dp-mesh-dims-partial-grad-averaged"]
    assert findings[0].first_divergence.startswith("param_after_step"), findings[0].first_divergence
    model, setting = findings[0].example["model"], findings[0].example["setting"]
    emitted = emit(run_dir, "D1", findings[0].title, "inconsistent", run_dir / "models" / model, setting,
                   findings[0].first_divergence, envelope_spread(run_dir, model, setting, Tolerance()), Tolerance(),
                   check_timeout_s=180)
    assert emitted.checked is not None and emitted.checked.reproduces, emitted.checked
    assert f"WORLD_SIZE = {setting[-1]}" in emitted.path.read_text()  # the ranks the new processes were, not the sweep's one


@pytest.mark.heavy
def test_compiled_training_and_compiled_autograd_match_eager_and_the_shape_tensor_crash_is_a_known_dynamo_bug(
        tmp_path: Path) -> None:
    """torch.compile'd training of a native transformer, alone, under DDP (compiled whole) and FSDP2 (units compiled),
    and of a DLRM-like model after tensor parallelism, matches eager training, judged by the envelope, with the graphs
    it compiled noted; so does Compiled Autograd (each step's whole backward traced and compiled by Inductor), alone
    and under DDP with its Python reducer, its cases run in new processes, where a backward not captured would be an
    error, not an `ok`. A Keras model converted through onnx2pytorch fails in Dynamo on its shape tensor, triaged to
    the manifest's entry. One run: the transformer's reference and calibrations are paid once."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.judging.analysis import envelope_spread  # judged by the calibrated envelope, not allclose alone
    from difftest.scripts.write import emit
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    # seed 5: a one-layer transformer (seed 0's has three), whose graphs Inductor compiles in a third of the time
    generate(run_dir, RunConfig(seed=5, models=1, kinds=("transformer", "keras-transformer", "dlrm")))
    compiled = (("transformer-s5-i0", "compile/single/ws1"), ("transformer-s5-i0", "compile/ddp/ws2"),
                ("transformer-s5-i0", "compile/fsdp2/ws2"), ("dlrm-s5-i0", "compile/single/ws1"),
                ("dlrm-s5-i0", "compile/tp/ws2"))
    autograd = (("transformer-s5-i0", "compile/single/compiled-autograd/ws1"),
                ("transformer-s5-i0", "compile/ddp/compiled-autograd/ws2"))
    crashing = ("keras-transformer-s5-i0", "compile/single/ws1")
    run_sweep(run_dir, SweepOptions(pairs=(*compiled, *autograd, crashing), timeout_s=300))
    analysis = analyze(run_dir)
    cases = analysis.cases.set_index(["model", "setting"])
    for pair in (*compiled, *autograd):
        assert cases.loc[pair, "verdict"] == "ok", pair
    assert cases.loc[crashing, "verdict"] == "error"
    for pair in (compiled[1], autograd[1]):
        assert any(n.startswith("param_after_step1/") for n in envelope_spread(run_dir, *pair)), pair
    store = Store(run_dir)
    try:  # what the ranks (and the compiled-autograd cases' new processes) noted comes back to the case
        notes = {(r.model, r.setting): r.message for r in store.records()}
    finally:
        store.close()
    assert all("graphs compiled: " in notes[p] and "graphs compiled: 0" not in notes[p] for p in compiled), notes
    assert all(re.search(r"compiled autograd: [1-9]\d* backward graph\(s\) captured", notes[p]) for p in autograd), notes
    found = next(f for f in triage(run_dir, analysis) if f.status == "error")
    assert found.known is not None and found.known.id == "dynamo-size-from-shape-tensor"
    # the compiled-autograd standalone script compiles, steps under Compiled Autograd with DDP's Python reducer, and
    # agrees (exit 0)
    emitted = emit(run_dir, "CA1", "a compiled-autograd finding", "inconsistent", run_dir / "models" / autograd[1][0],
                   autograd[1][1], "param_after_step1/output.weight", envelope_spread(run_dir, *autograd[1]),
                   Tolerance(), check_timeout_s=240)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    text = emitted.path.read_text()
    assert "maybe_enable_compiled_autograd" in text and '"python_reducer"' in text
    assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
        emitted.checked.output[-3000:]


def test_torchrec_train_pipelines_train_as_the_plain_loop_a_batch_ahead(tmp_path: Path) -> None:
    """Two steps through TrainPipelineSparseDist (its sharded module's forward rewritten, the next batch's input
    distribution started during the current step) and TrainPipelineBase match the plain sharded loop on TorchRec's
    DLRM; a model torch.fx cannot trace is unsupported with the tracer's words, the prefetch pipeline on the CPU too."""
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("torchrec-dlrm", "dlrm"), steps=2))
    settings = ("torchrec-pipeline/sparse-dist/table_wise/ws2", "torchrec-pipeline/base/column_wise/ws2",
                "torchrec-pipeline/prefetch/table_wise/ws2")
    run_sweep(run_dir, SweepOptions(pairs=tuple((m, s) for m in ("torchrec-dlrm-s0-i0", "dlrm-s0-i0")
                                                for s in settings), timeout_s=180))
    verdicts = analyze(run_dir).cases.set_index(["model", "setting"])["verdict"]
    assert verdicts[("torchrec-dlrm-s0-i0", settings[0])] == verdicts[("torchrec-dlrm-s0-i0", settings[1])] == "ok"
    store = Store(run_dir)
    try:
        messages = {(r.model, r.setting): r.message for r in store.records()}
    finally:
        store.close()
    assert "pipelined modules: 1" in messages[("torchrec-dlrm-s0-i0", settings[0])]
    assert verdicts[("dlrm-s0-i0", settings[0])] == "unsupported"
    assert "does not trace" in messages[("dlrm-s0-i0", settings[0])]
    # its script: the whole model in the batch model, trained two steps by the pipeline on the ranks against the plain
    # loop in one process; it agrees (exit 0, the tables compared too), and a pipeline whose dense optimizer steps
    # twice as far disagrees (exit 1)
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.check import check_script
    from difftest.scripts.write import emit

    emitted = emit(run_dir, "P0", "a train-pipeline finding", "inconsistent", run_dir / "models" / "torchrec-dlrm-s0-i0",
                   settings[0], "param_after_step2/over_arch.model.0.weight",
                   envelope_spread(run_dir, "torchrec-dlrm-s0-i0", settings[0]), Tolerance(), check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert emitted.checked.exit_code == 0, emitted.checked.output[-3000:]
    text = emitted.path.read_text()
    assert "TrainPipelineSparseDist" in text and ".progress(" in text and "import difftest" not in text
    assert "param_after_step2/sparse_arch.embedding_bag_collection.embedding_bags." in text
    dense = 'torch.optim.SGD(dense, lr=case["lr"])'
    assert text.count(dense) == 1
    emitted.path.write_text(text.replace(dense, 'torch.optim.SGD(dense, lr=2 * case["lr"])'))
    planted = check_script(emitted.path, timeout_s=120)
    assert planted.exit_code == 1 and "BUG PRESENT" in planted.output, planted.output[-3000:]
    # a divergence at the first of the run's two steps: one step compared, the pipeline still given both batches (it
    # ran a batch ahead there)
    first = emit(run_dir, "P1", "a train-pipeline finding", "inconsistent", run_dir / "models" / "torchrec-dlrm-s0-i0",
                 settings[0], "param_after_step1/over_arch.model.0.weight",
                 envelope_spread(run_dir, "torchrec-dlrm-s0-i0", settings[0]), Tolerance(), check_timeout_s=120)
    assert first.path is not None and first.checked is not None, first.why_not
    assert first.checked.exit_code == 0, first.checked.output[-3000:]
    assert "'steps': 1" in first.path.read_text() and "'batches': 2" in first.path.read_text()
    assert verdicts[("dlrm-s0-i0", settings[1])] == "ok"  # the base pipeline traces nothing
    assert verdicts[("torchrec-dlrm-s0-i0", settings[2])] == "unsupported"
    assert "device stream" in messages[("torchrec-dlrm-s0-i0", settings[2])]


def test_fused_table_optimizers_train_and_keep_state_as_their_pytorch_class_does_but_row_wise_adagrad_on_column_shards(
        tmp_path: Path) -> None:
    """TorchRec's fused Adagrad matches torch.optim.Adagrad under every sharding, weights and accumulators alike, and
    fused row-wise Adagrad matches TorchRec's RowWiseAdagrad table-wise; on column shards it keeps one accumulator per
    shard and trains the table differently (a manifest entry); Adam, which fbgemm's CPU build lacks, is unsupported
    with TorchRec's words."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.storage.store import Store
    from settings.torchrec_optimizers import OPTIMIZERS, _state_name

    # TorchRec names a fused optimizer's first state `momentum1`; the rest keep fbgemm's (= torch's) names
    assert [_state_name(k, OPTIMIZERS["adam"]) for k in ("momentum1", "exp_avg_sq", "weights")] == \
        ["exp_avg", "exp_avg_sq", None]
    assert _state_name("momentum1", OPTIMIZERS["rowwise-adagrad"]) == "sum"
    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=2, kinds=("dlrm",)))  # the second has frozen parameters
    defaults = ("adagrad", "rowwise-adagrad", "adam")  # the options beyond eps: the next test
    run_sweep(run_dir, SweepOptions(settings=",".join(f"torchrec-optim/{o}/{s}" for o in defaults for s in
                                                      ("table_wise/ws2", "column_wise/ws4", "data_parallel/ws2"))))
    analysis = analyze(run_dir)
    both = analysis.cases.groupby("setting")["verdict"].agg(lambda v: sorted(set(map(str, v)))).to_dict()
    assert both["torchrec-optim/adagrad/data_parallel/ws2"] == both["torchrec-optim/adagrad/table_wise/ws2"] == ["ok"]
    assert both["torchrec-optim/rowwise-adagrad/data_parallel/ws2"] == ["ok"], both
    first = analysis.cases[analysis.cases["model"] == "dlrm-s0-i0"]
    verdicts = first.set_index("setting")["verdict"].to_dict()
    assert verdicts["torchrec-optim/adagrad/table_wise/ws2"] == verdicts["torchrec-optim/adagrad/column_wise/ws4"] == "ok"
    assert verdicts["torchrec-optim/rowwise-adagrad/table_wise/ws2"] == "ok", verdicts
    assert verdicts["torchrec-optim/rowwise-adagrad/column_wise/ws4"] == "inconsistent", verdicts
    assert verdicts["torchrec-optim/adam/table_wise/ws2"] == "unsupported"
    store = Store(run_dir)
    try:  # the accumulators were recorded and compared, not only the weights
        adam = next(r for r in store.records() if r.setting == "torchrec-optim/adam/table_wise/ws2")
        assert "Optimizer adam is not supported in CPU mode" in adam.message
        ok = next(r for r in store.records() if r.setting == "torchrec-optim/adagrad/column_wise/ws4")
        state = {n: v for n, v in store.load_outputs(ok).items() if n.startswith("state_after_step1/")}
    finally:
        store.close()
    assert state and all(n.endswith(".sum") and v.any() for n, v in state.items()), state
    compared = analysis.comparisons[analysis.comparisons["setting"] == "torchrec-optim/adagrad/column_wise/ws4"]
    assert set(state) <= {f"{p}/{t}" for p, t in zip(compared["phase"], compared["tensor"])}
    found = [f for f in triage(run_dir, analysis) if f.status == "inconsistent" and f.known is not None]
    assert "torchrec-rowwise-adagrad-column-shards" in {f.known.id for f in found}  # type: ignore[union-attr]
    # the finding's standalone script (the tables alone, one fused step, no difftest importable) shows the column
    # shards' training differ and the table-wise one agree, as the sweep did
    from difftest.contracts.tolerance import Tolerance
    from difftest.scripts.write import emit

    for number, (setting, code) in enumerate((("torchrec-optim/rowwise-adagrad/column_wise/ws4", 1),
                                              ("torchrec-optim/rowwise-adagrad/table_wise/ws2", 0))):
        emitted = emit(run_dir, f"O{number}", "a fused-optimizer finding", "inconsistent", run_dir / "models" /
                       "dlrm-s0-i0", setting, "state_after_step1/sparse.embedding_bags.weight.sum", {}, Tolerance(),
                       check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        assert "import difftest" not in emitted.path.read_text() and "apply_optimizer_in_backward" in \
            emitted.path.read_text()
        assert emitted.checked.exit_code == code, emitted.checked.output[-3000:]


def test_fused_optimizers_drop_momentum_and_weight_decay_and_fbgemms_cpu_fast_path_drops_it_where_the_manifest_says(
        tmp_path: Path) -> None:
    """Options beside the learning rate: SGD's momentum is dropped by TorchRec's fused SGD (two steps, since it acts
    from the second); two optimizer classes given one options dict train every table with one of them; row-wise Adagrad with fbgemm's L2 weight decay trains right on the tables that two features
    share (fbgemm's CPU slow path) and wrong on single-feature tables (its fast path passes weight_decay=0); the
    reference, stepping only the looked-up rows, agrees with torch.optim trained the same way under DMP's data
    parallelism. Each finding is triaged to its manifest entry (the fbgemm and the shared-dict cases look alike, one
    setting class and one first tensor: triage splits them by cause), and the fbgemm one's script reproduces."""
    from difftest.contracts.registry import get_generator
    from difftest.contracts.spec import RunConfig
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.storage.artifacts import load_spec

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    run_sweep(run_dir, SweepOptions(settings="torchrec-optim/rowwise-adagrad-l2/table_wise/ws2,"
                                             "torchrec-optim/sgd-momentum/table_wise/ws2,"
                                             "torchrec-optim/rowwise-adagrad-and-adagrad/table_wise/ws2,"
                                             "torchrec-optim/adagrad-weight-decay/data_parallel/ws2"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].map(str).to_dict()
    assert verdicts["torchrec-optim/adagrad-weight-decay/data_parallel/ws2"] == "ok", verdicts
    assert verdicts["torchrec-optim/sgd-momentum/table_wise/ws2"] == "inconsistent", verdicts
    assert verdicts["torchrec-optim/rowwise-adagrad-and-adagrad/table_wise/ws2"] == "inconsistent", verdicts
    compared = analysis.comparisons
    momentum = compared[compared["setting"] == "torchrec-optim/sgd-momentum/table_wise/ws2"]
    assert {"param_after_step2"} <= set(momentum["phase"])  # momentum needs the second step
    assert (momentum[momentum["phase"] == "param_after_step1"]["status"] == "ok").all()
    l2 = compared[(compared["setting"] == "torchrec-optim/rowwise-adagrad-l2/table_wise/ws2")
                  & (compared["phase"] == "param_after_step1") & compared["tensor"].str.contains("embedding_bags")]
    by_table = dict(zip(l2["tensor"].str.split(".").str[-2], l2["status"].map(str)))
    tables = {t.name: t.features for t in get_generator("dlrm").embedding_tables(
        load_spec(run_dir / "models" / "dlrm-s0-i0")) or []}
    assert {t: by_table[t] for t in tables} == \
        {t: "ok" if len(features) > 1 else "inconsistent" for t, features in tables.items()}, by_table
    known = {f.known.id for f in triage(run_dir, analysis) if f.known is not None}
    assert {"fbgemm-cpu-rowwise-adagrad-ignores-weight-decay", "torchrec-fused-optimizer-drops-torch-optim-options",
            "torchrec-shared-optimizer-options-dict"} <= known, known
    from difftest.contracts.tolerance import Tolerance
    from difftest.scripts.write import emit

    emitted = emit(run_dir, "O0", "fbgemm's CPU row-wise Adagrad drops weight decay", "inconsistent",
                   run_dir / "models" / "dlrm-s0-i0", "torchrec-optim/rowwise-adagrad-l2/table_wise/ws2",
                   "state_after_step1/sparse.embedding_bags.t1.weight.sum", {}, Tolerance(), check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert emitted.checked.exit_code == 1, emitted.checked.output[-3000:]


def test_a_torchrec_checkpoint_resumes_resharded_as_one_process_and_dcp_fails_on_a_rank_without_tables(
        tmp_path: Path) -> None:
    """Trained a step table-column-wise over 4 ranks, checkpointed with DCP and resumed column-wise over 2: both
    steps' weights, accumulators and losses agree with one process trained without the interruption; a resume that
    leaves the fused optimizer's state behind (planted) is caught at the accumulators after the resume; a reshard that
    leaves a rank without tables fails in DCP's load, the manifest's entry."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.storage.store import Store
    from settings.torchrec_reshard import resumed_outputs
    from tests.conftest import PLANTED

    merged = resumed_outputs({"eval_before/p": 0, "train_step1/loss": 1, "eval_after_step1/p": 2},
                             {"eval_before/p": 2, "train_step1/loss": 3, "param_after_step1/w": 4,
                              "eval_after_step1/p": 5}, at_step=1)
    assert merged == {"eval_before/p": 0, "train_step1/loss": 1, "train_step2/loss": 3, "param_after_step2/w": 4,
                      "eval_after_step2/p": 5}
    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("torchrec-dlrm",), plugins=(PLANTED,)))  # 3 tables
    resumed, empty_rank = ("torchrec-reshard/adagrad/table_column_wise-ws4/column_wise-ws2",
                           "torchrec-reshard/adagrad/row_wise-ws2/table_wise-ws4")
    planted = "faults/reshard-drops-optimizer-state/adagrad"
    run_sweep(run_dir, SweepOptions(settings=f"{resumed},{empty_rank},{planted}"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert verdicts[resumed] == "ok" and verdicts[planted] == "inconsistent", verdicts
    compared = analysis.comparisons[analysis.comparisons["setting"] == resumed]
    assert {"eval_before", "train_step2", "param_after_step2", "state_after_step2", "eval_after_step2"} <= \
        set(compared["phase"])
    assert compared["calibrated_ratio"].notna().all()
    wrong = analysis.comparisons[(analysis.comparisons["setting"] == planted)
                                 & (analysis.comparisons["status"] == "inconsistent")]
    assert "state_after_step1" not in set(wrong["phase"]) and "state_after_step2" in set(wrong["phase"])
    assert verdicts[empty_rank] == "error"
    found = {f.known.id for f in triage(run_dir, analysis) if f.known is not None}
    assert "dcp-empty-shard-old-checkpoint-heuristic" in found
    # the scripts (the tables alone, each phase in new processes, no difftest importable): the failing reshard fails
    # as the sweep's did; the one from 4 ranks to 2 agrees with one process, its accumulators after a step on 4 ranks
    # and a step on 2 (each rank's loss the mean of its share, as TorchRec's gradient division expects: a loss over
    # the whole batch on every rank scales the gradients by 1/world size, which Adagrad's steps hide until the world
    # size changes)
    from difftest.contracts.tolerance import Tolerance
    from difftest.scripts.write import emit

    message = next(r.message for r in Store(run_dir).records() if r.setting == empty_rank)
    for number, (setting, status, code) in enumerate(((empty_rank, "error", 1), (resumed, "inconsistent", 0))):
        emitted = emit(run_dir, f"R{number}", "a resharding finding", status, run_dir / "models" /
                       "torchrec-dlrm-s0-i0", setting, "", {}, Tolerance(), check_timeout_s=120,
                       message=message if status == "error" else "")
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        assert "import difftest" not in emitted.path.read_text() and "dcp.load" in emitted.path.read_text()
        assert emitted.checked.exit_code == code, emitted.checked.output[-3000:]


def test_a_frozen_tables_reshard_fails_in_dcp_and_its_script_freezes_it_as_the_setting_does(tmp_path: Path) -> None:
    """Seed 5's frozen DLRM freezes table w2, which the setting fuses with SGD at lr 0 (TorchRec's way to freeze a
    table); its optimizer state is empty, and DCP's load of the column-wise checkpoint under a table-wise plan misses
    it (the manifest's pre-2.4 heuristic). The script freezes the table as the setting does and fails the same way (a
    script that trained every table loaded, exit 0)."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate
    from difftest.scripts.write import emit
    from difftest.storage.store import Store

    run_dir, model = tmp_path / "run", "dlrm-s5-i1-frozen"
    generate(run_dir, RunConfig(seed=5, models=2, kinds=("dlrm",)))
    setting, missing = ("torchrec-reshard/adagrad/column_wise-ws2/table_wise-ws2",
                        "Missing key in checkpoint state_dict: optimizer.state.weighted_sparse.embedding_bags.w2.weight")
    run_sweep(run_dir, SweepOptions(pairs=((model, setting),), timeout_s=120))
    message = next(r.message for r in Store(run_dir).records() if r.setting == setting)
    assert missing in message, message
    found = [f.known.id for f in triage(run_dir, analyze(run_dir)) if f.known is not None]
    assert found == ["dcp-empty-shard-old-checkpoint-heuristic"], found
    emitted = emit(run_dir, "R0", "a frozen table's reshard", "error", run_dir / "models" / model, setting, "", {},
                   Tolerance(), check_timeout_s=120, message=message)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert "'frozen': ['w2']" in emitted.path.read_text()
    assert emitted.checked.exit_code == 1 and missing in emitted.checked.output, emitted.checked.output[-3000:]


def test_every_pipeline_schedule_the_installed_torch_exports_is_run() -> None:
    """A schedule a new torch release adds is a setting here (DualPipeV from 2.8), or this fails and says which."""
    from settings.pipeline import SCHEDULES, uncovered_schedules

    assert uncovered_schedules() == []
    assert "ScheduleDualPipeV" in {class_name for class_name, _, _ in SCHEDULES.values()}


def test_sequence_embeddings_shard_like_one_process_and_data_parallel_is_fbgemms_known_bug(tmp_path: Path) -> None:
    """The model's tables as EmbeddingCollections: table/row/column-wise shards train like the unsharded collections
    (judged by the calibrated envelope: the root computes in float64 for it), data-parallel tables hit fbgemm's CPU
    dense lookup that pools under PoolingMode.NONE (a known finding), and index dedup, with no CPU kernel here, is
    unsupported with the probe's reason."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    run_sweep(run_dir, SweepOptions(settings="torchrec-seq/*/all-ids/ws2,torchrec-seq/row_wise/dedup/ws2"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    for sharding in ("table_wise", "row_wise", "column_wise"):
        assert verdicts[f"torchrec-seq/{sharding}/all-ids/ws2"] == "ok", verdicts
    assert verdicts["torchrec-seq/data_parallel/all-ids/ws2"] == "error"
    assert verdicts["torchrec-seq/row_wise/dedup/ws2"] == "unsupported"
    compared = analysis.comparisons[analysis.comparisons["setting"] == "torchrec-seq/row_wise/all-ids/ws2"]
    assert compared["calibrated_ratio"].notna().all() and {"eval_before", "param_after_step1"} <= set(compared["phase"])
    assert any(t.startswith("seq.") for t in compared["tensor"])
    found = {f.known.id for f in triage(run_dir, analysis) if f.known is not None}
    assert "fbgemm-dense-tbe-cpu-pools-sequence" in found


def test_torchrecs_clipping_optimizer_clips_the_dense_gradients_as_clip_grad_norm_does(tmp_path: Path) -> None:
    """GradientClippingOptimizer around the dense part of a sharded model (fused tables unclipped, as in one
    process): the same weights as clip_grad_norm_ in one process, for norm 2 and inf, with the clipping really
    scaling (each case notes a total norm above max_norm)."""
    import re

    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate
    from settings.gradient_clipping import MAX_NORM

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    run_sweep(run_dir, SweepOptions(settings="torchrec-clip/*/table_wise/ws2,torchrec-clip/norm2/data_parallel/ws2,"
                                             "torchrec-clip/norminf/column_wise/ws4"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    for setting in ("torchrec-clip/norm2/table_wise/ws2", "torchrec-clip/norminf/table_wise/ws2",
                    "torchrec-clip/norm2/data_parallel/ws2", "torchrec-clip/norminf/column_wise/ws4"):
        assert verdicts[setting] == "ok", verdicts
    notes = analysis.comparisons[analysis.comparisons["setting"].str.startswith("torchrec-clip/")]["message"]
    norms = [float(n) for n in re.findall(r"total norm before clipping: ([0-9.e+-]+)", " ".join(notes))]
    assert norms and min(norms) > MAX_NORM, norms
    # its script: the whole model sharded, TorchRec's clipping optimizer on the ranks against clip_grad_norm_ in one
    # process; it agrees (exit 0: both norms, data-parallel tables beside the clipped optimizer, 4 ranks), and a
    # clipping optimizer that clips to twice the bound disagrees (exit 1)
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.check import check_script
    from difftest.scripts.write import emit

    for number, setting in enumerate(("torchrec-clip/norminf/column_wise/ws4", "torchrec-clip/norm2/data_parallel/ws2",
                                      "torchrec-clip/norm2/table_wise/ws2")):
        emitted = emit(run_dir, f"C{number}", "a TorchRec clipping finding", "inconsistent",
                       run_dir / "models" / "dlrm-s0-i0", setting, "param_after_step1/over.0.weight",
                       envelope_spread(run_dir, "dlrm-s0-i0", setting), Tolerance(), check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        assert emitted.checked.exit_code == 0 and "what rounding explains" in emitted.checked.output, \
            (setting, emitted.checked.output[-3000:])
        text = emitted.path.read_text()
        assert "GradientClippingOptimizer(" in text and "clip_grad_norm_(" in text and "import difftest" not in text
        compared = "".join(re.findall(r"TENSORS = .*", text))
        assert "over.0.weight" in compared and "embedding_bags" not in compared  # the tables are not the clipping's
    bound = "max_gradient=MAX_NORM"
    assert text.count(bound) == 1
    emitted.path.write_text(text.replace(bound, "max_gradient=2 * MAX_NORM"))
    planted = check_script(emitted.path, timeout_s=120)
    assert planted.exit_code == 1 and "BUG PRESENT" in planted.output, planted.output[-3000:]


def test_torchrecs_quantized_comms_round_to_fp16_and_stay_inside_the_fp16_envelope(tmp_path: Path) -> None:
    """fbgemm's fp16 codecs on the pooled embeddings' collectives: the sharded model lands further from one process than
    fp32 rounding would (the codecs really quantize: a registry TorchRec ignored would agree to ~1e-8) and inside the
    envelope of fp16 rounding its root's calibrations measure. Data-parallel tables send no embeddings: the family
    has none (`torchrec/ebc/data_parallel/*` judges them at fp32)."""
    from difftest.contracts.registry import all_settings
    from difftest.contracts.spec import RunConfig
    from difftest.generation.generate import generate

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    run_sweep(run_dir, SweepOptions(settings="torchrec-qcomms/fp16-fp16/table_wise/ws2,"
                                             "torchrec-qcomms/fp16-fp32/row_wise/ws2"))
    analysis = analyze(run_dir)
    assert set(analysis.cases.set_index("setting")["verdict"]) == {"ok"}, analysis.cases
    rows = analysis.comparisons[analysis.comparisons["setting"].str.startswith("torchrec-qcomms/")]
    worst = rows.groupby("setting")["linf"].max()
    assert worst["torchrec-qcomms/fp16-fp16/table_wise/ws2"] > 1e-5, worst
    assert worst["torchrec-qcomms/fp16-fp32/row_wise/ws2"] > 1e-5, worst
    assert not [s.name for s in all_settings() if s.name.startswith("torchrec-qcomms/") and "data_parallel" in s.name]
    assert 0 < rows["calibrated_ratio"].astype(float).max() < 1, rows["calibrated_ratio"]
    # its standalone script (no difftest importable) sends the pooled embeddings through the same codecs: off from one
    # process by fp16's rounding, as the sweep's case, and inside the envelope (exit 0)
    import numpy as np

    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.write import emit

    setting, first = "torchrec-qcomms/fp16-fp16/table_wise/ws2", "eval_before/pooled.tf0"
    emitted = emit(run_dir, "Q0", "a quantized-comms finding", "inconsistent", run_dir / "models" / "dlrm-s0-i0",
                   setting, first, envelope_spread(run_dir, "dlrm-s0-i0", setting), Tolerance(), check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert "QCommsConfig(" in emitted.path.read_text() and "CommType[forward]" in emitted.path.read_text()
    assert emitted.checked.exit_code == 0, emitted.checked.output[-3000:]
    worst = [re.search(r"single process (\S+), setting (\S+),", line) for line in emitted.checked.output.splitlines()
             if line.startswith("pooled.")]
    assert worst and max(abs(float(m[1]) - float(m[2])) for m in worst if m) > 1e-5, emitted.checked.output[-3000:]
    assert np.isfinite([float(m[2]) for m in worst if m]).all()


def test_managed_collision_tables_shard_like_one_process_until_an_unsharded_eviction_keeps_a_trained_row(
        tmp_path: Path) -> None:
    """The model's tables behind zero-collision hashes: sharded row-wise over 2 ranks with room for every id, each
    sample pools as in one process, before and after the steps (fused SGD or Adagrad against the same class), but for
    the row-wise 1 - 2^-20 scaling; with 8 slots
    and LRU eviction on one rank, the unsharded module's rows keep what evicted ids trained (its `evict` is a stub),
    a second cause that triage keeps apart from the small scaling found before it in the same case; its standalone
    script shows it and, given ample slots, agrees. Without an optimizer fused into them (the DENSE kernel the plan
    helper then picks), the sharded tables fail at the first training forward, and that script passes once fused."""
    from difftest.contracts.spec import RunConfig
    from difftest.findings.triage import triage
    from difftest.generation.generate import generate

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    run_sweep(run_dir, SweepOptions(
        settings="torchrec-mc/row_wise/ws2,torchrec-mc/row_wise-adagrad/ws2,torchrec-mc/row_wise-scarce/ws1,"
                 "torchrec-mc/row_wise-dense/ws2"))
    analysis = analyze(run_dir)
    # fused SGD and fused Adagrad against the same PyTorch class on the unsharded modules
    rows = analysis.comparisons[analysis.comparisons["setting"].isin(
        ["torchrec-mc/row_wise/ws2", "torchrec-mc/row_wise-adagrad/ws2"])]
    pooled = rows[rows["tensor"].str.startswith("pooled.")]
    assert {"eval_before", "eval_after_step1"} <= set(pooled["phase"]), pooled
    assert pooled["calibrated_ratio"].notna().all() and pooled["max_rel"].astype(float).max() < 1e-3, pooled
    assert set(pooled["setting"]) == {"torchrec-mc/row_wise/ws2", "torchrec-mc/row_wise-adagrad/ws2"}, pooled
    scarce = analysis.comparisons[analysis.comparisons["setting"] == "torchrec-mc/row_wise-scarce/ws1"]
    after = scarce[scarce["phase"].str.startswith("eval_after") & scarce["tensor"].str.startswith("pooled.")]
    assert after["linf"].astype(float).max() > 1e-3, after
    findings = {f.known.id if f.known else f.title: f for f in triage(run_dir, analysis)}
    eviction = findings["torchrec-mc-unsharded-eviction-keeps-rows"]
    assert eviction.first_divergence.startswith("eval_after_step"), eviction.first_divergence
    assert set(eviction.rows["setting"]) == {"torchrec-mc/row_wise-scarce/ws1"}
    dense = findings["torchrec-mc-dense-kernel-reset-fails"]
    assert set(dense.rows["setting"]) == {"torchrec-mc/row_wise-dense/ws2"} and set(dense.rows["status"]) == {"error"}
    assert set(findings) <= {"torchrec-mc-unsharded-eviction-keeps-rows", "torchrec-rowwise-scaled-by-one-minus-2-pow-20",
                             "torchrec-mc-dense-kernel-reset-fails"}
    # its script (no difftest importable) reproduces it; the same script with ample slots is left with the row-wise
    # scaling alone: no pooled value further from one process than 1e-5 (the eviction's are 1e-3 and more)
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.check import check_script
    from difftest.scripts.write import emit

    setting = "torchrec-mc/row_wise-scarce/ws1"
    emitted = emit(run_dir, "M0", "a managed-collision finding", "inconsistent", run_dir / "models" / "dlrm-s0-i0",
                   setting, eviction.first_divergence, envelope_spread(run_dir, "dlrm-s0-i0", setting), Tolerance(),
                   check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert emitted.checked.exit_code == 1 and "BUG PRESENT" in emitted.checked.output, emitted.checked.output[-3000:]
    text = emitted.path.read_text()
    assert "import difftest" not in text and "ManagedCollisionEmbeddingBagCollection(" in text
    def worst(output: str) -> float:
        pairs = re.findall(r"single process (\S+), setting (\S+),", output)
        assert pairs, output[-3000:]
        return max(abs(float(a) - float(b)) for a, b in pairs)

    assert worst(emitted.checked.output) > 1e-3
    emitted.path.write_text(text.replace("'capacity': 'scarce'", "'capacity': 'ample'", 1))
    ample = check_script(emitted.path, timeout_s=120)
    assert ample.exit_code in (0, 1) and worst(ample.output) < 1e-5, ample.output[-3000:]

    setting = "torchrec-mc/row_wise-dense/ws2"
    message = str(dense.rows["message"].iloc[0])
    failing = emit(run_dir, "M1", "a dense-kernel failure", "error", run_dir / "models" / "dlrm-s0-i0", setting, "",
                   {}, Tolerance(), check_timeout_s=120, message=message)
    assert failing.path is not None and failing.checked is not None, failing.why_not
    assert failing.checked.exit_code == 1 and "reset_embedding_weight_momentum" in failing.checked.output, \
        failing.checked.output[-3000:]
    whole = failing.path.with_name("standalone.full.py")  # the reduced script lost the fused branch, which never ran
    failing.path.write_text((whole if whole.exists() else failing.path).read_text().replace(
        "'kernel': 'dense'", "'kernel': 'fused'", 1))
    fused = check_script(failing.path, timeout_s=120)
    assert fused.exit_code == 0, fused.output[-3000:]


def test_torchrecs_variable_batch_sends_fewer_bags_and_pools_as_every_bag_written_out(tmp_path: Path) -> None:
    """VBE: each rank sends a feature's distinct bags once (fewer than its samples, more for some features than for
    others) and table-wise sharding pools and trains as the unsharded collections on every bag written out; a
    row-wise case either agrees or fails in a way the manifest names, never silently."""
    import re

    from difftest.contracts.spec import RunConfig
    from difftest.findings.known import get
    from difftest.generation.generate import generate

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    run_sweep(run_dir, SweepOptions(settings="torchrec-vbe/table_wise/ws2,torchrec-vbe/row_wise/ws2"))
    analysis = analyze(run_dir)
    verdicts = analysis.cases.set_index("setting")["verdict"].to_dict()
    assert verdicts["torchrec-vbe/table_wise/ws2"] == "ok", verdicts
    rows = analysis.comparisons[analysis.comparisons["setting"] == "torchrec-vbe/table_wise/ws2"]
    assert rows["tensor"].str.startswith("pooled.").any() and rows["linf"].max() < 1e-5, rows
    found = re.search(r"bags sent per feature: (.*?) \(of (\d+) samples\)", " ".join(rows["message"]))
    assert found, rows["message"]
    counts = [int(n) for n in re.findall(r"\w+ (\d+)", found.group(1))]
    assert counts and max(counts) <= int(found.group(2)) and min(counts) < int(found.group(2)), found.group(0)
    assert len(set(counts)) > 1, found.group(0)
    if verdicts["torchrec-vbe/row_wise/ws2"] != "ok":
        failed = analysis.comparisons[analysis.comparisons["setting"] == "torchrec-vbe/row_wise/ws2"]["message"]
        assert re.search(get("torchrec-vbe-mean-divisor-inverse-order").message, " ".join(failed)), failed
    # its standalone script (no difftest importable) sends the same runs of bags and agrees; with every sample pointed
    # at its feature's first run (a planted wrong inverse index) it disagrees
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.check import check_script
    from difftest.scripts.write import emit

    setting = "torchrec-vbe/table_wise/ws2"
    emitted = emit(run_dir, "V0", "a variable-batch finding", "inconsistent", run_dir / "models" / "dlrm-s0-i0",
                   setting, "eval_before/pooled.tf0", envelope_spread(run_dir, "dlrm-s0-i0", setting), Tolerance(),
                   check_timeout_s=120)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert emitted.checked.exit_code == 0, emitted.checked.output[-3000:]
    text = emitted.path.read_text()
    inverse = 'np.searchsorted(runs, np.arange(len(bag)), side="right") - 1'
    assert "stride_per_key_per_rank=strides" in text and text.count(inverse) == 1
    emitted.path.write_text(text.replace(inverse, "np.zeros(len(bag), dtype=np.int64)"))
    planted = check_script(emitted.path, timeout_s=120)
    assert planted.exit_code == 1 and "BUG PRESENT" in planted.output, planted.output[-3000:]


def test_fsdp2_shards_on_the_last_dimension_and_as_hsdp_as_torchtitan_lays_out_and_trains_as_one_process(
        tmp_path: Path) -> None:
    """FSDP2 with `shard_placement_fn` putting a parameter's shards on its last dimension where it divides, and HSDP
    (a (replicate, shard) mesh) with it, train a DLRM-like model as one process does; the case notes show the layout
    FSDP2 really made (some parameters on dim 1, every one replicated over the HSDP mesh's first dimension), and the
    standalone script lays the model out the same way and agrees (exit 0)."""
    from difftest.contracts.spec import RunConfig
    from difftest.contracts.tolerance import Tolerance
    from difftest.generation.generate import generate
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.write import emit
    from difftest.storage.store import Store

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("dlrm",)))
    last, hsdp = "fsdp2/per-layer/reshard/fp32/shard-last/ws2", "fsdp2/per-layer/reshard/bf16/shard-last/hsdp2/ws4"
    run_sweep(run_dir, SweepOptions(pairs=(("dlrm-s0-i0", last), ("dlrm-s0-i0", hsdp))))
    cases = analyze(run_dir).cases.set_index(["model", "setting"])["verdict"]
    assert cases[("dlrm-s0-i0", last)] == "ok" and cases[("dlrm-s0-i0", hsdp)] == "ok", cases.to_dict()
    store = Store(run_dir)
    try:
        notes = {r.setting: r.message for r in store.records() if r.setting in (last, hsdp)}
    finally:
        store.close()
    assert "(Shard(dim=1),)" in notes[last] and "(Shard(dim=0),)" in notes[last], notes
    assert "(Replicate(), Shard(dim=1))" in notes[hsdp] and "(Shard(dim=" not in notes[hsdp], notes
    emitted = emit(run_dir, "H1", "an HSDP finding", "inconsistent", run_dir / "models" / "dlrm-s0-i0", hsdp,
                   "param_after_step1/over.0.weight", envelope_spread(run_dir, "dlrm-s0-i0", hsdp), Tolerance(),
                   check_timeout_s=180)
    assert emitted.path is not None and emitted.checked is not None, emitted.why_not
    assert "shard_placement_fn=" in emitted.path.read_text() and "'replicate': 2" in emitted.path.read_text()
    assert emitted.checked.exit_code == 0, emitted.checked.output[-3000:]
