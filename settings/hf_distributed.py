"""Hugging Face `transformers`' own distributed training (the `[zoo]` extra): a model loaded the way the library
tells users to parallelize it — `from_pretrained(folder, distributed_config=DistributedConfig(...))` — against the
plain single-process program.

The case's weights are saved with `save_pretrained` (safetensors) and loaded back through the library's distributed
path (`DistributedMixin.maybe_distribute_model`): transformers lays out its own device mesh (`pp`, `dp_replicate`,
`fsdp`, `tp` and the experts' `efsdp`, `ep`), resolves the model's own plans (`base_model_tp_plan`,
`base_model_ep_plan`, `_fsdp_plan`) and applies tensor parallelism, expert parallelism (a mixture of experts' experts
spread over `ep_size` ranks, tokens exchanged by `ep_implementation`) and FSDP2 (HSDP with `dp_replicate_size`,
`fsdp_mixed_precision`, `fsdp_cpu_offload`) itself, and loads each rank's shards. Each data-parallel rank then takes
plain SGD steps on its share of the batch, the model called as the library documents it (`input_ids`,
`attention_mask`), the kind's own loss; parameters are read whole (DTensors gathered).

Each case runs in new processes: transformers builds its mesh over the default process group (`init_device_mesh`),
which must be exactly the case's ranks. Pipeline parallelism (`pp_size`) is not run: transformers 5.24 implements it
as a forward-only relay of hidden states for `generate()` (`pipeline_parallel_naive_forward`; its received
activations carry no gradient), not as training.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest import (
    SHARDED,
    ModelSpec,
    Outputs,
    RunContext,
    Script,
    Setting,
    StandaloneCase,
    Tolerance,
    Unsupported,
    across,
    refuse_changed_hooks,
    register_settings,
    traits_of,
)
from settings._training import build_for_training, gathered_parameters, train_data_parallel
from settings.fsdp import BF16_TOLERANCE


@dataclass(frozen=True)
class TransformersDistributed(Setting):
    """A `transformers` model under its library's own `DistributedConfig`: FSDP2 over `fsdp` ranks (replicated
    `replicate` times), tensor parallel over `tp`, its experts over `ep` ranks; in new processes."""

    fsdp: int = 1
    tp: int = 1
    ep: int = 1
    replicate: int = 1
    # how the experts receive their tokens (`DistributedConfig.ep_implementation`): auto, all_to_all, all_reduce
    ep_implementation: str = "auto"
    mixed_precision: bool = False  # `fsdp_mixed_precision`: bf16 compute, judged by the root's bf16 envelope
    cpu_offload: bool = False  # `fsdp_cpu_offload`
    world_size: int = 1  # the sweep's process only starts the library's own group
    family: ClassVar[str] = "hf"
    tier_axes: ClassVar[tuple[str, ...]] = ("ep", "mixed_precision", "cpu_offload")
    size_parameters: ClassVar[frozenset[str]] = frozenset()

    @property
    def ranks(self) -> int:
        return self.replicate * self.fsdp * self.tp

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.fsdp

    @property
    def name(self) -> str:
        mesh = "-".join(f"{axis}{size}" for axis, size in (("replicate", self.replicate), ("fsdp", self.fsdp),
                                                            ("tp", self.tp), ("ep", self.ep)) if size > 1)
        extra = (f"/{self.ep_implementation}" if self.ep > 1 and self.ep_implementation != "auto" else "") + (
            "/bf16" if self.mixed_precision else "") + ("/cpu-offload" if self.cpu_offload else "")
        return f"hf/{mesh}{extra}/ws{self.ranks}"

    @property
    def scale(self) -> int:
        return self.ranks

    @property
    def precision(self) -> str:  # type: ignore[override]
        return "bf16" if self.mixed_precision else "fp32"

    def tolerance(self, default: Tolerance) -> Tolerance:
        return BF16_TOLERANCE if self.mixed_precision else default

    def config(self) -> dict[str, Any]:
        """The `DistributedConfig` fields of this setting (what a user passes)."""
        fields: dict[str, Any] = {"fsdp_size": self.fsdp, "tp_size": self.tp}
        if self.replicate > 1:
            fields["dp_replicate_size"] = self.replicate
        if self.ep > 1:
            fields.update(ep_size=self.ep, ep_implementation=self.ep_implementation)
        if self.mixed_precision:
            fields["fsdp_mixed_precision"] = True
        if self.cpu_offload:
            fields["fsdp_cpu_offload"] = True
        return fields

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return (f"transformers' own distributed training: from_pretrained(..., distributed_config=DistributedConfig("
                f"{fields})), plain SGD on each data-parallel rank's share, in {self.ranks} new processes")

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.ranks, SHARDED | {"all_reduce", "all_to_all", "broadcast"})

    def supports(self, spec: ModelSpec) -> str | None:
        if "transformers" not in traits_of(spec.kind):
            return f"transformers' DistributedConfig parallelizes transformers models, not kind {spec.kind!r}"
        return None

    def available(self) -> str | None:
        for library in ("transformers", "accelerate"):  # from_pretrained(distributed_config=…) needs accelerate
            if importlib.util.find_spec(library) is None:
                return f"needs {library} (pip install 'difftest[zoo]')"
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from settings._resumable import train_in_new_processes

        self._refusal(build_for_training(model, "cpu").lm)  # what the library refuses, before any process starts
        if self.cpu_offload:
            _pinnable()
        return train_in_new_processes(self, ctx, model, self.ranks, "transformers' distributed training")

    def _refusal(self, library_model: Any) -> None:
        """What the model's own plans cannot do here, as transformers would refuse it, raised as `Unsupported`."""
        plans = {"tp": ("tp_plan", self.tp), "ep": ("ep_plan", self.ep), "fsdp": ("fsdp_plan", self.data_parallel)}
        for axis, (plan, size) in plans.items():
            if size > 1 and not getattr(library_model, plan, None):
                raise Unsupported(f"{type(library_model).__name__} ships no {plan} ({axis}_size={size} needs one)")

    def train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """One process's part: the library loads the case's weights into its own layout, then SGD on the rank's
        share."""
        config = self.config()
        module = distribute(build_for_training(model, ctx.device), None, ctx.device, {"config": config})
        applied = {"tp_plan": config.get("tp_size", 1), "ep_plan": config.get("ep_size", 1),
                   "fsdp_plan": config.get("fsdp_size", 1) * config.get("dp_replicate_size", 1)}
        ctx.notes["plans"] = ", ".join(f"the model's {plan} ({len(getattr(module.lm, plan) or {})} rules)"
                                       for plan, size in applied.items() if size > 1) or "none"
        return train_data_parallel(ctx, model, inputs, module, lambda: gathered_parameters(ctx, model, module),
                                   data_shard=(self.share_of(ctx.rank), self.data_parallel))

    def standalone(self, case: StandaloneCase) -> Script:
        from settings._training import full_parameters
        from settings._training_script import training_script

        refuse_changed_hooks(self, TransformersDistributed, "train")
        fields = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return training_script(case, f"transformers' own distributed training (from_pretrained(..., "
                                     f"distributed_config=DistributedConfig({fields})))", self.ranks,
                               (distribute, full_parameters), {"config": self.config(),
                                                               "data_parallel": self.data_parallel},
                               libraries=("accelerate",))

    def share_of(self, rank: int) -> int:
        """Which data-parallel share of the batch `rank` trains on: its place on transformers' mesh (pp, dp_replicate,
        fsdp, tp), the tensor-parallel ranks of a replica sharing one."""
        return (rank // self.tp) % self.data_parallel


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """The kind's model as transformers parallelizes it: saved, then loaded back by every rank through the library's
    distributed path, `from_pretrained(folder, distributed_config=DistributedConfig(**setting["config"]))`, which lays
    out its own mesh over the default group and applies the model's own plans; in the kind's wrapper (its forward,
    loss and names)."""
    import contextlib
    import tempfile

    import torch
    from transformers import DistributedConfig
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar per rank, save and load would bury what the case says
    # transformers writes a checkpoint on rank 0 only (`should_save_on_this_rank`): one folder, every rank loads it
    with tempfile.TemporaryDirectory() if torch.distributed.get_rank() == 0 else contextlib.nullcontext() as mine:
        folder = [mine]
        torch.distributed.broadcast_object_list(folder, src=0)
        module.lm.save_pretrained(folder[0])
        torch.distributed.barrier()
        distributed = type(module.lm).from_pretrained(folder[0], distributed_config=DistributedConfig(
            **setting["config"]), dtype=torch.float32)
        torch.distributed.barrier()  # every rank has read it before rank 0 removes it
    return type(module)(distributed, module.output)


def _pinnable() -> None:
    """`fsdp_cpu_offload` builds `CPUOffloadPolicy()` (transformers/distributed/fsdp.py), which pins host memory: where
    this machine cannot pin (no CUDA driver), the setting is `unsupported` with torch's words."""
    import torch

    try:
        torch.empty(1).pin_memory()
    except RuntimeError as exc:
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unsupported(f"fsdp_cpu_offload pins host memory (transformers builds CPUOffloadPolicy()), which this "
                          f"machine cannot: {said}") from None


register_settings(
    [TransformersDistributed(fsdp=2), TransformersDistributed(tp=2), TransformersDistributed(fsdp=2, tp=2),
     TransformersDistributed(fsdp=2, replicate=2), TransformersDistributed(fsdp=2, mixed_precision=True),
     TransformersDistributed(fsdp=2, cpu_offload=True)]
    # a mixture of experts' experts over the data-parallel ranks (tokens exchanged all-to-all), or over the
    # tensor-parallel ones (each rank's experts on the shared batch, outputs summed)
    + [TransformersDistributed(fsdp=2, ep=2, ep_implementation=impl) for impl in ("auto", "all_to_all")]
    + [TransformersDistributed(tp=2, ep=2, ep_implementation=impl) for impl in ("auto", "all_reduce")]
    + [TransformersDistributed(fsdp=2, tp=2, ep=2), TransformersDistributed(fsdp=2, tp=2, ep=4)]
)
