"""Planted faults, registered only when a test passes `--plugin tests.faults.planted`.

They must be reported (inconsistent / error / crash / timeout / unsupported) while clean settings on the
same models are not: the negative controls of the engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest.contracts.registry import register_settings
from difftest.contracts.setting import Outputs, RunContext, Setting
from settings._torchrec_plan import _local_pieces
from settings.conversion import Conversion
from settings.gradient_clipping import MAX_NORM, PipelineClipping
from settings.quant_tensorflow import TensorFlowQuantization
from settings.quant_torchrec import QuantizedEmbeddings
from settings.tensorflow import TensorFlowStrategy
from settings.titan import TorchtitanPipelineRecipe, TorchtitanRecipe
from settings.torchrec_reshard import ReshardedResume
from settings.torchrec_sharding import TorchRecSharding


@dataclass(frozen=True)
class ShardOffByOneRow(TorchRecSharding):
    """Row-wise DMP whose rank 1 loads its shard of every table one row too far down."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/shard_off_by_one_row/ws{self.world_size}"

    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        import torch

        super().load_initial_state(ctx, dmp, state)
        if ctx.rank != 1:
            return
        with torch.no_grad():
            for name, value in dmp.state_dict().items():
                for offsets, local in _local_pieces(value) or []:
                    full = torch.from_numpy(state[name])
                    rows = min(local.shape[0], full.shape[0] - offsets[0] - 1)
                    local[:rows].copy_(full[offsets[0] + 1 : offsets[0] + 1 + rows, offsets[1] : offsets[1] + local.shape[1]])


@dataclass(frozen=True)
class RankSkipsOptimizerStep(TorchRecSharding):
    """Table-wise DMP whose rank 1 skips its dense optimizer step."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/rank1_skips_step/ws{self.world_size}"

    def dense_step(self, ctx: RunContext, optimizer: Any) -> None:
        if ctx.rank != 1:
            optimizer.step()


_RAN_IN_THIS_PROCESS: list[str] = []  # the `Misbehaves` cases this rank's process has run


@dataclass(frozen=True)
class Misbehaves(Setting):
    """Rank 1 raises, aborts or hangs; rank 0 waits in a collective, as a real failing setting would leave it."""

    family: ClassVar[str] = "faults"
    how: str
    world_size: int = 2

    @property
    def name(self) -> str:
        return f"faults/{self.how}/ws{self.world_size}"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch.distributed as dist

        if ctx.rank == 1:
            if self.how == "raises":
                raise ValueError("planted failure on rank 1")
            if self.how == "aborts":
                os.abort()
            if self.how == "hangs":
                time.sleep(3600)
            if self.how.startswith("aborts_when_reused") and _RAN_IN_THIS_PROCESS:
                os.abort()  # what an earlier case left in the process, not this case, kills it
        _RAN_IN_THIS_PROCESS.append(self.name)
        dist.barrier(group=ctx.group)
        return {}


@dataclass(frozen=True)
class RefusesEverything(Setting):
    """Never supports a model: must be counted as unsupported with its reason."""

    family: ClassVar[str] = "faults"
    world_size: int = 2

    @property
    def name(self) -> str:
        return "faults/refuses/ws2"

    def supports(self, spec: Any) -> str | None:
        return "planted refusal: this setting supports no model"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        raise AssertionError("the engine ran a setting that refused the model")


@dataclass(frozen=True)
class ReshardDropsOptimizerState(ReshardedResume):
    """A checkpoint's second phase that loads the model but not the fused optimizer's state: the row accumulators
    start again from zero after the resume."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/reshard-drops-optimizer-state/{self.optimizer}"

    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        TorchRecSharding.load_initial_state(self, ctx, dmp, state)
        if self.phase == 2:
            import torch.distributed.checkpoint as dcp

            loaded = {"model": dmp.state_dict()}
            dcp.load(loaded, checkpoint_id=self.checkpoint, process_group=ctx.group)
            dmp.load_state_dict(loaded["model"])


register_settings(
    [
        ShardOffByOneRow(sharding="row_wise", world_size=2),
        ReshardDropsOptimizerState(sharding="table_wise", after_sharding="column_wise", after_world_size=2,
                                   optimizer="adagrad"),
        RankSkipsOptimizerStep(sharding="table_wise", world_size=2),
        Misbehaves("raises"),
        Misbehaves("aborts"),
        Misbehaves("hangs"),
        Misbehaves("aborts_when_reused"),
        Misbehaves("aborts_when_reused_too"),
        RefusesEverything(),
    ]
)


@dataclass(frozen=True)
class ConvertedKernelFlipped(Conversion):
    """onnx2pytorch conversion whose first mapped multi-row kernel has its rows reversed (a mis-laid-out weight)."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/convert_flipped_kernel/{self.phase}"

    def converted(self, module: Any) -> Any:
        import torch

        for _name, view in module.keras_parameters().items():
            if view.dim() >= 2 and view.shape[0] > 1:
                with torch.no_grad():
                    view.copy_(view.flip(0))
                return module
        raise RuntimeError("no multi-row kernel to flip")


@dataclass(frozen=True)
class MirroredLocalMeanLoss(TensorFlowStrategy):
    """MirroredStrategy whose replicas average their loss over their *local* batch: gradients × replicas."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/tf_local_mean_loss/r{self.replicas}"

    def loss_denominator(self, global_batch: int, replicas: int) -> int:
        return global_batch // replicas


@dataclass(frozen=True)
class QuantizedKernelScaled(TensorFlowQuantization):
    """A float16-quantized Keras model whose first kernel is 64 half-precision steps (2^-5) too large before it is
    quantized: an error no rounding of the scheme explains."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/quant_kernel_scaled/{self.scheme}"

    def quantized_source(self, model: Any) -> Any:
        keras_model = super().quantized_source(model)
        kernel = next(w for w in keras_model.weights if len(w.shape) >= 2)
        kernel.assign(kernel * (1 + 64 * 2**-11))
        return keras_model


register_settings([ConvertedKernelFlipped("onnx2pytorch", "eval"), ConvertedKernelFlipped("onnx2pytorch", "train"),
                   MirroredLocalMeanLoss("mirrored", 2), QuantizedKernelScaled("float16")])


@dataclass(frozen=True)
class QuantizedTableCorrupted(QuantizedEmbeddings):
    """Sharded quantized embeddings whose first table is loaded with its fp16 row scales 2% too large
    (`corrupt="scale"`) or its row biases one quantization step too high (`corrupt="bias"`)."""

    family: ClassVar[str] = "faults"
    corrupt: str = "scale"

    @property
    def name(self) -> str:
        return f"faults/quant_table_{self.corrupt}/{self.weights}/{self.sharding}/sim-ws{self.simulated_world}"

    def load_quantized_state(self, sharded: Any, state: dict) -> None:
        state = dict(state)
        scale_key = sorted(k for k in state if k.endswith(".weight_qscale"))[0]
        if self.corrupt == "scale":
            state[scale_key] = (state[scale_key].float() * 1.02).half()
        else:
            bias_key = scale_key.replace("_qscale", "_qbias")
            state[bias_key] = (state[bias_key].float() + state[scale_key].float()).half()
        super().load_quantized_state(sharded, state)


register_settings([QuantizedTableCorrupted("int8", "fp32", "table_wise", 2, corrupt=c) for c in ("scale", "bias")])


# --- negative controls of the parallelism families (issue 5) ----------------------------------------------

from settings.fsdp import FullyShard  # noqa: E402
from settings.fsdp_legacy import LegacyFsdp  # noqa: E402
from settings.pipeline import Pipeline  # noqa: E402
from settings.tensor_parallel import TensorParallel  # noqa: E402


@dataclass(frozen=True)
class StageDropsGradScaling(Pipeline):
    """GPipe whose stage on rank 1 undoes the schedule's 1/micro-batches gradient scaling."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/pipeline_unscaled_stage/ws{self.world_size}/mb{self.microbatches}"

    def after_backward(self, ctx: RunContext, modules: dict) -> None:
        if ctx.rank == 1:
            _scale_gradients(modules, self.microbatches)


def _scale_gradients(modules: dict, factor: float) -> None:
    for module in modules.values():
        for parameter in module.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(factor)


@dataclass(frozen=True)
class HybridReplicaSumsGradients(Pipeline):
    """2 pipelines × 2 stages with DDP inside, whose second replica sums its stages' gradients over the replicas
    instead of averaging them (gloo has no AVG): the replicas drift apart after one step."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/hybrid_replica_sums/dp{self.data_parallel}x{self.inner}/mb{self.microbatches}"

    def after_backward(self, ctx: RunContext, modules: dict) -> None:
        if ctx.rank // self.pipeline_ranks == 1:
            _scale_gradients(modules, self.data_parallel)


@dataclass(frozen=True)
class LegacyFsdpRankSkipsPredivide(LegacyFsdp):
    """FSDP1 whose rank 1 does not pre-divide its gradient before the reduce-scatter sums it: that rank's
    share counts twice as much in every rank's gradient."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/fsdp1_skip_predivide/{self.strategy}/ws{self.world_size}"

    def wrapped(self, ctx: RunContext, module: Any) -> None:
        if ctx.rank == 1:
            module._gradient_predivide_factor = 1.0


@dataclass(frozen=True)
class TensorParallelWrongDim(TensorParallel):
    """Tensor parallel whose second layer of a pair is split on its output dim (column-wise) instead of its
    input dim, and whose ranks carry on with their local slice as if it were the whole output."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/tp_wrong_dim/ws{self.world_size}"

    def style(self, spec: dict[str, Any]) -> Any:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel

        if spec["style"] != "rowwise":
            return super().style(spec)
        return ColwiseParallel(input_layouts=Shard(-1), use_local_output=True)


@dataclass(frozen=True)
class FsdpRankSkipsReduceScatter(FullyShard):
    """FSDP2 (one unit) whose rank 1 turns off the unit's gradient reduce-scatter."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/fsdp_skip_reduce_scatter/ws{self.world_size}"

    def sharded(self, ctx: RunContext, module: Any) -> None:
        if ctx.rank == 1:
            module.set_requires_gradient_sync(False, recurse=False)


register_settings([StageDropsGradScaling("gpipe", 2, 2), TensorParallelWrongDim(2),
                   FsdpRankSkipsReduceScatter(2, "whole-model"),
                   HybridReplicaSumsGradients("gpipe", 4, 2, data_parallel=2, inner="ddp"),
                   LegacyFsdpRankSkipsPredivide(2, "full_shard")])


# --- issue 6: the seeds' oracles ---------------------------------------------------------------------
from settings._resumable import CARRIED, Placement  # noqa: E402
from settings.resume import Resume  # noqa: E402


@dataclass(frozen=True)
class ResumeForgets(Resume):
    """A single-process resume whose checkpoint leaves one piece of state behind."""

    forgets: str = "optimizer"
    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/resume_forgets_{self.forgets}"

    @property
    def carried(self) -> frozenset[str]:
        return CARRIED - {self.forgets}


register_settings([ResumeForgets(Placement("single"), Placement("single"), 3, forgets=f)
                   for f in ("optimizer", "rng", "loader")])


from settings.repartition import Repartition  # noqa: E402


@dataclass(frozen=True)
class RepartitionLosesKey(Repartition):
    """A re-partition that loads the moved state with strict=False after one key went missing on the way."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/repartition_loses_key/ws{self.world_size}"

    def load_moved(self, stages: Any, state: dict) -> None:
        mine = sorted(f"param/{k}" for k in stages.parameters)
        kept = {k: v for k, v in state.items() if k not in mine[-1:]}
        stages.load({**kept, **{f"param/{k}": p.detach() for k, p in stages.parameters.items()
                                if f"param/{k}" not in kept}})  # strict=False: a missing key keeps its value


register_settings([RepartitionLosesKey("gpipe", 2, 2)])


from settings.partial_reduce import PartialReduce  # noqa: E402


@dataclass(frozen=True)
class PartialAverageForgetsReplica(PartialReduce):
    """Partial reduce whose group average leaves its last member out (still dividing by the group's size)."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/partial_average_forgets_replica/ws{self.world_size}"

    def average(self, members: list) -> Any:
        return sum(members[:-1]) / len(members) if len(members) > 1 else members[0]


register_settings([PartialAverageForgetsReplica(4, 2, 2)])


from settings.async_pipeline import AsyncPipeline  # noqa: E402


@dataclass(frozen=True)
class StashQueueOneShort(AsyncPipeline):
    """PipeDream weight stashing whose per-stage stash queue holds one version fewer than in flight."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/stash_queue_one_short/stages{self.world_size}"

    def stash_capacity(self, stage: int) -> int:
        return max(1, super().stash_capacity(stage) - 1)


register_settings([StashQueueOneShort("stash", 2, 4)])


from settings.reference import Reference  # noqa: E402


@dataclass(frozen=True)
class UnseededLearningRate(Reference):
    """The reference, but its learning rate wobbles with the OS's randomness: a run twice does not repeat."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return "faults/unseeded_lr"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import dataclasses

        wobble = 1.0 + (int.from_bytes(os.urandom(4), "little") % 10**6 + 1) * 1e-6  # two runs agree 1 in 10⁶
        return super().run(dataclasses.replace(ctx, lr=ctx.lr * wobble), model, inputs)


register_settings([UnseededLearningRate()])


@dataclass(frozen=True)
class DeterminismModeProbe(Setting):
    """Not a fault: records the deterministic-algorithms mode the worker ran it under, for the tests."""

    world_size: int = 1
    family: ClassVar[str] = "probes"

    @property
    def name(self) -> str:
        return "probes/determinism_mode"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import numpy as np
        import torch

        mode = [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()]
        return {"mode/deterministic_warn_only": np.array(mode, dtype=np.int8)}


register_settings([DeterminismModeProbe()])


@dataclass(frozen=True)
class StagesClipAlone(PipelineClipping):
    """Each pipeline rank clips its stages' gradients by their own norm, never reduced over the pipeline (the mistake
    torchtitan's pipeline clipping exists to avoid): the stages scale by different factors."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/stages_clip_alone/ws{self.world_size}"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from settings._pipeline_stages import clip_stages

        clipping = {"norm": self.norm, "max_norm": MAX_NORM, "device": ctx.device}
        return self.parallel().trained(ctx, model, inputs,
                                       before_step=lambda stages, _group: clip_stages(stages.values(), clipping, None))


register_settings([StagesClipAlone(2)])


@dataclass(frozen=True)
class LeavesTemporaryFile(Setting):
    """Not a fault: leaves a file in the temporary folder, as TensorFlow's autograph does for each function it converts
    (for deletion at exit), and answers its path, for the tests."""

    world_size: int = 2
    family: ClassVar[str] = "probes"

    @property
    def name(self) -> str:
        return "probes/leaves_temp_file"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import tempfile

        import numpy as np

        with tempfile.NamedTemporaryFile(delete=False) as left:
            left.write(b"left behind")
        return {"path/utf8": np.frombuffer(left.name.encode(), dtype=np.uint8)}


register_settings([LeavesTemporaryFile()])


@dataclass(frozen=True)
class GlooAddresses(Setting):
    """Reports the local address of every TCP socket of rank 0 after an all-reduce, and the interface gloo was told
    to bind to: a case's connections belong on the loopback."""

    world_size: int = 2
    family: ClassVar[str] = "probes"

    @property
    def name(self) -> str:
        return "probes/gloo_addresses"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import os
        import socket

        import numpy as np
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(4), group=ctx.group)
        addresses = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(int(fd)))
            except OSError:  # closed meanwhile
                continue
            with sock:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    addresses.add(str(sock.getsockname()[0]))
        if ctx.rank:
            return None
        text = f"{os.environ.get('GLOO_SOCKET_IFNAME', '')}|{','.join(sorted(addresses))}"
        return {"addresses/utf8": np.frombuffer(text.encode(), dtype=np.uint8)}


register_settings([GlooAddresses()])


def _visible_gpus_in_a_new_process(request: Any, rank: int) -> Outputs:
    import os

    import numpy as np

    return {"seen/utf8": np.frombuffer(os.environ.get("CUDA_VISIBLE_DEVICES", "unset").encode() or b"none", np.uint8)}


@dataclass(frozen=True)
class VisibleGpus(Setting):
    """Reports CUDA_VISIBLE_DEVICES as a rank sees it and as a process the rank starts through the runner sees it:
    the CPU ranks' import server hides the GPUs, so that what it imports never touches one."""

    world_size: int = 1
    family: ClassVar[str] = "probes"

    @property
    def name(self) -> str:
        return "probes/visible_gpus"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import os
        import tempfile
        from pathlib import Path

        import numpy as np

        from difftest import run_in_processes

        started = run_in_processes(_visible_gpus_in_a_new_process, {}, 1, Path(tempfile.mkdtemp()), "gpus")
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "unset").encode() or b"none"
        return {"rank/utf8": np.frombuffer(seen, np.uint8), "started/utf8": started["seen/utf8"]}


register_settings([VisibleGpus()])


@dataclass(frozen=True)
class LaterKernelScaled(Setting):
    """The reference with the weights of one layer before the logits 1 % too large (`scaled_layer`): every layer
    before it is exact, so the first divergence must name that layer's activation."""

    world_size: int = 1
    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return "faults/later_kernel_scaled"

    def supports(self, spec: Any) -> str | None:
        return None if spec.kind == "sequential" else "planted on Keras models only"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        from settings._training import build_for_training, train_single_process

        module = build_for_training(model, ctx.device)
        with torch.no_grad():
            for name, view in module.keras_parameters().items():
                if name.startswith(f"{scaled_layer(model, module)}/"):
                    view.mul_(1.01)
        return train_single_process(ctx, model, inputs, module)


def scaled_layer(model: Any, module: Any) -> str:
    """The layer `LaterKernelScaled` scales: the last but one layer with weights, in the spec's layer order (the last,
    if it is the only one)."""
    weights = module.keras_parameters()
    layers = [layer["name"] for layer in model.spec.params["layers"]
              if any(name.startswith(f"{layer['name']}/") for name in weights)]
    return layers[-2] if len(layers) > 1 else layers[-1]


register_settings([LaterKernelScaled()])


@dataclass(frozen=True)
class TitanRankSkipsStep(TorchtitanRecipe):
    """torchtitan's FSDP2 recipe whose rank 1 skips its optimizer step (its shard of every parameter stays)."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/titan_rank1_skips_step/ws{self.ranks}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return "reference"

    def optimizer_step(self, ctx: RunContext, optimizer: Any) -> None:
        if ctx.rank != 1:
            optimizer.step()


register_settings([TitanRankSkipsStep(data_parallel=2)])


@dataclass(frozen=True)
class TitanLastStageSkipsStep(TorchtitanPipelineRecipe):
    """torchtitan's pipelined recipe whose last pipeline rank skips its optimizer step (its stages' weights stay)."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/titan_last_stage_skips_step/ws{self.ranks}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return "reference"

    def optimizer_step(self, ctx: RunContext, optimizer: Any) -> None:
        if ctx.rank != self.ranks - 1:
            optimizer.step()


register_settings([TitanLastStageSkipsStep(data_parallel=1)])


from settings.hf_distributed import TransformersDistributed  # noqa: E402


@dataclass(frozen=True)
class HfDataParallelWithoutSync(TransformersDistributed):
    """Each rank trains on its share of the batch, but the model is loaded without the `DistributedConfig`: plain
    replicas whose gradients are never synchronised (rank 0's weights are one share's training)."""

    family: ClassVar[str] = "faults"

    @property
    def name(self) -> str:
        return f"faults/hf_data_parallel_without_sync/ws{self.ranks}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return "reference"

    def config(self) -> dict[str, Any]:
        return {}


register_settings([HfDataParallelWithoutSync(fsdp=2)])
