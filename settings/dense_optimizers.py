"""The optimizers today's recipes train dense models with, in place of plain SGD: AdamW (the multi-tensor `foreach`
implementation and the `fused` kernel), Adam with AMSGrad, SGD with Nesterov momentum (foreach and fused), Adagrad
(foreach and fused), RMSprop, NAdam, RAdam, Adamax, Rprop (foreach and single-tensor) and Adafactor, each under DDP,
FSDP2, tensor parallel and FSDP2 × tensor parallel, against the same optimizer in one process (the family's root, one
per optimizer).

Under FSDP2 and tensor parallel the optimizer steps DTensor parameters, so every update runs through DTensor's
sharding rules for the optimizer's `_foreach_*` and `_fused_*` operators (over two meshes at once under FSDP2 ×
tensor parallel: the plan's parameters on both, the rest on the data-parallel mesh alone). Besides the weights each
step records the optimizer's state (`state_after_step<i>/<parameter>.<state>`: Adam's moments, Adagrad's sums, the
momentum buffers), so a wrongly updated state shows before the weights it moves. The adaptive optimizers step a
tenth of the run's learning rate (`--lr`, tuned for SGD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import (
    DATA_PARALLEL,
    SHARDED,
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    across,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
)
from settings._compat import fully_shard_for
from settings._training import OneProcessRoot, Training, build_for_training, train_data_parallel
from settings.fsdp import make_contiguous
from settings.gradient_clipping import distribute, full_parameters, wrapper_layout

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

ADAPTIVE_LR = 0.1  # of the run's learning rate: an adaptive step moves every weight by about lr

OPTIMIZERS = {
    "adamw": Training("AdamW", (("weight_decay", 0.1), ("foreach", True)), ADAPTIVE_LR),
    "adamw-fused": Training("AdamW", (("weight_decay", 0.1), ("fused", True)), ADAPTIVE_LR),
    "adam-amsgrad": Training("Adam", (("amsgrad", True), ("foreach", True)), ADAPTIVE_LR),
    "sgd-nesterov": Training("SGD", (("momentum", 0.9), ("nesterov", True), ("weight_decay", 0.01),
                                     ("foreach", True))),
    "sgd-fused": Training("SGD", (("momentum", 0.9), ("fused", True))),
    "adagrad": Training("Adagrad", (("foreach", True),), ADAPTIVE_LR),
    "adagrad-fused": Training("Adagrad", (("fused", True),), ADAPTIVE_LR),
    "rmsprop": Training("RMSprop", (("momentum", 0.9), ("centered", True), ("foreach", True)), ADAPTIVE_LR),
    "nadam": Training("NAdam", (("weight_decay", 0.1), ("decoupled_weight_decay", True), ("foreach", True)),
                      ADAPTIVE_LR),
    "radam": Training("RAdam", (("foreach", True),), ADAPTIVE_LR),
    "adamax": Training("Adamax", (("foreach", True),), ADAPTIVE_LR),
    "rprop": Training("Rprop", (("foreach", True),), ADAPTIVE_LR),
    "rprop-single": Training("Rprop", (("foreach", False),), ADAPTIVE_LR),
    "adafactor": Training("Adafactor", (("foreach", True),), ADAPTIVE_LR),
}
WRAPS = ("single", "ddp", "fsdp2", "tp", "fsdp2-tp")


def describe_optimizer(training: Training) -> str:
    """`torch.optim.AdamW(weight_decay=0.1, foreach=True)`: the optimizer as a user constructs it."""
    return f"torch.optim.{training.cls}({', '.join(f'{k}={v!r}' for k, v in training.options)})"


@dataclass(frozen=True)
class OptimizerTraining(Setting):
    """A dense optimizer other than plain SGD, stepped under a data-parallel wrapper or a tensor-parallel plan."""

    world_size: int
    wrap: str = "ddp"
    optimizer: str = "adamw"
    family: ClassVar[str] = "optim"
    in_default_tier: ClassVar[bool] = False  # the full tier: one representative below stands for the family

    @property
    def name(self) -> str:
        return f"optim/{self.optimizer}/{self.wrap}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return OptimizerReference(optimizer=self.optimizer).name

    @property
    def training(self) -> Training:
        return OPTIMIZERS[self.optimizer]

    def describe(self) -> str:
        where = "in one process" if self.wrap == "single" else f"{self.wrap} over {self.world_size} ranks"
        return f"{describe_optimizer(self.training)} steps, {where}"

    @property
    def collectives(self) -> frozenset[str]:
        if self.wrap in ("tp", "fsdp2-tp"):
            return across(self.world_size, SHARDED | {"all_reduce"})
        return across(self.world_size, SHARDED if self.wrap == "fsdp2" else DATA_PARALLEL)

    def available(self) -> str | None:
        """Refused where the installed torch lacks the optimizer or the option (Adafactor came in 2.5, fused CPU
        kernels in 2.4): in its own words, from constructing it."""
        import torch

        if not hasattr(torch.optim, self.training.cls):
            return f"torch {torch.__version__} has no torch.optim.{self.training.cls}"
        try:
            self.training.optimizer(torch.nn.Linear(2, 2), 0.1)
        except (RuntimeError, ValueError, TypeError) as exc:
            return f"torch {torch.__version__} refuses {describe_optimizer(self.training)} on CPU: {exc}"
        return None

    def parallel(self) -> Any:
        """The tensor-parallel setting whose training this one steps with its optimizer."""
        from settings.fsdp_tp import FsdpTensorParallel
        from settings.tensor_parallel import TensorParallel

        return TensorParallel(self.world_size) if self.wrap == "tp" else FsdpTensorParallel(self.world_size // 2, 2)

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        if self.wrap in ("tp", "fsdp2-tp"):
            return self.parallel().trained(ctx, model, inputs, training=self.training)  # type: ignore[no-any-return]
        if self.wrap == "fsdp2":
            fully_shard_for(ctx.device)  # refuses where FSDP2 cannot run on the device, before the model is built
        module = build_for_training(model, ctx.device)
        if not any(p.requires_grad for p in module.parameters()):
            raise Unsupported("every parameter is frozen: there is nothing to step")
        wrapped = distribute(module, ctx.group, ctx.device, wrapper_layout(model, module, self.wrap))

        def gathered() -> dict[str, Any] | None:
            whole = {n: to_numpy(t) for n, t in full_parameters(wrapped, model.parameters).items()}
            return whole if ctx.rank == 0 else None

        return train_data_parallel(ctx, model, inputs, wrapped, gathered, training=self.training)

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, OptimizerTraining, "parallel")

        from difftest import LoadedModel
        from settings._training_script import training_script

        training = self.training
        optimizer = {"cls": training.cls, "options": dict(training.options), "lr": case.lr * training.lr_scale}
        words = describe_optimizer(training)
        if self.wrap in ("tp", "fsdp2-tp"):
            summary, world_size, functions, layout = self.parallel().script_parts(case)
            return training_script(case, summary, world_size, functions, {**layout, "optimizer": optimizer},
                                   optimizer=words)
        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        layout = wrapper_layout(model, model.build("cpu"), self.wrap)
        return training_script(case, f"{self.wrap.upper()} over {self.world_size} ranks", self.world_size,
                               (fully_shard_for, make_contiguous, distribute, full_parameters),
                               {**layout, "optimizer": optimizer}, optimizer=words)


@dataclass(frozen=True)
class OptimizerReference(OneProcessRoot, OptimizerTraining):  # type: ignore[misc]
    """The family's root: one process, the same optimizer on the whole batch."""

    world_size: int = 1
    wrap: str = "single"


# the family's representative in the default tier: fused AdamW (torchtitan's default implementation) stepping
# tensor-parallel DTensor parameters; the rest are in the full tier
DEFAULT = (2, "tp", "adamw-fused")


@dataclass(frozen=True)
class DefaultTierOptimizer(OptimizerTraining):
    """The family's representative in the default tier (`DEFAULT`)."""

    in_default_tier: ClassVar[bool] = True


@dataclass(frozen=True)
class DefaultTierOptimizerReference(OptimizerReference):
    """The root of the default tier's representative, which the tier runs to judge it."""

    in_default_tier: ClassVar[bool] = True


register_settings(
    [(DefaultTierOptimizerReference if name == DEFAULT[2] else OptimizerReference)(optimizer=name)
     for name in OPTIMIZERS]
    + [(DefaultTierOptimizer if (ws, wrap, name) == DEFAULT else OptimizerTraining)(ws, wrap, name)
       for name in OPTIMIZERS for wrap in WRAPS[1:4] for ws in (2, 4)]
    + [OptimizerTraining(4, "fsdp2-tp", name) for name in OPTIMIZERS]
)
