"""Your own model as a difftest kind, in about twenty lines: `ModelAdapter`.

A user gives a seeded module factory, a seeded batch maker and a loss (optionally the names of the module's repeated
blocks, for FSDP2's units and activation checkpointing, and of frozen parameters); the adapter turns them into a
model kind every setting family can take (`AdapterGenerator`), without writing the generator protocol. Run it with
`difftest run --model mypkg.models:adapter` (the module imported in every rank, the adapter registered by name):

    import torch
    from difftest import ModelAdapter

    def make_model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def make_batch(seed, size):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)

    adapter = ModelAdapter("my-mlp", make_model, make_batch, torch.nn.functional.mse_loss)

A batch is (inputs, target): the inputs a tensor, a tuple of tensors (the module's positional arguments) or a dict of
tensors (its keyword arguments: ids, masks, several inputs), every tensor split along dimension 0 by every setting.
`layers` (submodule names whose composition, in order, is the forward) lets pipelines cut the model into stages; `tp_plan(module, world_size)` (module
name → ParallelStyle, as the model's authors parallelize it) is what tensor parallelism and FSDP2 × TP run, instead
of a plan derived from consecutive Linear layers. What the adapter does not give, a setting that needs it refuses as
`unsupported` with the reason. Minimisation shrinks what difftest controls — the batch and the world size — not the
model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from difftest.contracts import adapter_script
from difftest.contracts.batch import POSITIONAL, Batch
from difftest.contracts.errors import Unsupported, UserError
from difftest.contracts.generator import Generator, ModelCode
from difftest.contracts.spec import ModelSpec

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class ModelAdapter:
    """A user's model, as difftest takes it: `model(seed)` returns a fresh `nn.Module` (its weights drawn from the
    seed), `batch(seed, size)` an (input, target) pair of tensors of `size` samples, `loss(prediction, target)` the mean
    loss; `blocks` names the repeated blocks (FSDP2's units, activation checkpointing), `frozen` the parameters that
    do not train, `layers` the submodules whose composition is the forward (pipelines), `tp_plan(module, world_size)`
    the model's own tensor-parallel plan; `prediction(output)` the prediction tensor of a module whose forward
    returns an object (a dataclass, a model output), taken outside the setting's wrapper as a training loop does;
    `chain(module)` the module as a list of units for pipelines where its forward is more than its layers in order
    (the first unit takes the batch's inputs as the module does, by position or keyword, every next one what the
    previous returned, the last the prediction): checked to compute the module's forward before a pipeline uses it."""

    name: str
    model: Callable[[int], Any]
    batch: Callable[[int, int], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]
    blocks: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    tp_plan: Callable[[Any, int], dict[str, Any]] | None = None
    prediction: Callable[[Any], Any] | None = None
    chain: Callable[[Any], list[Any]] | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise UserError(f"ModelAdapter name {self.name!r}: use lower-case letters, digits and dashes, starting "
                            "with a letter (it names the kind and the run's model folders)")

    def register_as_kind(self) -> None:
        """Register the adapter as a model kind (what `--model module:attribute` and `--plugin` call)."""
        from difftest.contracts.registry import generator_kinds, register_generator

        if self.name not in generator_kinds():
            register_generator(self.name, AdapterGenerator(self))


def _seeds(spec: ModelSpec) -> tuple[int, int, int]:
    """The seeds of a spec's model, training batch and evaluation batch."""
    base = (spec.seed * 1000 + spec.index) * 10
    return base, base + 1 + spec.input_seed * 2, base + 2 + spec.input_seed * 2


def _numpy(value: Any, what: str, name: str) -> np.ndarray:
    try:
        return np.ascontiguousarray(value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value))
    except Exception as exc:  # a user's object of another type: one line naming the adapter
        raise UserError(f"adapter {name!r}: its batch's {what} is not a tensor or array ({type(value).__name__}: "
                        f"{exc})") from None


def _inputs(batch: Batch, device: str, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """A batch's inputs as the module takes them: one tensor, positional tensors, or keyword ones (floats in the
    module's dtype: the float64 calibration runs the same batch)."""
    import torch

    def tensor(array: np.ndarray) -> Any:
        x = torch.as_tensor(array, device=device)
        return x.to(dtype) if x.is_floating_point() else x

    if not batch.named:
        assert batch.dense is not None  # an adapter batch holds one tensor or named ones
        return tensor(batch.dense), {}
    positional = tuple(tensor(batch.named[f"{POSITIONAL}{i}"]) for i in range(len(batch.named))
                       if f"{POSITIONAL}{i}" in batch.named)
    return positional, {k: tensor(v) for k, v in batch.named.items() if not k.startswith(POSITIONAL)}


def _input_dtype(module: Any) -> Any:
    """The floating dtype the module computes in: its first floating parameter's or buffer's; else the default one (a
    dynamically quantized model of Linear layers alone holds packed weights, no parameter, and takes float inputs)."""
    import itertools

    import torch

    held = itertools.chain(module.parameters(), module.buffers())
    return next((t.dtype for t in held if t.is_floating_point()), torch.get_default_dtype())


def _call(module: Any, batch: Batch, device: str, dtype: Any) -> Any:
    inputs, keywords = _inputs(batch, device, dtype)
    return module(*inputs, **keywords) if isinstance(inputs, tuple) else module(inputs, **keywords)


# the layer kinds `batch_dependent_layers` reads (what difftest/findings/model_semantics.toml's entries name)
BATCH_DEPENDENT_LAYERS = ("BatchNorm", "Dropout")


def batch_dependent_layers(module: Any) -> list[str]:
    """The layer kinds of `module` whose training forward computes a sample's result from the other samples of its
    batch or from a random draw: "BatchNorm" (the batch's statistics) and "Dropout" (a mask drawn per call). Split the
    batch over ranks or micro-batches and they compute something else, by design: triage names them as the cause."""
    import torch

    found = set()
    for layer in module.modules():
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):  # SyncBatchNorm too
            found.add("BatchNorm")
        elif isinstance(layer, torch.nn.modules.dropout._DropoutNd) and layer.p > 0:
            found.add("Dropout")
    return sorted(found)


# the trait of a user's model whose forward returns an object its adapter's `prediction` reads the tensor from
OUTPUT_OBJECT = "output-object"
# the feature a model has when its adapter's loss adds its samples' losses
SUMMED_LOSS = "SummedLoss"
# every feature of a user's model that difftest/findings/model_semantics.toml's entries may name
MODEL_FEATURES = (*BATCH_DEPENDENT_LAYERS, SUMMED_LOSS)


def loss_sums_over_the_batch(loss: Callable[[Any, Any], Any], prediction: Any, target: Any) -> bool:
    """Whether `loss` on the whole batch is the sum of its losses on the two halves rather than their mean: a loss that
    sums makes every rank's gradient a sum over its share, so averaging them over N ranks (DDP, FSDP) or micro-batches
    gives 1/N of the one process's gradient. Undecided (False) when the halves' losses add up to about nothing."""
    # in float64: a bf16 or fp16 model's losses would round the sum of the halves by more than the test's margin
    prediction = prediction.double() if prediction.is_floating_point() else prediction
    target = target.double() if target.is_floating_point() else target
    half = len(prediction) // 2
    whole, first, second = (float(loss(p, t)) for p, t in ((prediction, target), (prediction[:half], target[:half]),
                                                           (prediction[half:], target[half:])))
    added = first + second
    if not abs(added) > 1e-6 * max(abs(first), abs(second), 1e-30):
        return False
    return abs(whole - added) <= 1e-4 * abs(added) < abs(whole - added / 2)


class AdapterGenerator(Generator):
    """The generator protocol over a `ModelAdapter`."""

    traits = frozenset({"torch", "user"})

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.kind = adapter.name
        if adapter.blocks:  # activation checkpointing wraps them
            self.traits = self.traits | {"blocks"}
        if adapter.prediction is not None:  # the manifest names it: wrappers that mishandle a forward's object
            self.traits = self.traits | {OUTPUT_OBJECT}

    def spec(self, seed: int, index: int) -> ModelSpec:
        spec = ModelSpec(kind=self.kind, seed=seed, index=index, params={}, frozen=tuple(self.adapter.frozen))
        # read once, where the model is made: triage and the settings read them without building the module
        module = self._module(spec)
        spec.params["layers"] = batch_dependent_layers(module) + (
            [SUMMED_LOSS] if self._loss_sums(module, spec) else [])
        return spec

    def _loss_sums(self, module: Any, spec: ModelSpec) -> bool:
        """Whether the adapter's loss adds its samples' losses instead of averaging them (`loss_sums_over_the_batch`
        on the model's prediction for a batch of four, in eval mode); a model or loss that fails here is left to fail
        in the cases, where its failure is recorded."""
        import torch

        batch = self.inputs(spec, 4)["train"]  # a batch that does not fit is one line, before any sweep
        try:
            module.eval()
            with torch.no_grad():
                prediction = self._prediction(_call(module, batch, "cpu", _input_dtype(module)))
                target = torch.as_tensor(batch.labels)
                target = target.to(prediction.dtype) if target.is_floating_point() else target
                return loss_sums_over_the_batch(self.adapter.loss, prediction, target)
        except UserError:  # an output that is no tensor: one line, before any sweep
            raise
        except Exception:  # a probe: the sweep runs the model and records its own failure
            return False

    def _module(self, spec: ModelSpec) -> Any:
        import torch

        module = self.adapter.model(_seeds(spec)[0])
        if not isinstance(module, torch.nn.Module):
            raise UserError(f"adapter {self.kind!r}: model(seed) returned a {type(module).__name__}, not a "
                            "torch.nn.Module")
        return module

    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        return {name: t.detach().cpu().numpy().copy() for name, t in self._module(spec).state_dict().items()}

    def inputs(self, spec: ModelSpec, batch_size: int) -> dict[str, Batch]:
        batches = {}
        for split, seed in zip(("train", "eval"), _seeds(spec)[1:], strict=True):
            made = self.adapter.batch(seed, batch_size)
            if not (isinstance(made, tuple | list) and len(made) == 2):
                raise UserError(f"adapter {self.kind!r}: batch(seed, size) must return (inputs, target), not "
                                f"{type(made).__name__}")
            given, y = made[0], _numpy(made[1], "target", self.kind)
            named = ({str(k): v for k, v in given.items()} if isinstance(given, dict) else
                     {f"{POSITIONAL}{i}": v for i, v in enumerate(given)} if isinstance(given, tuple | list) else {})
            arrays = {k: _numpy(v, f"input {k!r}", self.kind) for k, v in named.items()}
            x = None if named else _numpy(given, "inputs", self.kind)
            for what, array in [("target", y), *([("inputs", x)] if x is not None else arrays.items())]:
                if array.ndim == 0 or len(array) != batch_size:
                    raise UserError(f"adapter {self.kind!r}: batch(seed, {batch_size}) gave {what} of shape "
                                    f"{array.shape}; every tensor of a batch must have {batch_size} samples first")
            batches[split] = Batch(labels=y.astype(np.float32) if y.dtype.kind == "f" else y, dense=x, named=arrays)
        return batches

    def build(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None,
              **options: Any) -> Any:
        import torch

        module = self._module(spec)
        module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init_state.items()})
        for name, parameter in module.named_parameters():
            if name in spec.frozen:
                parameter.requires_grad_(False)
        return module.to(device)

    _unwrap = staticmethod(adapter_script._unwrap)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        return self._prediction(_call(module, batch, device, _input_dtype(module)))

    def _prediction(self, output: Any) -> Any:
        """The prediction tensor of the module's output: the output itself, or what the adapter's `prediction` takes
        from it."""
        import torch

        try:
            prediction = output if self.adapter.prediction is None else self.adapter.prediction(output)
        except Exception as exc:  # the user's function: one line naming the adapter
            raise UserError(f"adapter {self.kind!r}: prediction(output) raised {type(exc).__name__}: {exc} on a "
                            f"{type(output).__name__}") from None
        if not isinstance(prediction, torch.Tensor):
            hint = ("its prediction(output) returned" if self.adapter.prediction is not None
                    else "the module's forward returned")
            raise UserError(f"adapter {self.kind!r}: {hint} a {type(prediction).__name__}, not a tensor; give "
                            "ModelAdapter(..., prediction=lambda output: output.<the prediction tensor>)")
        return prediction

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        # as its user evaluates it: in eval mode (BatchNorm by its running statistics, no Dropout, neither changing
        # the model), then back to training
        training = module.training
        module.eval()
        try:
            return {"prediction": self.forward(module, batch, device)}
        finally:
            module.train(training)

    def loss(self, prediction: Any, batch: Batch) -> Any:
        import torch

        target = torch.as_tensor(batch.labels, device=prediction.device)
        return self.adapter.loss(prediction, target.to(prediction.dtype) if target.is_floating_point() else target)

    def parameters(self, module: Any) -> dict[str, Any]:
        return dict(self._unwrap(module).named_parameters())

    def blocks(self, module: Any) -> list[tuple[str, Any]] | None:
        inner = self._unwrap(module)
        return [(name, inner.get_submodule(name)) for name in self.adapter.blocks] or None

    def features(self, spec: ModelSpec) -> list[str]:
        return list(spec.params.get("layers", ()))

    def size(self, spec: ModelSpec) -> dict[str, int]:
        return {"parameters": sum(int(np.prod(v.shape)) for v in self.init_state(spec).values())}

    def frozen_names(self, params: dict[str, Any]) -> set[str]:
        return set()  # the adapter says what is frozen; difftest draws no frozen variant of a user's model

    def chain(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None) -> Any:
        """The model cut at its `layers` (or into the adapter's `chain` of units): the first unit reads the batch's
        inputs at the positions it is given and runs the first layer, every next unit is the next layer."""

        from difftest.contracts.chain import BatchSource, FedUnit, LayerChain

        if not self.adapter.layers and self.adapter.chain is None:
            raise Unsupported(f"adapter {self.kind!r} gives no layer list: a pipeline needs "
                              "ModelAdapter(layers=(...)), the submodules whose composition is the forward")
        module = self.build(spec, init_state, device)
        if self.adapter.chain is not None:
            layers = list(self.adapter.chain(module))
        else:
            layers = [module.get_submodule(name) for name in self.adapter.layers]
            if any(not name.startswith(POSITIONAL) for name in self.inputs(spec, 2)["train"].named):
                raise Unsupported(f"adapter {self.kind!r}: its first layer takes keyword inputs; a pipeline stage is "
                                  "fed one tensor or positional ones")
        held = {id(p) for layer in layers for p in layer.parameters()}
        outside = [name for name, p in module.named_parameters() if id(p) not in held]
        if outside:
            raise Unsupported(f"adapter {self.kind!r}: parameters outside its layers ({', '.join(outside[:3])}): a "
                              "pipeline stage would not own them")
        source = BatchSource()
        dtype = _input_dtype(module)

        def inputs_at(positions: Any) -> Any:
            positional, keywords = _inputs(source.samples(positions), device, dtype)
            return keywords or positional

        chain = LayerChain([FedUnit(inputs_at, layers[0]), *layers[1:]], source,
                           lambda: dict(module.named_parameters()), "prediction")
        if self.adapter.chain is not None:
            self._check_chain(spec, module, chain, device)
        return chain

    def _check_chain(self, spec: ModelSpec, module: Any, chain: Any, device: str) -> None:
        """The adapter's units, composed, must compute what the module's forward does on a batch (to the bit: the same
        operations in the same order), else a pipeline would be judged for the adapter's mistake."""
        import torch

        batch = self.inputs(spec, 2)["train"]
        chain.feed(batch)
        module.eval()
        try:
            with torch.no_grad():
                value: Any = torch.arange(2, device=device)
                for unit in chain.units:
                    value = unit(*value) if isinstance(value, tuple) else unit(value)
                whole = self.forward(module, batch, device)
        finally:
            module.train()
        if not (isinstance(value, torch.Tensor) and value.shape == whole.shape and torch.equal(value, whole)):
            off = float((value - whole).abs().max()) if isinstance(value, torch.Tensor) and \
                value.shape == whole.shape else float("nan")
            raise Unsupported(f"adapter {self.kind!r}: its chain of units does not compute the module's forward "
                              f"(largest difference {off:.3g}): a pipeline would be judged for the chain's mistake")

    def standalone_model(self, spec: ModelSpec, init_state: dict[str, np.ndarray], model_dir: Any,
                         train: Batch) -> ModelCode:
        """The user's model as a script builds it without difftest: the adapter's callables copied from the user's
        module (with what they read there) or imported from their library (`difftest.contracts.user_code`), the
        case's weights and training batch in the script's data."""
        from difftest.contracts import adapter_script as script
        from difftest.contracts.user_code import user_code

        adapter = self.adapter
        code = user_code(self.kind, {"model": adapter.model, "loss": adapter.loss, "prediction": adapter.prediction,
                                     "tp_plan": adapter.tp_plan, "chain": adapter.chain})
        module = self.build(spec, init_state, "cpu")
        return ModelCode(
            summary=f"The model is the user's {type(module).__name__} ({code.named['model']}(seed) of its module, "
                    f"the case's weights loaded), trained with {code.named['loss']}.",
            libraries=(), preamble=(*code.imports, f"POSITIONAL = {POSITIONAL!r}  # an input passed by position"),
            functions=(*code.definitions, code.binding(), script._unwrap, script._batch_inputs, script.build_model,
                       script.prediction_loss, script.model_loss, script.model_parameters,
                       *((script.model_tp_plan,) if adapter.tp_plan is not None else ())),
            chain=(script.model_chain,) if adapter.layers or adapter.chain is not None else (),
            case={"seed": _seeds(spec)[0], "frozen": list(spec.frozen), "layers": list(adapter.layers)},
            data={**{f"state.{k}": v for k, v in init_state.items()}, **train.to_arrays("train")},
            parameters=tuple(self.parameters(module)))

    def tp_plan(self, module: Any, world_size: int, sequence_parallel: bool,
                loss_parallel: bool) -> dict[str, Any] | None:
        if self.adapter.tp_plan is None:
            return None  # the setting derives one from consecutive Linear layers
        if sequence_parallel or loss_parallel:
            raise Unsupported(f"adapter {self.kind!r} gives a tensor-parallel plan, not a sequence- or loss-parallel "
                              "one")
        return self.adapter.tp_plan(self._unwrap(module), world_size)
