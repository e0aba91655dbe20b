"""The contract between the engine and a model kind.

A generator makes models of one kind, reproducibly from (seed, index), and knows how to run them in PyTorch. It
subclasses `Generator` and registers one instance (`difftest.contracts.registry.register_generator`). The abstract methods are
what every kind must do; the others are capabilities with a neutral default, which a kind overrides to declare it
has them (minimisation needs `size` and `reductions`, triage reads `features`, `tensor_order` and `tensor_class`,
pipeline settings need `chain`, …). The engine asks these methods and never a kind's name or its tensor names.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np

    from difftest.contracts.batch import Batch
    from difftest.contracts.spec import ModelSpec

# where a tensor of no declared stage sits: after every stage a kind declares
UNPLACED = 9


@dataclass(frozen=True)
class EmbeddingTable:
    """One TorchRec embedding table of a model, as a script outside difftest rebuilds it."""

    collection: str  # the qualified name of its EmbeddingBagCollection in the model (where a sharding plan names it)
    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: str  # a torchrec PoolingType name: "SUM", "MEAN"
    features: tuple[str, ...]
    weighted: bool
    outputs: tuple[str, ...]  # the names `evaluate` records each feature's pooled embedding under

    @property
    def state_key(self) -> str:
        return f"{self.collection}.embedding_bags.{self.name}.weight"


@dataclass(frozen=True)
class ModelCode:
    """A model as a script outside difftest builds and trains it (`difftest.scripts.emit`): functions copied from the
    kind's own modules, among them `build_model(data, case, dtype)` (the module, in `dtype`), `model_loss(module,
    data, start, stop, dtype)` (the loss of training samples start..stop, as `forward` then `loss` compute it) and
    `model_parameters(module)` (canonical name → tensor, as `parameters` reads them through any wrapper)."""

    summary: str  # what the model is, for the script's docstring
    libraries: tuple[str, ...]  # the distributions it needs beyond torch and numpy (pip names)
    preamble: tuple[str, ...]  # module-level imports its functions use
    functions: tuple[Any, ...]  # copied in this order
    case: dict[str, Any]  # what the functions read from `CASE`
    data: dict[str, Any]  # arrays they read from the script's data: the weights, the training batch
    parameters: tuple[str, ...]  # the canonical names `model_parameters` returns
    # the model as the layer chain a pipeline splits (`Generator.chain`), where the kind has one: functions defining
    # `model_chain(module, data, fed, dtype)` (the units of `module`, the first reading the samples of the batch
    # `fed["split"]` of the script's data at the positions it is given) and `prediction_loss(prediction, labels)`
    chain: tuple[Any, ...] = ()


class Generator(abc.ABC):
    """Base class of every model kind's generator."""

    kind: str  # the name it registers under, which model ids begin with
    # what its models are made of ("torch", "torchrec", "keras", "transformer"; "blocks": repeated blocks, `blocks`,
    # to checkpoint), what they are ("user": a user's own, "zoo": a model library's): settings decide `supports` by these,
    # never by a kind's name, so a new kind runs every family its traits admit
    traits: frozenset[str] = frozenset()
    # True where `build` and `chain` cost far more than a deep copy of what they return (a converted ONNX graph: its
    # conversion and weight mapping) and the copy is exact (values, strides, shared storage, requires_grad; no closure
    # over the original): a loaded model then builds each once per process and hands each case a copy (`LoadedModel`)
    builds_copied: bool = False

    # --- what every kind does ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def spec(self, seed: int, index: int) -> ModelSpec:
        """The `index`-th model of `seed`: its parameters, frozen parameters and input seed."""

    @abc.abstractmethod
    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        """Initial weights by canonical parameter name."""

    @abc.abstractmethod
    def inputs(self, spec: ModelSpec, batch_size: int) -> dict[str, Batch]:
        """`train` and `eval` batches of `batch_size` samples."""

    @abc.abstractmethod
    def build(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Path | None = None,
              **options: Any) -> Any:
        """A fresh unsharded PyTorch module with the initial weights and the frozen parameters frozen."""

    @abc.abstractmethod
    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        """The module's prediction on `batch`."""

    @abc.abstractmethod
    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """Named evaluation tensors: the prediction and whatever intermediates the kind exposes."""

    @abc.abstractmethod
    def loss(self, prediction: Any, batch: Batch) -> Any:
        """The mean training loss over `batch` (so shares of equal size average to the global loss)."""

    @abc.abstractmethod
    def parameters(self, module: Any) -> dict[str, Any]:
        """Canonical parameter name → tensor of an unsharded module (possibly wrapped by DDP)."""

    # --- capabilities: a neutral default each ----------------------------------------------------------------------
    def available(self) -> str | None:
        """None if this machine can generate the kind (its libraries import), else why not."""
        return None

    def artifacts(self, spec: ModelSpec, init_state: dict[str, np.ndarray]) -> dict[str, bytes]:
        """Extra files for the model's folder (a Keras model's ONNX export), by file name."""
        return {}

    def features(self, spec: ModelSpec) -> list[str]:
        """The layer kinds a model has (`Conv1D`, `weighted tables`): analysis and triage count verdicts by them."""
        return []

    def size(self, spec: ModelSpec) -> dict[str, int]:
        """How big a model is, most significant measure first (tables, layers, …, parameters): the minimiser keeps
        the smaller of two cases by it. Empty: the kind does not shrink."""
        return {}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        """(what it removes, params) of every model one step smaller than `spec`'s."""
        return []

    def frozen_names(self, params: dict[str, Any]) -> set[str] | None:
        """The names a spec's `frozen` may list for a model of `params` (a smaller model may lose some); None: not
        declared, and the minimiser keeps `frozen` as it is."""
        return None

    def tensor_order(self, tensor: str) -> tuple[int, int]:
        """(stage, position) of a recorded tensor in the model's computation: where a divergence that starts there
        starts. Triage orders a case's disagreeing tensors by it; undeclared tensors come after declared ones."""
        return (UNPLACED, 0)

    def tensor_class(self, tensor: str) -> str:
        """The kind of tensor, without the instance (`over.0.weight` → `over.weight`): one bug in any layer of a kind
        is one finding."""
        return re.sub(r"\.[a-z]{0,3}\d+\b|_\d+\b", "", tensor)

    def chain(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str,
              model_dir: Path | None = None) -> Any:
        """The model as a LayerChain (difftest/contracts/chain.py) for pipeline stages."""
        from difftest.contracts.errors import Unsupported

        raise Unsupported(f"{spec.kind} models do not split into a chain of layers")

    def blocks(self, module: Any) -> list[tuple[str, Any]] | None:
        """(name, submodule) of the repeated blocks of an architecture that has them, which per-block wrapping (FSDP2)
        takes as its units; None when the kind has no such structure."""
        return None

    def tp_plan(self, module: Any, world_size: int, sequence_parallel: bool,
                loss_parallel: bool) -> dict[str, Any] | None:
        """The architecture's own tensor-parallel plan (module name → ParallelStyle), as its authors would write it;
        None when the kind has none and a setting derives one from the module's layers."""
        return None

    def embedding_tables(self, spec: ModelSpec) -> list[EmbeddingTable] | None:
        """The model's TorchRec embedding tables, in module order; None: not declared (a standalone script cannot
        rebuild them)."""
        return None

    def standalone_model(self, spec: ModelSpec, init_state: dict[str, np.ndarray], model_dir: Path | None,
                         train: Batch) -> ModelCode | None:
        """The model and its training batch `train` as a standalone script builds them; None: the kind has no
        standalone form (raises `Unsupported` when this model has none)."""
        return None


class UnregisteredKind(Generator):
    """What judging knows of a kind no loaded plugin registers (a run judged without the plugin it was made with):
    every capability neutral, and nothing to build."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def _missing(self, *_: Any, **__: Any) -> Any:
        from difftest.contracts.errors import UserError

        raise UserError(f"model kind {self.kind!r} is not registered: pass the --plugin that registers it")

    spec = init_state = inputs = build = forward = evaluate = loss = parameters = _missing


def order_by_words(tensor: str, stages: tuple[tuple[str, int], ...]) -> tuple[int, int]:
    """`tensor_order` of a kind whose tensor names say their stage by a word in them (the earliest stage wins)."""
    lowered = tensor.lower()
    return (min((stage for word, stage in stages if word in lowered), default=UNPLACED), 0)
