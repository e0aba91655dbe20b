"""A pipeline setting's stages: the model's layer chain cut and placed on ranks (a loop or a V), the example tensors
a PipelineStage needs, the schedule over the stages a rank holds, a hybrid's 2-D mesh and per-stage DDP or FSDP2, and the
standalone script of a pipeline finding (its functions are copied into it as they are)."""

from __future__ import annotations

from typing import Any

from difftest import ConversionFailed, Script, StandaloneCase, Unsupported, to_numpy
from generators.inputs import Batch
from settings._compat import PipelineSchedule, fully_shard_for
from settings.fsdp import make_contiguous


def _microbatches(batch: Batch, count: int) -> list[Batch]:
    if batch.size % count:
        raise Unsupported(f"the model's batch of {batch.size} does not split into {count} micro-batches")
    size = batch.size // count
    return [batch.slice(i * size, (i + 1) * size) for i in range(count)]


def pipeline_groups(device: str, dp: int, pp: int) -> dict[str, Any]:
    """The hybrid's 2-D (dp, pp) device mesh: this rank's pipeline group ("pp") and its replicas' mesh ("dp")."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.split(":")[0], (dp, pp), mesh_dim_names=("dp", "pp"))
    return {"pp": mesh["pp"].get_group(), "dp": mesh["dp"]}


def wrap_stage(module: Any, inner: str, groups: dict[str, Any], device: str) -> Any:
    """A hybrid's stage module in DDP or FSDP2 over its replicas; as it is without `inner` or anything to train."""
    if not inner or not any(p.requires_grad for p in module.parameters()):
        return module  # nothing to synchronise
    if inner == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=groups["dp"].get_group())
    make_contiguous(module)
    return fully_shard_for(device)(module, mesh=groups["dp"])


def stages_of(pp_rank: int, pp: int, layout: dict[str, Any]) -> list[int]:
    """The stages a pipeline rank holds: every pp-th from its own (loop), or its own and its mirror (V)."""
    stages = layout["stages"]
    return [pp_rank, stages - 1 - pp_rank] if layout["placement"] == "v" else list(range(pp_rank, stages, pp))


def stage_examples(stage_modules: list[Any], size: int, first: int = 0) -> dict[int, tuple]:
    """Each stage's (inputs, outputs) on `size` samples from the `first` of the batch the chain is fed, from running
    every stage's module (`ChainStage`) in turn in this process."""
    import torch

    def example(tensor: Any) -> Any:
        # a stage sends back gradients for exactly the received tensors that require them
        return tensor.detach().clone().requires_grad_(tensor.requires_grad)

    value: Any = torch.arange(first, first + size)
    examples = {}
    for s, stage in enumerate(stage_modules):
        inputs = tuple(example(t) for t in (value if isinstance(value, tuple) else (value,)))
        value = stage(*inputs)
        outputs = value if isinstance(value, tuple) else (value,)
        examples[s] = (inputs, tuple(example(t) for t in outputs))
        stage.zero_grad(set_to_none=True)
    return examples


def chain_examples(chain: Any, batch: Batch, microbatches: int, bounds: list[int]) -> dict[int, tuple]:
    """`stage_examples` of the chain cut at `bounds`, on the first micro-batch of `batch`."""
    from difftest import ChainStage

    first = _microbatches(batch, microbatches)[0]
    chain.feed(first)
    return stage_examples([ChainStage(chain.units[a:b]) for a, b in zip(bounds, bounds[1:])], first.size)


def pipeline_schedule(wrapped: dict[int, Any], layout: dict[str, Any], group: Any, device: str,
                      examples: dict[int, tuple], loss_fn: Any, scale_grads: bool = True) -> PipelineSchedule:
    """A PipelineStage of each stage module the rank holds (`wrapped`, in stage order) under the layout's schedule."""
    import torch
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(module, s, layout["stages"], torch.device(device), input_args=examples[s][0],
                                       output_args=examples[s][1], group=group) for s, module in wrapped.items()]
    return PipelineSchedule(getattr(pipelining.schedules, layout["schedule_class"]),
                            stages if layout["per_rank"] > 1 else stages[0], layout["microbatches"], loss_fn,
                            scale_grads)


def _stage_parameters(chain: Any, modules: dict[int, Any], wrapped: dict[int, Any], inner: str) -> dict:
    if inner == "fsdp2":
        for m in wrapped.values():
            if hasattr(m, "unshard"):
                m.unshard()
    try:
        return {k: to_numpy(v) for k, v in chain.parameters_of(list(modules.values())).items()}
    finally:
        if inner == "fsdp2":
            for m in wrapped.values():
                if hasattr(m, "reshard"):
                    m.reshard()


def clip_stages(stages: Any, clipping: dict[str, Any], group: Any) -> float:
    """Clip the gradients of this rank's `stages` as torchtitan clips a pipeline's: the norm of the rank's own
    gradients (`torch.nn.utils.get_total_norm`; over FSDP2's sharded gradients a DTensor, made whole first), reduced
    over the pipeline's ranks in `group` (the p-th powers summed, the largest for the infinity norm; no group: one
    process holds the whole model), then every gradient scaled by it (`torch.nn.utils.clip_grads_with_norm_`).
    `clipping`: the norm ("2", "inf"), the largest allowed and the device the reduction runs on (a rank with no
    gradient has a CPU zero, which NCCL would not take). The total norm before clipping."""
    import torch
    import torch.distributed as dist

    norm_type = float(clipping["norm"])
    parameters = [p for stage in stages for p in stage.parameters() if p.requires_grad and p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type)
    if hasattr(total, "full_tensor"):  # FSDP2's sharded gradients: a DTensor, reduced over the stage's replicas
        total = total.full_tensor()
    total = total.to(clipping["device"])
    if group is not None:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=group)
            total = total ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(parameters, clipping["max_norm"], total)
    return float(total)


def pipeline_script(case: StandaloneCase, described: str, layout_of: Any, world_size: int, optimizer: str,
                    detail: str = "", steps: int | None = None, functions: tuple[Any, ...] = ()) -> Script:
    """The script of a pipeline (`settings._pipeline_script`): the model's layer chain cut into stages as
    `layout_of(chain)` says (the keys `stages_of` and `pipeline_schedule` read; a hybrid's `data_parallel` and `inner`,
    a re-partitioning's `momentum`, `move_after` and `moved_starts`, a clipped pipeline's `clipping`, a checkpointed
    pipeline's `checkpointing`, whose functions the setting passes in `functions`), evaluated once, then the steps
    under the schedule, compared with one process accumulating the same micro-batches' gradients."""
    from difftest import ChainStage
    from settings._pipeline_script import gather_state, load_state, on_rank, single_process
    from settings._training_script import parameters_after, trained_parameters

    model, diverged_at, tensors = trained_parameters(case)
    steps = steps or diverged_at
    if not model.chain:
        raise Unsupported(f"{case.spec.kind} models have no standalone layer chain (ModelCode.chain)")
    try:
        chain = case.generator.chain(case.spec, case.init_state, "cpu", case.model_dir)
    except ConversionFailed as exc:
        raise Unsupported(f"no layer chain: {exc}") from None
    layout = layout_of(chain)
    hybrid = layout.get("data_parallel", 1) > 1
    return Script(
        summary=f"{described}: the model's layer chain cut into stages (torch.distributed.pipelining), "
                f"{'evaluated once, then ' if layout.get('evaluates', True) else ''}{steps} step(s) of {optimizer} (lr {case.lr:g}) over {world_size} CPU ranks (gloo){detail}"
                + case.against("the same steps accumulating the micro-batches' gradients in one process: the "
                               "parameters after them") + f". {model.summary}",
        libraries=("torch", *model.libraries, "numpy"),
        case={**model.case, "lr": case.lr, "steps": steps, "batch": case.inputs["train"].size, "setting": layout},
        functions=(*model.functions, *model.chain, to_numpy, parameters_after, ChainStage, PipelineSchedule,
                   stages_of, stage_examples, pipeline_schedule,
                   *((make_contiguous, fully_shard_for, pipeline_groups, wrap_stage) if hybrid else ()),
                   *((gather_state, load_state) if "move_after" in layout else ()),
                   *((clip_stages,) if "clipping" in layout else ()), *functions, single_process, on_rank),
        preamble=(*model.preamble, "import inspect"),
        tensors=tensors,
        data={**model.data, **case.inputs["eval"].to_arrays("eval")}, world_size=world_size)
