"""The runs the calibrated oracle (`difftest.judging.envelope`) measures a root computation's own noise with.

A root is a setting judged against itself (`reference`, `tf/reference`, an uninterrupted run, a simulator). Each
calibration runs that root's own code again, unchanged, with one thing changed around it:

* `calib-float64/<root>` — the model, its initial weights and its inputs in float64: the centre every setting
  judged down to this root is measured from;
* `calib-order/<root>` — fp32, the samples of every batch and the ids of every embedding bag in another (seeded)
  order, outputs put back in the original order: the summation order of every batch reduction (loss mean, weight
  gradients) and of every pooled bag changes;
* `calib-threads/<root>` — fp32 with 4 intra-op threads instead of 1: the kernels block their sums differently;
* `calib-microbatch/<root>` — fp32, every training forward run as two micro-batches whose predictions are
  concatenated: the same per-sample arithmetic, but each weight gradient is summed in two parts and then added, as
  gradient accumulation and data parallelism sum it (not on a model with BatchNorm, whose per-micro-batch
  statistics are other arithmetic);
* `calib-fp32-{a,b,c}/<root>` — float64 with Monte Carlo arithmetic at fp32's unit roundoff: every floating tensor a
  leaf module reads or writes and every gradient gets an independent relative error uniform in ±2⁻²⁴ (three seeds):
  how far rounding errors of fp32 size can carry the root, whatever kernels the machine's CPU happens to run. The
  three fp32 runs above change one freedom each but keep most roundings identical to the root's, so on a model that
  amplifies rounding (a keras-transformer's LayerNorm after four momentum steps multiplies a relative perturbation
  by ~1e4) they land together and miss how far a setting that rounds differently everywhere (FSDP2's update on
  sharded parameters; the same root on an AVX2 instead of an AVX-512 CPU) legitimately lands;
* `calib-bf16-{a,b,c}/<root>` — the same Monte Carlo arithmetic at bf16's unit roundoff, ±2⁻⁸: how far a
  legitimately bf16 computation of the root may land, for the bf16 settings; `calib-tf32-{a,b,c}/<root>` likewise at
  TF32's, ±2⁻¹¹, for a root run on CUDA with TF32 on (`settings.device`), and `calib-fp16-{a,b,c}/<root>` at fp16's,
  ±2⁻¹¹, for a setting that rounds what it sends to fp16 (TorchRec's quantized comms).

The fp32 runs and the root itself give the envelope of legitimate fp32 results; the `bf16` runs the bf16 one, and
so on. The
root's code is not told it is being calibrated: the model and inputs it receives are wrapped. A root that builds its
model somewhere this wrapper cannot reach (a fresh process) does not produce float64 outputs; that is checked, and
the calibration is then `unsupported` with the reason, so its dependants are judged by the fixed oracle only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import (
    UNIT_ROUNDOFF,
    Inputs,
    LoadedModel,
    ModelSpec,
    Outputs,
    Repeat,
    RunContext,
    Setting,
    SettingRole,
    Unsupported,
    features_of,
    register_calibration,
)
from generators.inputs import Batch

# the Monte Carlo modes: name prefix -> unit roundoff
MONTE_CARLO = dict(UNIT_ROUNDOFF)
THREADS = 4
EVAL_PHASES = ("eval_",)  # phases whose tensors have one row per eval sample
# how torch refuses float64 to a kernel that has no such implementation ("got Double", "not implemented for 'Double'")
FLOAT64_REFUSED = re.compile(r"\bgot Double\b|not implemented for 'Double'|\bDouble\b.*\bnot supported\b")


@dataclass(frozen=True)
class Calibration(Repeat):
    """A root computation again, in float64 or with one legitimate freedom of fp32 arithmetic changed."""

    base: Setting
    mode: str  # float64 | order | threads | microbatch | fp32-{a,b,c} | bf16-{a,b,c} | bf16-op-{a,b,c}
    family: ClassVar[str] = "calibration"
    deterministic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return f"calib-{self.mode}/{self.base.name}"

    @property
    def precision(self) -> str:  # type: ignore[override]
        return "float64" if self.float64 else "fp32"

    @property
    def role(self) -> SettingRole:
        return SettingRole.CALIBRATION

    @property
    def monte_carlo_unit(self) -> float | None:
        return MONTE_CARLO.get(self.mode.split("-")[0])

    @property
    def every_operation(self) -> bool:
        return "-op-" in self.mode

    @property
    def float64(self) -> bool:
        return self.mode == "float64" or self.monte_carlo_unit is not None

    def judges(self, tensor_name: str) -> bool:
        # a calibration run is a measurement of its root's noise, not a claim: a Monte Carlo bf16 run is meant to be off
        # by bf16's noise, the float64 run by the base's own rounding error, and a reordered, threaded or micro-batched
        # fp32 run by as much as the base's arithmetic allows, which is past D3's atol where the base is
        # ill-conditioned (a keras-transformer's LayerNorm after four momentum steps: 8.6e-4 from float64). Only the
        # oracle's envelope reads them; a verdict of theirs would be a false alarm.
        return False

    def supports(self, spec: ModelSpec) -> str | None:
        if self.mode == "microbatch" and "BatchNorm" in features_of(spec):
            return ("the model's BatchNorm normalises each micro-batch by that micro-batch's statistics: two "
                    "micro-batches are not its root's per-sample arithmetic, so they measure none of its noise")
        return super().supports(spec)

    def describe(self) -> str:
        unit = self.mode.split("-")[0]
        if self.every_operation:
            return f"{self.base.name} again, float64 with Monte Carlo rounding errors of {unit} size on every operation"
        return f"{self.base.name} again, {_DESCRIPTIONS[unit]}"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        order = None
        if self.float64:
            model, inputs = _Float64Model(model), _cast_inputs(inputs, np.float64)
        elif self.mode == "microbatch":
            model = _MicroBatchedModel(model)
        elif self.mode == "order":
            rng = np.random.default_rng([ctx.seed, 7])
            (train, _), (evaluated, order) = inputs.train.reordered(rng), inputs.eval.reordered(rng)
            inputs = Inputs(train, evaluated)
        with self._arithmetic():
            try:
                outputs = self.base.run(ctx, model, inputs)
            except RuntimeError as exc:
                if self.float64 and FLOAT64_REFUSED.search(str(exc)):
                    # a kernel made for training precisions only (transformers' experts call torch._grouped_mm): the
                    # root's noise cannot be measured this way, which is no finding; its dependants are judged by
                    # the fixed oracle
                    raise Unsupported(f"{self.base.name} cannot run in float64 on this model: "
                                      f"{str(exc).strip().splitlines()[0][:200]}") from None
                raise
        if outputs is None:
            return None
        if self.float64:
            narrower = sorted(n for n, v in outputs.items() if v.dtype.kind == "f" and v.dtype != np.float64)
            if narrower:
                raise Unsupported(f"{self.base.name} does not compute in float64 when its model is (e.g. "
                                  f"{narrower[0]} is {outputs[narrower[0]].dtype}): it builds its model where the "
                                  "calibration cannot reach")
        if order is not None:
            outputs = {n: _unpermute(v, order, inputs.eval.size) if n.startswith(EVAL_PHASES) else v
                       for n, v in outputs.items()}
        return outputs

    @contextlib.contextmanager
    def _arithmetic(self) -> Iterator[None]:
        import torch

        if self.mode == "threads":
            before = torch.get_num_threads()
            torch.set_num_threads(THREADS)
            try:
                yield
            finally:
                torch.set_num_threads(before)
        elif (unit := self.monte_carlo_unit) is not None:
            with _monte_carlo_rounding(unit, seed=ord(self.mode[-1]) + 100 * self.every_operation,
                                      every_operation=self.every_operation):
                yield
        else:
            yield


_DESCRIPTIONS = {"float64": "in float64 (the calibrated oracle's centre)",
                 "microbatch": "fp32 with every training forward run as two micro-batches",
                 "order": "fp32 with the samples of every batch in another order",
                 "threads": f"fp32 with {THREADS} intra-op threads",
                 **{unit: f"float64 with Monte Carlo rounding errors of {unit} size on every module tensor and gradient"
                    for unit in MONTE_CARLO}}


def _unpermute(value: np.ndarray, order: np.ndarray, samples: int) -> np.ndarray:
    if value.ndim == 0 or value.shape[0] != samples:
        return value
    restored = np.empty_like(value)
    restored[order] = value
    return restored


def _cast_inputs(inputs: Inputs, dtype: Any) -> Inputs:
    return Inputs(_cast_batch(inputs.train, dtype), _cast_batch(inputs.eval, dtype))


def _cast_batch(batch: Batch, dtype: Any) -> Batch:
    def cast(array: np.ndarray | None) -> np.ndarray | None:
        return array.astype(dtype) if array is not None and array.dtype.kind == "f" else array

    sparse = {name: dataclasses.replace(f, weights=cast(f.weights)) for name, f in batch.sparse.items()}
    named = {name: array.astype(dtype) if array.dtype.kind == "f" else array for name, array in batch.named.items()}
    return Batch(cast(batch.labels), cast(batch.dense), sparse, named)


class _Float64Model(LoadedModel):
    """The same model, built in float64: PyTorch modules are converted after building, Keras models are built with
    float64 as their float type."""

    def __init__(self, model: LoadedModel) -> None:
        super().__init__(model.spec, _Float64Generator(model.generator), model.init_state, model.model_dir)

    def build(self, device: str, **options: Any) -> Any:
        return _in_float64(super().build(device, **options))

    def chain(self, device: str) -> Any:
        chain = super().chain(device)
        for unit in chain.units:
            _in_float64(unit)
        return chain


def _in_float64(module: Any) -> Any:
    """`module.double()`, and its TorchRec embedding bag collections pooling in float64: their forward casts the
    pooled embeddings to float32 (`.float()` in `EmbeddingBagCollection.forward`), which would make the float64
    centre an fp32 one at every lookup."""
    module.double()
    try:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
    except ImportError:
        return module
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            sub.forward = types.MethodType(_pool_in_own_dtype, sub)
    return module


def _pool_in_own_dtype(collection: Any, features: Any) -> Any:
    """`EmbeddingBagCollection.forward` without its cast to float32, through the collection's public API."""
    import torch
    from torchrec.modules.embedding_modules import get_embedding_names_by_table
    from torchrec.sparse.jagged_tensor import KeyedTensor

    if features.inverse_indices_or_none() is not None:
        raise Unsupported("float64 pooling of a KJT with inverse indices (variable batch) is not implemented")
    configs = collection.embedding_bag_configs()
    by_feature = features.to_dict()
    pooled, lengths = [], []
    for config, bag in zip(configs, collection.embedding_bags.values()):
        for feature in config.feature_names:
            f = by_feature[feature]
            pooled.append(bag(input=f.values(), offsets=f.offsets(),
                              per_sample_weights=f.weights() if collection.is_weighted() else None))
            lengths.append(config.embedding_dim)
    keys = [name for names in get_embedding_names_by_table(configs) for name in names]
    return KeyedTensor(keys=keys, values=torch.cat(pooled, dim=1), length_per_key=lengths)


class _MicroBatchedModel(LoadedModel):
    """The same model whose forward runs its batch as two halves and concatenates the predictions."""

    PARTS = 2

    def __init__(self, model: LoadedModel) -> None:
        super().__init__(model.spec, model.generator, model.init_state, model.model_dir)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        import torch

        if batch.size % self.PARTS:
            return super().forward(module, batch, device)
        return torch.cat([super(_MicroBatchedModel, self).forward(module, batch.shard(i, self.PARTS), device)
                          for i in range(self.PARTS)])


class _Float64Generator:
    def __init__(self, generator: Any) -> None:
        self._generator = generator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def keras_model(self, spec: Any, state: dict[str, np.ndarray] | None = None) -> Any:
        return self._generator.keras_model(spec, state, dtype="float64")


# aten operations whose results real arithmetic rounds: the pointwise ones (by their tag) but those that are exact
# (selections, comparisons, sign changes), and by name sums, products, normalisations, softmax and attention
_EXACT = frozenset({"relu", "threshold_backward", "where", "masked_fill", "clamp", "clamp_min", "clamp_max", "abs",
                    "neg", "maximum", "minimum", "sign", "fill", "copy", "hardtanh", "hardtanh_backward", "ceil",
                    "floor", "round", "trunc", "le", "lt", "ge", "gt", "eq", "ne", "logical_not", "logical_and",
                    "logical_or", "isnan", "isinf", "bitwise_not", "_to_copy", "clone", "lift_fresh_copy"})
_ROUNDING = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "dot", "mv", "addmv", "_grouped_mm", "convolution", "convolution_backward",
    "sum", "mean", "var", "var_mean", "std", "std_mean", "prod", "cumsum", "linalg_vector_norm", "norm",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm",
    "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward", "native_batch_norm",
    "native_batch_norm_backward", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_fused_rms_norm", "_fused_rms_norm_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "embedding_dense_backward", "_embedding_bag",
    "_embedding_bag_backward", "_embedding_bag_dense_backward", "index_add", "scatter_add", "scatter_reduce",
    "mse_loss", "mse_loss_backward", "nll_loss_forward", "nll_loss_backward", "binary_cross_entropy",
    "binary_cross_entropy_backward", "binary_cross_entropy_with_logits", "avg_pool2d", "avg_pool2d_backward",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward"})


def _rounds(func: Any) -> bool:
    import torch

    if func.namespace != "aten":  # collectives and library kernels: what they compute is theirs to round
        return False
    name = func._overloadpacket.__name__.rstrip("_")
    return name in _ROUNDING or (torch.Tag.pointwise in func.tags and name not in _EXACT)


@contextlib.contextmanager
def _every_operation_perturbed(noise: Callable[[Any], Any]) -> Iterator[None]:
    """`noise(tensor)` (the relative error of one rounding) applied to every floating result of an aten operation that
    rounds (`_rounds`), forward and backward, but inside an optimizer's step: the settings update fp32 parameters."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    stepping = [False]

    def perturbed(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0

    class Rounding(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if stepping[0] or not _rounds(func):
                return out
            results = out if isinstance(out, tuple) else (out,)
            changed = []
            for value, returned in zip(results, func._schema.returns, strict=False):
                alias = returned.alias_info
                if perturbed(value) and alias is not None and alias.is_write:  # in place: round it there
                    value.mul_(noise(value))
                elif perturbed(value) and alias is None:  # a fresh result (a view is its base's, left alone)
                    value = value * noise(value)
                changed.append(value)
            changed += results[len(changed):]
            return tuple(changed) if isinstance(out, tuple) else changed[0]

    handles = [register_optimizer_step_pre_hook(lambda *_: stepping.__setitem__(0, True)),
               register_optimizer_step_post_hook(lambda *_: stepping.__setitem__(0, False))]
    try:
        with Rounding():
            yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _monte_carlo_rounding(unit: float, seed: int, every_operation: bool = False) -> Iterator[None]:
    """Every floating tensor a leaf module reads or writes (scalar constants aside), and every parameter gradient, times
    (1 + d), d uniform in [-unit, unit], independently per element (Parker's Monte Carlo arithmetic at module
    granularity); with `every_operation`, every rounding operation's result too (`_every_operation_perturbed`)."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    generator = torch.Generator().manual_seed(seed)
    hooked: set[int] = set()
    handles: list[Any] = []

    def noisy(value: Any) -> Any:
        # a 0-d tensor a module reads is one of the program's constants (an exponent, an epsilon, a scale): real
        # arithmetic never rounds it differently, and a perturbed exponent (x ** 2.9999998 for x < 0) is NaN
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
            noise = torch.rand(value.shape, generator=generator, dtype=torch.float64) * (2 * unit) - unit
            return value * (1 + noise.to(value.device, value.dtype))
        if isinstance(value, tuple):
            return tuple(noisy(v) for v in value)
        return value

    def leaf(module: Any) -> bool:
        return next(iter(module.children()), None) is None

    def before(module: Any, args: tuple) -> Any:
        if not leaf(module):
            return None
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in hooked:
                hooked.add(id(param))
                handles.append(param.register_hook(noisy))
        return noisy(args)

    def after(module: Any, args: tuple, output: Any) -> Any:
        return noisy(output) if leaf(module) else None

    def factor(value: Any) -> Any:
        noise = torch.rand(value.shape, generator=generator, dtype=torch.float64) * (2 * unit) - unit
        return (1 + noise).to(value.device, value.dtype)

    handles += [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
    try:
        with _every_operation_perturbed(factor) if every_operation else contextlib.nullcontext():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _calibration(base: Setting, mode: str) -> Calibration | None:
    """None where the freedom does not exist or cannot be reached: TensorFlow fixes its thread pools when it starts,
    and trains its Keras model directly (no module hooks, no `forward` to split); a root whose result depends on which
    samples share a micro-batch or replica has no free sample order."""
    if (mode in ("threads", "microbatch") or mode.split("-")[0] in MONTE_CARLO) and base.framework != "torch":
        return None
    if mode == "order" and not base.sample_order_free:
        return None
    return Calibration(base, mode)


for _mode, _needed_by in (("float64", ("fp32", "tf32", "fp16", "bf16")), ("order", ("fp32",)), ("threads", ("fp32",)),
                          ("microbatch", ("fp32",)),
                          ("fp32-a", ("fp32",)), ("fp32-b", ("fp32",)), ("fp32-c", ("fp32",)),
                          ("tf32-a", ("tf32",)), ("tf32-b", ("tf32",)), ("tf32-c", ("tf32",)),
                          ("fp16-a", ("fp16",)), ("fp16-b", ("fp16",)), ("fp16-c", ("fp16",)),
                          ("bf16-a", ("bf16",)), ("bf16-b", ("bf16",)), ("bf16-c", ("bf16",)),
                          # bf16 rounds every operation's result (parameters, activations and gradients all bf16), and
                          # a module's functional arithmetic between its leaves (attention) as much as its leaves: at
                          # bf16's size the module granularity alone under-states the noise (timm's ViT under FSDP2's
                          # bf16 policy: 1.59x that envelope, bitwise what the model cast to bf16 gives in one
                          # process); these runs add every operation, the three above keep their draws
                          ("bf16-op-a", ("bf16",)), ("bf16-op-b", ("bf16",)), ("bf16-op-c", ("bf16",))):
    register_calibration(f"calib-{_mode}", lambda base, mode=_mode: _calibration(base, mode), _needed_by,
                         centre=_mode == "float64")
