"""Compiled training: `torch.compile` (TorchDynamo capturing the forward, AOTAutograd the backward, Inductor
generating C++ kernels for the CPU or Triton for CUDA) of the model, trained with plain SGD, alone or distributed as
today's recipes compile it: the DDP module compiled whole (Dynamo's DDPOptimizer splits the graph at the bucket
boundaries, so that each bucket's all-reduce can overlap the backward of the next), or each FSDP2 unit compiled before
it is sharded (torchtitan's per-block compile, FSDP2's hooks around the compiled blocks).

The one-process compiled run is judged against the eager `reference` by the calibrated fp32 envelope: Inductor fuses
and reorders arithmetic, which the envelope's reordered and re-threaded runs measure. The distributed runs are judged
against that compiled one-process run, so that what compiling costs and what distribution adds stay apart. Graph
breaks and the number of graphs compiled are recorded in the case's notes.
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
)
from settings._compat import fully_shard_for
from settings._tp_apply import compile_units
from settings._training import build_for_training, gathered_parameters, train_data_parallel
from settings.fsdp import make_contiguous
from settings.gradient_clipping import full_parameters, wrapper_layout
from settings.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

WRAPS = {"single": "one process", "ddp": "the DDP module compiled whole",
         "fsdp2": "each FSDP2 unit compiled, then sharded"}


@dataclass(frozen=True)
class CompiledTraining(Setting):
    """Plain SGD through `torch.compile`d modules (Inductor), in one process or under DDP or FSDP2."""

    world_size: int
    wrap: str = "ddp"  # a key of WRAPS
    family: ClassVar[str] = "compile"
    tier_axes: ClassVar[tuple[str, ...]] = ("wrap",)
    # Inductor compiles each model's forward, backward and evaluation graphs anew: 10-40 s a case on 2 cores,
    # about three times the default job's time if it ran on its nine models
    in_default_tier: ClassVar[bool] = False
    compiled_autograd: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"compile/{self.wrap}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return "reference" if self.wrap == "single" else CompiledTraining(1, "single").name

    def describe(self) -> str:
        ranks = f"over {self.world_size} ranks" if self.world_size > 1 else "in one process"
        return f"torch.compile (Inductor) training {ranks}: {WRAPS[self.wrap]}"

    @property
    def collectives(self) -> frozenset[str]:
        if self.wrap == "single":
            return frozenset()
        return across(self.world_size, SHARDED if self.wrap == "fsdp2" else DATA_PARALLEL)

    def available(self) -> str | None:
        return inductor_cannot_compile()

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # a rank runs many cases: no graph or guard of an earlier model is reused
        counters.clear()
        return self.train(ctx, model, inputs)

    def train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """Compile and distribute the module as the setting says, then train it with plain SGD."""
        import torch

        if self.wrap == "fsdp2":
            fully_shard_for(ctx.device)
        # one compile worker: a pool of compiler subprocesses per rank would oversubscribe the cores the ranks share
        torch._inductor.config.compile_threads = 1
        module = build_for_training(model, ctx.device)
        if not any(p.requires_grad for p in module.parameters()):
            raise Unsupported("every parameter is frozen: there is nothing to train")
        wrapped = distribute(module, ctx.group, ctx.device, self.layout(model, module))
        outputs = train_data_parallel(ctx, model, inputs, wrapped, lambda: gathered_parameters(ctx, model, wrapped),
                                      stepping=stepping if self.compiled_autograd else None)
        note_compilation(ctx)
        return outputs

    def layout(self, model: Any, module: Any) -> dict[str, Any]:
        return {**wrapper_layout(model, module, self.wrap), "compiled_autograd": self.compiled_autograd}

    def standalone(self, case: StandaloneCase) -> Script:
        # the family's own class in this module: a subclass elsewhere (a planted fault) runs what the script would not
        refuse_changed_hooks(self, next(c for c in type(self).__mro__ if c.__module__ == __name__), "train")

        from difftest import LoadedModel
        from settings._training_script import training_script

        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        autograd = "; the backward by Compiled Autograd" if self.compiled_autograd else ""
        return training_script(case, f"torch.compile (Inductor) training: {WRAPS[self.wrap]}{autograd}",
                               self.world_size, (fully_shard_for, make_contiguous, distribute, full_parameters,
                                                 *((stepping,) if self.compiled_autograd else ())),
                               self.layout(model, model.build("cpu")))


@dataclass(frozen=True)
class CompiledAutogradTraining(CompiledTraining):
    """The module compiled as above, and its backward traced whole by Compiled Autograd (the autograd graph as the
    engine runs it: gradient accumulation and backward hooks included) and compiled by Inductor; under DDP with its
    Python reducer (`optimize_ddp="python_reducer"`), whose all-reduces the traced backward holds. As torchtitan
    enabled it (`torch._dynamo.utils.maybe_enable_compiled_autograd` around each step's forward and backward)."""

    compiled_autograd: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return f"compile/{self.wrap}/compiled-autograd/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return "reference" if self.wrap == "single" else CompiledAutogradTraining(1, "single").name

    def describe(self) -> str:
        return super().describe() + "; the backward by Compiled Autograd" + (
            " (DDP's Python reducer)" if self.wrap == "ddp" else "")

    def available(self) -> str | None:
        import torch._dynamo.utils

        if not hasattr(torch._dynamo.utils, "maybe_enable_compiled_autograd"):
            return f"torch {torch.__version__} has no Compiled Autograd (torch._dynamo.utils.maybe_enable_compiled_autograd)"
        return super().available()

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """In new processes: DDP's Python reducer adds DDP's module to Dynamo's inline list and turns on Inductor's
        DDP fusion passes for the rest of the process, which a later compiled DDP case would meet."""
        from settings._resumable import train_in_new_processes

        return train_in_new_processes(self, ctx, model, self.world_size, "compiled autograd")

    def train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """One process's part: the compiled family's training, each step's forward and backward under Compiled
        Autograd."""
        from torch._dynamo.utils import counters

        outputs = super().train(ctx, model, inputs)
        captured = counters["compiled_autograd"]
        if not captured["captures"]:  # else this would pass as the compiled family's run
            raise RuntimeError("Compiled Autograd captured no backward: the setting did not run as it says")
        ctx.notes["compiled autograd"] = (f"{captured['captures']} backward graph(s) captured, "
                                          f"{captured['compiles']} compiled")
        return outputs


@dataclass(frozen=True)
class CompiledTensorParallel(TensorParallel):
    """Tensor parallel (the `tp` family's plan and training), then each block compiled (the whole module where the
    kind has no blocks), as torchtitan compiles its blocks after the plan: Dynamo traces the DTensor parameters and
    activations the plan leaves, Inductor compiles the local arithmetic. Judged against the compiled one-process run,
    as the compiled family's distributed runs are."""

    family: ClassVar[str] = "compile"
    tier_axes: ClassVar[tuple[str, ...]] = ("sequence_parallel",)
    in_default_tier: ClassVar[bool] = False  # Inductor: 10-40 s a case on 2 cores

    @property
    def name(self) -> str:
        return f"compile/tp{'-sp' if self.sequence_parallel else ''}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return CompiledTraining(1, "single").name

    def describe(self) -> str:
        return f"torch.compile (Inductor) of each block after {super().describe()}"

    def available(self) -> str | None:
        return inductor_cannot_compile()

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # a rank runs many cases: no graph or guard of an earlier model is reused
        counters.clear()
        torch._inductor.config.compile_threads = 1  # one compile worker per rank: the ranks share the cores
        outputs = super().run(ctx, model, inputs)
        note_compilation(ctx)
        return outputs

    def parallelize(self, ctx: RunContext, model: Any, module: Any, inputs: Any, mesh: Any) -> None:
        super().parallelize(ctx, model, module, inputs, mesh)
        compile_units(module, self.compiled_units(model, module))

    @staticmethod
    def compiled_units(model: Any, module: Any) -> list[str]:
        return [name for name, _ in model.blocks(module) or [("", module)]]

    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, CompiledTensorParallel, "style", "trained", "parallelize")

        from settings._training_script import training_script

        return training_script(case, *self.script_parts(case))

    def script_parts(self, case: StandaloneCase) -> tuple[str, int, tuple[Any, ...], dict[str, Any]]:
        from difftest import LoadedModel

        summary, world_size, functions, layout = super().script_parts(case)
        model = LoadedModel(case.spec, case.generator, case.init_state, case.model_dir)
        return (f"{summary}, then each block compiled (torch.compile, Inductor)", world_size,
                (*functions, compile_units), {**layout, "compiled": self.compiled_units(model, model.build("cpu"))})


def note_compilation(ctx: RunContext) -> None:
    """How many graphs Dynamo compiled in this process and which graph breaks it took, in the case's notes."""
    from torch._dynamo.utils import counters

    ctx.notes["graphs compiled"] = str(counters["stats"]["unique_graphs"])
    breaks = counters["graph_break"]
    ctx.notes["graph breaks"] = (f"{sum(breaks.values())}: " + "; ".join(sorted(breaks))[:300]) if breaks else "0"


def stepping(module: Any) -> Any:
    """What a step's forward and backward run inside: Compiled Autograd where the module or one of its units is
    compiled (FSDP2 compiles each unit, not the root; the one-process program a script compares with is not)."""
    from torch._dynamo.utils import maybe_enable_compiled_autograd

    return maybe_enable_compiled_autograd(any(getattr(m, "_compiled_call_impl", None) is not None
                                              for m in module.modules()))


def inductor_cannot_compile() -> str | None:
    """Why Inductor cannot compile here (it writes C++ for the CPU), or None."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "Inductor compiles C++ for the CPU and finds no compiler (install g++: apt-get install g++)"
    return None


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The module compiled in place (`nn.Module.compile`: names and parameters unchanged) as the setting compiles it:
    alone, DDP compiled whole, or each FSDP2 unit compiled and then sharded, innermost first, then the root."""
    import torch

    wrap = setting["wrap"]
    if setting["compiled_autograd"] and wrap == "ddp":  # read as DDP is built: a reducer Compiled Autograd traces
        torch._dynamo.config.optimize_ddp = "python_reducer"
    if wrap == "single":
        module.compile()
        return module
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(module, device_ids=[torch.device(device)] if device.startswith("cuda") else None,
                                      process_group=group)
        ddp.compile()
        return ddp
    from torch.distributed.device_mesh import DeviceMesh

    fully_shard = fully_shard_for(device)
    make_contiguous(module)
    mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("dp",))
    for name in reversed(setting["units"]):
        unit = module.get_submodule(name)
        unit.compile()
        fully_shard(unit, mesh=mesh)
    return fully_shard(module, mesh=mesh)


register_settings([CompiledTraining(1, "single")]
                  + [CompiledTraining(ws, wrap) for wrap in ("ddp", "fsdp2") for ws in (2, 4)]
                  + [CompiledAutogradTraining(1, "single")]
                  + [CompiledAutogradTraining(2, wrap) for wrap in ("ddp", "fsdp2")]
                  + [CompiledTensorParallel(2, sp) for sp in (False, True)])
