"""Keras sequential models: generation, trainable conversion, and the TF / conversion / DDP settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from difftest import ConversionFailed
from difftest.judging.analysis import analyze
from difftest.runner.sweep import SweepOptions, list_models, run_sweep
from difftest.storage.artifacts import load_model
from generators.onnx_files import EXPORT_ERROR_FILE
from generators.sequential import SequentialGenerator
from tests.conftest import PLANTED

pytestmark = pytest.mark.needs_tf


def test_specs_are_reproducible_and_every_draw_builds() -> None:
    generator = SequentialGenerator()
    assert generator.spec(3, 5) == generator.spec(3, 5)
    assert generator.spec(3, 5) != generator.spec(3, 6)
    for index in range(30):
        spec = generator.spec(7, index)
        assert bool(spec.frozen) == (index % 2 == 1)
        model = generator.keras_model(spec)  # shape inference kept every layer valid
        assert model.output_shape == (None, spec.params["classes"])
        if spec.frozen:
            assert spec.frozen[0] != spec.params["layers"][-1]["name"]


def test_every_keras_weight_maps_to_exactly_one_trainable_parameter(sequential_run: Path) -> None:
    import torch

    checked = 0
    for model_dir, spec in list_models(sequential_run):
        if (model_dir / EXPORT_ERROR_FILE).exists():
            continue
        model, inputs = load_model(model_dir)
        module = model.build("cpu", converter="onnx2pytorch")
        wanted = {n for n in model.init_state if not n.endswith(("moving_mean", "moving_variance"))}
        assert set(module.mapped) | set(module.unmapped) == wanted
        assert not set(module.mapped) & set(module.unmapped)
        # only BatchNorm's gamma/beta are folded by tf2onnx; everything else must be trainable
        assert all("batchnormalization" in name for name in module.unmapped), module.unmapped
        views = module.keras_parameters()
        for name, view in views.items():
            np.testing.assert_array_equal(view.detach().numpy(), model.init_state[name])
        frozen = tuple(f"{layer}/" for layer in spec.frozen)
        expected_trainable = {id(module.mapped[n].tensor) for n in module.mapped if not n.startswith(frozen)}
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        assert trainable == expected_trainable
        assert len(expected_trainable) == len([n for n in module.mapped if not n.startswith(frozen)])
        # one SGD step moves exactly the trainable weights
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
        model.loss(model.forward(module, inputs.train, "cpu"), inputs.train).backward()
        optimizer.step()
        for name, view in module.keras_parameters().items():
            moved = not np.array_equal(view.detach().numpy(), model.init_state[name])
            assert moved == (not name.startswith(frozen)), name
        checked += 1
    assert checked >= 4


def test_a_second_build_is_a_copy_that_trains_and_draws_as_a_fresh_build(sequential_run: Path) -> None:
    """A loaded Keras model builds once per process and copies after (`Generator.builds_copied`): each copy is its own
    module, trains to the same bits as a fresh build, and leaves the random generators where a build leaves them."""
    import random

    import torch

    def seeded(seed: int = 5) -> None:
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)

    def trained(module: torch.nn.Module) -> dict[str, np.ndarray]:
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
        for _ in range(2):
            optimizer.zero_grad()
            model.loss(model.forward(module, inputs.train, "cpu"), inputs.train).backward()
            optimizer.step()
        return {n: v.detach().numpy().copy() for n, v in model.parameters(module).items()}

    copied = 0
    for model_dir, _ in list_models(sequential_run):
        if (model_dir / EXPORT_ERROR_FILE).exists():
            continue
        model, inputs = load_model(model_dir)
        assert model.generator.builds_copied
        seeded()
        first = model.build("cpu")
        drawn_after_first = torch.rand(4)
        seeded()
        second = model.build("cpu")
        assert torch.equal(torch.rand(4), drawn_after_first)  # the generators left where a build leaves them
        copied += model._built[("build", "cpu")] is not None
        assert [(n, p.stride(), p.requires_grad) for n, p in second.named_parameters()] == \
            [(n, p.stride(), p.requires_grad) for n, p in first.named_parameters()]
        assert not {p.untyped_storage().data_ptr() for p in second.parameters()} & \
            {p.untyped_storage().data_ptr() for p in first.parameters()}
        fresh = trained(first)  # the first build is the one `make` returned
        seeded()
        copy_trained = trained(second)
        seeded(6)  # the generators stand elsewhere than before the first build: built afresh, not copied
        afresh = trained(model.build("cpu"))
        assert all(np.array_equal(fresh[n], copy_trained[n]) and np.array_equal(fresh[n], afresh[n]) for n in fresh)
        seeded()
        assert all(np.array_equal(fresh[n], v) for n, v in trained(model.build("cpu")).items())  # the template untouched
        # a chain's copy: its parameter reader reads the copy's units, and they compute what a fresh chain's do
        seeded()
        try:
            first_chain = model.chain("cpu")
        except ConversionFailed:  # a segment the converter refuses (a pipeline setting reports it)
            continue
        drawn_after_first = torch.rand(4)
        seeded()
        second_chain = model.chain("cpu")
        assert torch.equal(torch.rand(4), drawn_after_first)
        copied += model._built[("chain", "cpu")] is not None
        ours = {t.untyped_storage().data_ptr() for t in second_chain.canonical().values()}
        assert ours <= {p.untyped_storage().data_ptr() for u in second_chain.units for p in u.parameters()}
        assert not ours & {t.untyped_storage().data_ptr() for t in first_chain.canonical().values()}
        for chain in (first_chain, second_chain):
            chain.feed(inputs.train)
        hidden = [chain.units[0](torch.arange(6)) for chain in (first_chain, second_chain)]
        for first_unit, second_unit in zip(first_chain.units[1:], second_chain.units[1:]):
            hidden = [first_unit(hidden[0]), second_unit(hidden[1])]
        assert torch.equal(hidden[0], hidden[1])
    assert copied >= 4  # most conversions copy; one that holds a Python module is built every time


def test_conversion_and_tf_faults_are_reported_and_clean_settings_are_not(fresh_sequential_run: Path) -> None:
    run_dir = fresh_sequential_run
    # TensorFlow's quantized forms too: within the bound their schemes' rounding implies, unless a kernel is off
    clean = ["reference", "tf/reference", "tf/mirrored/r2", "convert/onnxruntime/eval",
             "convert/onnx2pytorch/eval", "convert/onnx2pytorch/train", "ddp/default/ws2", "quant/tflite/float16",
             "quant/tf/mixed-bfloat16"]
    planted = ["faults/convert_flipped_kernel/eval", "faults/convert_flipped_kernel/train", "faults/tf_local_mean_loss/r2",
               "faults/later_kernel_scaled", "faults/quant_kernel_scaled/float16"]
    models = "*-i0,*-i1-frozen,*-i2"
    run_sweep(run_dir, SweepOptions(settings=",".join([*clean, *planted, "quant/tflite/dynamic-int8"]), models=models,
                                    plugins=(PLANTED,), timeout_s=180))
    analysis = analyze(run_dir)
    cases = analysis.cases
    judged = {(r.model, r.setting): r.verdict for r in cases.itertuples()}
    # TFLite's int8 leaves these small models' kernels in float: nothing of int8 to test, and said so
    messages = analysis.comparisons.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])["message"]
    for model in ("sequential-s0-i0", "sequential-s0-i1-frozen", "sequential-s0-i2"):
        key = (model, "quant/tflite/dynamic-int8")
        assert judged[key] == "unsupported" and "tensorflow#53094" in messages[key], (judged[key], messages[key])
    for model in ("sequential-s0-i0", "sequential-s0-i1-frozen", "sequential-s0-i2"):
        for setting in clean:
            assert judged[(model, setting)] == "ok", (model, setting)
        for setting in planted:
            assert judged[(model, setting)] == "inconsistent", (model, setting)
    # converted models record every exposed layer's output: a divergence is traced to the layer it starts in
    from difftest.findings.signature import first_divergences
    from difftest.storage.artifacts import load_model
    from tests.faults.planted import scaled_layer

    earliest = first_divergences(analyze(run_dir))
    earliest = earliest[earliest["setting"] == "faults/later_kernel_scaled"].set_index("model")
    for model in ("sequential-s0-i0", "sequential-s0-i1-frozen", "sequential-s0-i2"):
        loaded, inputs = load_model(run_dir / "models" / model)
        module = loaded.build("cpu")
        layer = scaled_layer(loaded, module)
        assert len(loaded.evaluate(module, inputs.eval, "cpu")) == 1 + len(module.layers) >= 3
        where = earliest.loc[model]
        expected = f"{layer}/act" if layer in module.layers else "logits"
        assert (where["phase"], where["tensor"]) == ("eval_before", expected), (model, layer, module.layers)


def test_a_conversion_failure_reproduces_from_the_onnx_file_alone(fresh_sequential_run: Path) -> None:
    """onnx2torch 1.5.15 has no ReduceMean-18 converter (`onnx2torch-no-reducemean-18`), which this model's training
    graph needs; onnx2pytorch converts the same graph. The script of each reaches the setting's verdict, with the
    ONNX file as its data and neither TensorFlow nor difftest importable."""
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings import known
    from difftest.scripts.write import emit

    model, failing, converting = "sequential-s0-i0", "convert/onnx2torch/train", "convert/onnx2pytorch/eval"
    run_sweep(fresh_sequential_run, SweepOptions(settings=f"{failing},{converting}", models=model, timeout_s=180))
    analysis = analyze(fresh_sequential_run)
    verdicts = analysis.cases.set_index(["model", "setting"])["verdict"]
    assert verdicts[(model, converting)] == "ok"
    expected = "error" if known.reproduces_here("onnx2torch-no-reducemean-18") else "ok"
    assert verdicts[(model, failing)] == expected, "onnx2torch's ReduceMean-18: the manifest says which releases lack it"
    recorded = analysis.comparisons.drop_duplicates(["model", "setting"]).set_index(["model", "setting"])["message"]
    message = str(recorded.get((model, failing), ""))
    for number, (setting, status) in enumerate(((failing, "error"), (converting, "error"))):
        emitted = emit(fresh_sequential_run, f"C{number}", "a conversion failure", status,
                       fresh_sequential_run / "models" / model, setting, "", {}, Tolerance(), check_timeout_s=120,
                       message=message if setting == failing else "NotImplementedError: Converter is not implemented")
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "import tensorflow" not in text
        assert emitted.checked.reproduces == (verdicts[(model, setting)] != "ok"), emitted.checked.output[-2000:]
        assert emitted.checked.exit_code == (1 if verdicts[(model, setting)] != "ok" else 0), emitted.checked.output[-2000:]


def test_a_training_finding_reproduces_from_the_onnx_file_alone(fresh_sequential_run: Path) -> None:
    """Legacy FSDP with NO_SHARD trains a converted model's transposed (non-contiguous) weight wrongly
    (`fsdp1-no-shard-noncontiguous`); FULL_SHARD trains it as one process does. The script of each, with the ONNX
    file, the Keras weights and the batch as its data, reaches the setting's verdict where difftest does not import."""
    from difftest.contracts.tolerance import Tolerance
    from difftest.findings import known
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.emit import MAX_LINES
    from difftest.scripts.write import emit

    model, buggy, sound = "sequential-s0-i0", "fsdp1/no_shard/ws2", "fsdp1/full_shard/ws2"
    run_sweep(fresh_sequential_run, SweepOptions(settings=f"{buggy},{sound}", models=model, timeout_s=180))
    analysis = analyze(fresh_sequential_run)
    verdicts = analysis.cases.set_index(["model", "setting"])["verdict"]
    expected = "inconsistent" if known.reproduces_here("fsdp1-no-shard-noncontiguous") else "ok"
    assert verdicts[(model, buggy)] == expected, "the manifest says which releases have the bug"
    assert verdicts[(model, sound)] == "ok"
    for number, setting in enumerate((buggy, sound)):
        emitted = emit(fresh_sequential_run, f"P{number}", "a training finding", "inconsistent",
                       fresh_sequential_run / "models" / model, setting, "param_after_step1/l0_dense/kernel",
                       envelope_spread(fresh_sequential_run, model, setting), Tolerance(), check_timeout_s=120)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and "import tensorflow" not in text and text.count("\n") <= MAX_LINES
        assert emitted.checked.exit_code == (0 if verdicts[(model, setting)] == "ok" else 1), \
            emitted.checked.output[-3000:]
