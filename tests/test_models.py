"""The kinds of issue 17: native transformers, TorchRec's own models, Keras functional DAGs and transformer blocks.

Each kind is reproducible from (seed, index); its chain of units computes exactly its forward; the settings that
apply to it by its traits run it, and agree with the reference where the libraries are right; the library finding it
exposed (SequenceParallel unfreezes a frozen norm weight) is reported.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import generators  # noqa: F401  (registers the kinds)
from difftest.contracts.registry import get_generator, load_plugins, select_settings, traits_of
from difftest.contracts.spec import RunConfig
from difftest.findings import known
from difftest.generation.generate import generate
from difftest.judging.analysis import analyze
from difftest.runner.sweep import SweepOptions, run_sweep

TORCH_KINDS = ("transformer", "torchrec-dlrm", "torchrec-deepfm")
KERAS_KINDS = ("keras-dag", "keras-transformer")


@pytest.mark.parametrize("kind", TORCH_KINDS + KERAS_KINDS)
def test_a_kind_is_reproducible_from_seed_and_index(kind: str) -> None:
    generator = get_generator(kind)
    first, again, other = generator.spec(3, 1), generator.spec(3, 1), generator.spec(3, 2)
    assert first.to_json() == again.to_json() and first.to_json() != other.to_json()
    assert first.frozen  # odd indices are the frozen variant
    if kind in TORCH_KINDS:
        state, same = generator.init_state(first), generator.init_state(again)
        assert state.keys() == same.keys() and all(np.array_equal(state[k], same[k]) for k in state)
    batch = generator.inputs(first, 12)
    assert batch["train"].size == 12 and not np.array_equal(batch["train"].labels, batch["eval"].labels)


@pytest.mark.parametrize("kind", ("transformer", "dlrm", "torchrec-dlrm"))
def test_every_third_model_draws_widths_no_world_size_divides(kind: str) -> None:
    """Index 2, 5, 8, ... is the uneven variant: its dense widths (and a transformer's feed-forward width and
    vocabulary) divide by none of 2, 3 and 4, so every sharding cuts them into shards of different sizes; the others
    keep even widths."""
    generator = get_generator(kind)
    for index in range(6):
        params = generator.spec(11, index).params
        widths = ([params["hidden"], params["vocab"]] if kind == "transformer"
                  else params["dense_arch"][:-1] + params["over_arch"][:-1])
        if index % 3 == 2:
            assert widths and all(w % 2 and w % 3 for w in widths), (index, params)
            # and it is a model its kind computes: a forward pass on its batch runs and is finite
            spec = generator.spec(11, index)
            module = generator.build(spec, generator.init_state(spec), "cpu")
            prediction = generator.forward(module, generator.inputs(spec, 12)["train"], "cpu")
            assert bool(prediction.isfinite().all()), (index, params)
        else:
            assert all(w % 2 == 0 for w in widths), (index, params)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_the_chain_of_units_computes_the_forward_bit_for_bit(kind: str) -> None:
    import torch

    from difftest.contracts.chain import ChainStage

    generator = get_generator(kind)
    for index in (0, 2, 4):
        spec = generator.spec(0, index)
        if spec.params.get("tied"):
            continue  # a tied transformer has no chain (its first and last stage would share a tensor)
        state = generator.init_state(spec)
        batch = generator.inputs(spec, 12)["eval"]
        module = generator.build(spec, state, "cpu")
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        assert frozen == set(spec.frozen) and set(generator.parameters(module)) == set(state)
        chain = generator.chain(spec, state, "cpu")
        chain.feed(batch)
        with torch.no_grad():
            assert torch.equal(ChainStage(chain.units)(torch.arange(12)), generator.forward(module, batch, "cpu"))
        assert len(chain.units) >= 3


@pytest.mark.parametrize("kind", ["dlrm", "torchrec-dlrm", "torchrec-deepfm", "transformer"])
def test_a_standalone_scripts_model_computes_what_the_kind_does(kind: str) -> None:
    """The model code a standalone script holds (`Generator.standalone_model`), run from its data alone, gives the
    kind's forward through its layer chain and its loss, bit for bit: a script shows the model difftest ran."""
    import torch

    from difftest.contracts.chain import ChainStage
    from difftest.scripts.emit import _source

    generator = get_generator(kind)
    for index in (0, 1, 2):
        spec = generator.spec(0, index)
        state, batches = generator.init_state(spec), generator.inputs(spec, 12)
        code = generator.standalone_model(spec, state, None, batches["train"])
        assert code is not None and code.chain
        script: dict[str, Any] = {"torch": torch, "np": np, "Any": Any}
        exec("from __future__ import annotations\n" + "\n".join(_source(f) for f in (*code.functions, *code.chain)),
             script)
        data = {**code.data, **batches["eval"].to_arrays("eval")}
        module = script["build_model"](data, code.case, torch.float32)
        assert set(script["model_parameters"](module)) == set(code.parameters) == set(state)
        reference = generator.build(spec, state, "cpu")
        units = script["model_chain"](module, data, {"split": "eval"}, torch.float32)
        with torch.no_grad():
            assert torch.equal(ChainStage(units)(torch.arange(12)), generator.forward(reference, batches["eval"], "cpu"))
        expected = generator.loss(generator.forward(reference, batches["train"], "cpu"), batches["train"])
        assert torch.equal(script["model_loss"](module, data, 0, 12, torch.float32), expected)


def test_the_transformer_plan_is_torchtitans() -> None:
    generator = get_generator("transformer")
    spec = next(s for s in (generator.spec(0, i) for i in range(20)) if not s.params["tied"])
    module = generator.build(spec, generator.init_state(spec), "cpu")
    plan = generator.tp_plan(module, 2, sequence_parallel=True, loss_parallel=True)
    for i in range(spec.params["layers"]):
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                     "feed_forward.w2", "attention_norm", "ffn_norm"):
            assert f"layers.{i}.{name}" in plan
    assert type(plan["output"]).__name__ == "ColwiseParallel" and not plan["output"].use_local_output
    assert type(plan["norm"]).__name__ == "SequenceParallel"
    assert [n for n, _ in generator.blocks(module)] == [f"layers.{i}" for i in range(spec.params["layers"])]


def test_settings_choose_models_by_traits() -> None:
    load_plugins()
    assert traits_of("torchrec-deepfm") >= {"torchrec"} and "keras" in traits_of("keras-dag")
    by_name = {s.name: s for s in select_settings("torchrec/ebc/row_wise/ws2,tf/mirrored/r2,convert/onnx2pytorch/eval")}
    for kind in TORCH_KINDS + KERAS_KINDS:
        spec = get_generator(kind).spec(0, 0)
        assert (by_name["torchrec/ebc/row_wise/ws2"].supports(spec) is None) == (kind.startswith("torchrec-"))
        assert (by_name["tf/mirrored/r2"].supports(spec) is None) == (kind in KERAS_KINDS)
        assert (by_name["convert/onnx2pytorch/eval"].supports(spec) is None) == (kind in KERAS_KINDS)


@pytest.fixture(scope="module")
def transformer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("transformer") / "run"
    generate(run_dir, RunConfig(seed=0, models=2, kinds=("transformer",)))
    return run_dir


TRANSFORMER_CLEAN = [
    "tp/colwise-rowwise/ws2", "tp/sequence-parallel/loss-parallel/ws2", "fsdp2/per-layer/reshard/fp32/ws2",
    "fsdp2/per-layer/reshard/bf16/ws2", "fsdp2-tp/dp2-tp2/colwise-rowwise/ws4", "pipeline/1f1b/ws2/stages2/mb2/balanced",
    "ddp/default/ws2",
]


def test_transformers_run_under_tensor_sequence_loss_parallel_fsdp_and_pipelines(transformer_run: Path) -> None:
    """Seed 0's models: i0 untied, nothing frozen; i1 tied, one block's attention norm frozen."""
    run_sweep(transformer_run, SweepOptions(settings=",".join(TRANSFORMER_CLEAN + ["tp/sequence-parallel/ws2"]),
                                            timeout_s=120))
    verdict = {(c.model, c.setting): (c.verdict, "") for c in analyze(transformer_run).cases.itertuples()}
    rows = pd.read_csv(transformer_run / "inconsistencies.csv")
    verdict.update({(r.model, r.setting): (verdict[(r.model, r.setting)][0], str(r.message)) for r in rows.itertuples()})
    for setting in TRANSFORMER_CLEAN:
        assert verdict[("transformer-s0-i0", setting)][0] == "ok", (setting, verdict[("transformer-s0-i0", setting)])
    assert verdict[("transformer-s0-i0", "tp/sequence-parallel/ws2")][0] == "ok"
    # tied embeddings: TP keeps them replicated, loss parallel and pipelines say why they cannot run
    assert verdict[("transformer-s0-i1-frozen", "tp/colwise-rowwise/ws2")][0] == "ok"
    assert verdict[("transformer-s0-i1-frozen", "tp/sequence-parallel/loss-parallel/ws2")][0] == "unsupported"
    assert "tied" in verdict[("transformer-s0-i1-frozen", "pipeline/1f1b/ws2/stages2/mb2/balanced")][1]
    # the library finding: SequenceParallel re-registers a norm's weight as a new Parameter that requires grad, so
    # the frozen attention norm trains (expected where difftest/findings/known_issues.toml says the installed torch has it)
    issue = next(i for i in known.manifest() if i.id == "sequence-parallel-unfreezes-norm")
    status, message = verdict[("transformer-s0-i1-frozen", "tp/sequence-parallel/ws2")]
    if issue.reproduces_on(known.installed_versions([issue.library])):
        assert status == "inconsistent" and known.match("tp/sequence-parallel/ws2", status, message,
                                                        traits_of("transformer")) == issue


@pytest.mark.heavy
def test_a_transformers_script_runs_its_own_tensor_parallel_plan_as_the_setting_does(transformer_run: Path) -> None:
    """The transformer's standalone form carries torchtitan's plan (`model_tp_plan`) and its layer chain: the scripts of
    tensor parallel (loss parallel too), FSDP2 over it and a pipeline reach the setting's verdict on the same case, where difftest does not
    import: the untied model trains as one process does, and SequenceParallel trains the tied model's frozen norm
    wherever the installed torch has that bug (the script then says BUG PRESENT, and the frozen norm's name)."""
    from difftest.contracts.tolerance import Tolerance
    from difftest.judging.analysis import envelope_spread
    from difftest.scripts.emit import MAX_LINES
    from difftest.scripts.write import emit

    cases = [("transformer-s0-i0", "tp/sequence-parallel/ws2"), ("transformer-s0-i0", "fsdp2-tp/dp2-tp2/colwise-rowwise/ws4"),
             ("transformer-s0-i1-frozen", "tp/sequence-parallel/ws2"),
             ("transformer-s0-i0", "pipeline/1f1b/ws2/stages2/mb2/balanced"),  # its layer chain, `model_chain`
             ("transformer-s0-i0", "tp/sequence-parallel/loss-parallel/ws2")]
    run_sweep(transformer_run, SweepOptions(pairs=tuple(cases), timeout_s=120))
    verdicts = analyze(transformer_run).cases.set_index(["model", "setting"])["verdict"]
    for number, (model, setting) in enumerate(cases):
        emitted = emit(transformer_run, f"T{number}", "a transformer finding", "inconsistent",
                       transformer_run / "models" / model, setting, "param_after_step1/norm.weight",
                       envelope_spread(transformer_run, model, setting), Tolerance(), check_timeout_s=180)
        assert emitted.path is not None and emitted.checked is not None, emitted.why_not
        text = emitted.path.read_text()
        assert "import difftest" not in text and text.count("\n") <= MAX_LINES
        assert ("def model_tp_plan(" in text) == ("tp/" in setting) and ("def model_chain(" in text) == ("pipeline" in setting)
        assert emitted.checked.exit_code == (0 if verdicts[(model, setting)] == "ok" else 1), \
            (setting, emitted.checked.output[-3000:])
        if verdicts[(model, setting)] != "ok":
            assert "BUG PRESENT" in emitted.checked.output
            assert re.search(r"attention_norm\.weight: [1-9]\d* of ", emitted.checked.output), emitted.checked.output
        if "loss-parallel" in setting:  # its loss on the sharded logits, not on logits gathered whole first
            assert "with stepping(module), loss_parallel():" in text and "keep_sharded=lambda: setting" in text


def test_a_distributed_resume_shards_a_tied_embedding_in_one_fsdp2_group(transformer_run: Path) -> None:
    """The tied, frozen transformer through DCP: FSDP2 2 -> 4 ranks and DDP -> FSDP2. The resume harness once wrapped
    every parameter holder, tied embedding and output projection apart: FSDP2 refused the tied weight ("shared with a
    parameter already managed by another FSDP group"), and the DDP checkpoint missed the output's momentum."""
    settings = ["resume/fsdp2-ws2/uninterrupted", "resume/fsdp2-ws2/fsdp2-ws4/k3", "resume/ddp-ws2/fsdp2-ws2/k3"]
    run_sweep(transformer_run, SweepOptions(settings=",".join(settings), models="transformer-s0-i1-frozen",
                                            timeout_s=120))
    verdict = {c.setting: c.verdict for c in analyze(transformer_run).cases.itertuples()
               if c.model == "transformer-s0-i1-frozen"}
    assert all(verdict[s] == "ok" for s in settings), verdict


class _Plain:
    """What a setting calls on a model, for a bare module of one dense input: forward(module, batch, device)."""

    @staticmethod
    def forward(module: Any, batch: Any, device: str) -> Any:
        import torch

        return module(torch.from_numpy(batch.dense))


def _ones_inputs() -> Any:
    from generators.inputs import Batch

    return type("Inputs", (), {"eval": Batch(labels=np.zeros(3, np.float32), dense=np.ones((3, 4), np.float32))})


def test_derived_tp_pairs_follow_the_data_flow() -> None:
    """Consecutive Linear children are paired only where the second reads what the first computed, alone, by steps
    nothing else reads: not across two branches, not around a residual."""
    import torch
    from torch import nn

    from settings._tp_plan import _feeding, linear_pairs

    class Net(nn.Module):
        def __init__(self, residual: bool) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
            self.residual = residual

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x))
            y = self.b(h) + (h if self.residual else 0)  # (a, b): a chain, unless h also skips around b
            return self.d(y) + self.c(x)  # (c, d): consecutive children, but d never reads c

    inputs = _ones_inputs()
    for residual, kept in ((False, [("a", "b")]), (True, [])):
        net = Net(residual)
        assert linear_pairs(net) == [("a", "b"), ("c", "d")]
        assert _feeding(_Plain, net, inputs, linear_pairs(net), "cpu") == kept


def test_models_of_sets_counts_per_kind(tmp_path: Path) -> None:
    from difftest.cli.main import _models_of
    from difftest.contracts.errors import UserError

    assert _models_of("transformer=3, keras-dag=0") == {"transformer": 3, "keras-dag": 0}
    with pytest.raises(UserError, match="kind=N"):
        _models_of("transformer")
    run_dir = tmp_path / "run"
    ids = generate(run_dir, RunConfig(seed=0, models=2, kinds=("dlrm", "transformer"), models_of={"transformer": 1}))
    assert ids == ["dlrm-s0-i0", "dlrm-s0-i1-frozen", "transformer-s0-i0"]
    assert RunConfig.load(run_dir / "run.json").count("transformer") == 1


def test_a_column_output_read_twice_is_not_paired() -> None:
    import torch
    from torch import nn

    from settings._tp_plan import _feeding, linear_pairs

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h) + h.sum()

    assert _feeding(_Plain, Net(), _ones_inputs(), linear_pairs(Net()), "cpu") == []


def _graph(proto: Any) -> tuple[Any, list[str]]:
    """An ONNX graph as the multiset of its computations, each named by its op, attributes and what it reads
    (recursively down to the inputs and the weights' values): equal for the same graph in any node order or naming."""
    import collections
    import hashlib

    from onnx import AttributeProto, helper, numpy_helper

    graph = proto.graph
    value = {x.name: f"input {i}" for i, x in enumerate(graph.input)}
    value |= {t.name: hashlib.sha1(numpy_helper.to_array(t).tobytes() + bytes(str(t.dims), "ascii")).hexdigest()
              for t in graph.initializer}
    computed: collections.Counter[str] = collections.Counter()
    pending = list(graph.node)
    while pending:
        ready = [n for n in pending if all(i in value or not i for i in n.input)]
        assert ready, "a cycle, or an input the graph lacks"
        for node in ready:
            attributes = sorted((a.name, repr(helper.get_attribute_value(a))) for a in node.attribute
                                if a.type != AttributeProto.TENSOR)
            tensors = sorted(numpy_helper.to_array(a.t).tobytes().hex() for a in node.attribute
                             if a.type == AttributeProto.TENSOR)
            key = hashlib.sha1(repr((node.op_type, [value.get(i, "") for i in node.input], attributes,
                                     tensors)).encode()).hexdigest()
            value |= {out: f"{key}:{k}" for k, out in enumerate(node.output)}
            computed[key] += 1
        pending = [n for n in pending if n not in ready]
    return computed, [value[o.name] for o in graph.output]


@pytest.mark.parametrize("kind", ("sequential", *KERAS_KINDS))
def test_the_export_runs_tf2onnx_optimizers_in_place_and_gets_its_default_graph(kind: str) -> None:
    """`export_onnx` lets tf2onnx optimize the graph without copying it before each optimizer (half a transformer's
    export): the same computations and outputs as tf2onnx's default way."""
    import onnx

    from generators import _tf
    from generators.sequential import OPSET, export_onnx

    tf, keras = _tf.import_tensorflow()  # first: it loads what must come before TensorFlow
    import tf2onnx
    generator = get_generator(kind)
    spec = generator.spec(0, 0)
    keras.utils.set_random_seed(0)
    model = generator.keras_model(spec)
    in_place = onnx.load_from_string(export_onnx(model, spec))
    source = spec.params["input"]
    signature = (tf.TensorSpec((None, *source["shape"]), tf.int32 if source["form"] == "tokens" else tf.float32,
                               name="x"),)
    default, _ = tf2onnx.convert.from_function(tf.function(lambda x: model(x, training=False)),
                                               input_signature=signature, opset=OPSET)
    assert _graph(in_place) == _graph(default)


@pytest.mark.needs_tf
def test_model_builders_keep_what_their_exports_leave_behind_and_remove_it_at_close(tmp_path: Path) -> None:
    """A builder process leaves through os._exit, so TensorFlow's autograph never deleted the source file it writes
    for each traced export (one in /tmp per Keras model a minimisation round built): it goes to the builders' folder."""
    from difftest.generation.generate import ModelBuilders

    generator = get_generator("sequential")
    builders = ModelBuilders(("generators",), processes=1)
    try:
        built = builders.build([(generator.spec(0, i), tmp_path / f"m{i}", 12) for i in range(2)])
        assert built == [None, None], built
        folder = Path(builders._temp_dir)
        assert any(p.name.startswith("__autograph_generated_file") for p in folder.iterdir())  # the builder's export
    finally:
        builders.close()
    assert not folder.exists()
