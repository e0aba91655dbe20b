"""Faults planted in the libraries' own code paths, from outside difftest: a plugin (`--plugin benchmarks.faults.inject`)
that, when `DIFFTEST_FAULT=<class>:<relative magnitude>` is set, replaces one library function at import time in
every process that loads plugins (sweep workers, and the processes a resume starts).

Each class scales by (1 + magnitude) one quantity a library computes on a distributed, sharded, converted or
quantized path only, so the single-process fp32 reference is untouched — a silent defect of that size in the
library. Nothing in difftest's settings is changed: the settings run as they always do.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV = "DIFFTEST_FAULT"


@dataclass(frozen=True)
class FaultClass:
    name: str
    library: str  # where the patched code lives
    what: str  # the defect it simulates
    settings: str  # the settings (globs) whose path goes through it
    kinds: tuple[str, ...]  # model kinds those settings run
    patch: Callable[[float], None]


def _scale(value: Any, factor: float) -> Any:
    """`value` times `factor`: tensors (in place where the library expects its buffer to change) and sequences."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value * factor
    if isinstance(value, (list, tuple)):
        return type(value)(_scale(v, factor) for v in value)
    return value


def _wrap(owner: Any, attribute: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, attribute)
    if isinstance(original, staticmethod):  # looked up on the class dict below
        original = original.__func__
    raw = owner.__dict__.get(attribute) if isinstance(owner, type) else None
    wrapped = functools.wraps(original)(make(original))
    setattr(owner, attribute, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)


# --- one function per class: what it replaces, and how ------------------------------------------------------------

def _ddp_allreduce(m: float) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    def hook(state: Any, bucket: Any) -> Any:
        return default_hooks.allreduce_hook(state, bucket).then(lambda fut: fut.value() * (1 + m))

    def make(init: Callable) -> Callable:
        def patched(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.register_comm_hook(None, hook)  # DDP's bucket all-reduce, its result off by m
        return patched
    _wrap(DistributedDataParallel, "__init__", make)


def _fsdp2_reduce_scatter(m: float) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def make(reduce: Callable) -> Callable:
        def patched(fsdp_params: Any, unsharded_grads: list, *args: Any, **kwargs: Any) -> Any:
            for grad in unsharded_grads:
                grad.mul_(1 + m)
            return reduce(fsdp_params, unsharded_grads, *args, **kwargs)
        return patched
    _wrap(_fsdp_param_group, "foreach_reduce", make)


def _fsdp2_all_gather(m: float) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def make(copy_out: Callable) -> Callable:
        def patched(result: Any, fsdp_params: list, group: Any) -> Any:
            out = copy_out(result, fsdp_params, group)
            import torch

            with torch.no_grad():
                for param in fsdp_params:  # the gathered parameter a forward uses, off by m
                    for tensor in getattr(param, "all_gather_outputs", []) or []:
                        if tensor.is_floating_point():
                            tensor.mul_(1 + m)
            return out
        return patched
    _wrap(_fsdp_param_group, "foreach_all_gather_copy_out", make)


def _fsdp1_predivide(m: float) -> None:
    from torch.distributed.fsdp import _runtime_utils

    def make(divide: Callable) -> Callable:
        def patched(tensor: Any, div_factor: float) -> None:
            divide(tensor, div_factor)
            if div_factor > 1:
                tensor.mul_(1 + m)  # a gradient divided by a factor off by m
        return patched
    _wrap(_runtime_utils, "_div_if_needed", make)


def _tp_rowwise_output(m: float) -> None:
    from torch.distributed.tensor.parallel import style

    def make(prepare: Callable) -> Callable:
        def patched(*args: Any) -> Any:
            return _scale(prepare(*args), 1 + m)  # the all-reduced partial sums of a rowwise layer
        return patched
    _wrap(style.RowwiseParallel, "_prepare_output_fn", make)


def _pipeline_scale_grads(m: float) -> None:
    from torch.distributed.pipelining import stage

    def make(scale: Callable) -> Callable:
        def patched(self: Any, grad_scale_factor: int) -> None:
            scale(self, grad_scale_factor * (1 + m))  # divides by the micro-batch count, off by m
        return patched
    _wrap(stage._PipelineStageBase, "scale_grads", make)


def _pipeline_stage_output(m: float) -> None:
    from torch.distributed.pipelining import stage

    def make(forward: Callable) -> Callable:
        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = forward(self, *args, **kwargs)
            return output if self.is_last else _scale(output, 1 + m)  # what a stage sends on to the next
        return patched
    _wrap(stage._PipelineStageBase, "forward_maybe_with_nosync", make)


def _torchrec_lookup(m: float) -> None:
    from torchrec.distributed import embedding_lookup

    def make(forward: Callable) -> Callable:
        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _scale(forward(self, *args, **kwargs), 1 + m)  # a sharded table's pooled lookups
        return patched
    _wrap(embedding_lookup.GroupedPooledEmbeddingsLookup, "forward", make)


def _torchrec_fused_sgd(m: float) -> None:
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as training

    def make(init: Callable) -> Callable:
        def patched(self: Any, *args: Any, **kwargs: Any) -> None:
            if "learning_rate" in kwargs:
                kwargs["learning_rate"] *= 1 + m  # the fused optimizer's step size
            init(self, *args, **kwargs)
        return patched
    _wrap(training.SplitTableBatchedEmbeddingBagsCodegen, "__init__", make)


def _dcp_load(m: float) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_loader

    def make(load: Callable) -> Callable:
        def patched(state_dict: dict, *args: Any, **kwargs: Any) -> Any:
            out = load(state_dict, *args, **kwargs)

            def scale(value: Any) -> None:
                if isinstance(value, dict):
                    for v in value.values():
                        scale(v)
                elif isinstance(value, torch.Tensor) and value.is_floating_point():
                    local = value.to_local() if hasattr(value, "to_local") else value
                    with torch.no_grad():
                        local.mul_(1 + m)  # every restored float off by m
            scale(state_dict)
            return out
        return patched
    _wrap(state_dict_loader, "load", make)
    dcp.load = state_dict_loader.load


def _tf_allreduce(m: float) -> None:
    import tensorflow as tf
    from keras.src.backend.tensorflow import optimizer

    def make(all_reduce: Callable) -> Callable:
        def patched(self: Any, grads_and_vars: Any) -> Any:
            reduced = all_reduce(self, grads_and_vars)
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return reduced
            return [(None if g is None else g * (1 + m), v) for g, v in reduced]  # the summed gradients
        return patched
    _wrap(optimizer.TFOptimizer, "_all_reduce_sum_gradients", make)


def _dist_all_gather(m: float) -> None:
    import torch.distributed as dist

    def make(all_gather: Callable) -> Callable:
        def patched(tensor_list: list, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            work = all_gather(tensor_list, tensor, *args, **kwargs)
            if work is not None:
                work.wait()
            for gathered in tensor_list:
                if gathered.is_floating_point():
                    gathered.mul_(1 + m)  # c10d's Python all_gather, what it hands back off by m
            return None
        return patched
    _wrap(dist, "all_gather", make)


def _quant_dynamic_linear(m: float) -> None:
    from torch.ao.nn.quantized.dynamic.modules import linear

    def make(forward: Callable) -> Callable:
        def patched(self: Any, x: Any) -> Any:
            return forward(self, x) * (1 + m)  # a dynamically quantized Linear's output
        return patched
    _wrap(linear.Linear, "forward", make)


def _quant_nbit_embedding(m: float) -> None:
    from fbgemm_gpu import split_table_batched_embeddings_ops_inference as inference

    def make(forward: Callable) -> Callable:
        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _scale(forward(self, *args, **kwargs), 1 + m)  # dequantized, pooled rows
        return patched
    _wrap(inference.IntNBitTableBatchedEmbeddingBagsCodegen, "forward", make)


def _onnx_conversion(m: float) -> None:
    import onnx2pytorch
    import onnx2torch
    import torch
    from onnx2torch import converter

    def first_weight_scaled(module: Any) -> None:
        with torch.no_grad():  # onnx2torch keeps weights as parameters or buffers, as the op wants
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point() and tensor.dim() >= 2:
                    tensor.mul_(1 + m)  # the first weight matrix the converter carries over
                    return

    def make_convert(convert: Callable) -> Callable:
        def patched(*args: Any, **kwargs: Any) -> Any:
            module = convert(*args, **kwargs)
            first_weight_scaled(module)
            return module
        return patched

    def make_init(init: Callable) -> Callable:
        def patched(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            first_weight_scaled(self)
        return patched
    _wrap(converter, "convert", make_convert)
    onnx2torch.convert = converter.convert
    _wrap(onnx2pytorch.ConvertModel, "__init__", make_init)


def _tflite_invoke(m: float) -> None:
    import tensorflow as tf

    interpreter = tf.lite.Interpreter

    def make(get_tensor: Callable) -> Callable:
        def patched(self: Any, tensor_index: int, *args: Any, **kwargs: Any) -> Any:
            value = get_tensor(self, tensor_index, *args, **kwargs)
            outputs = {d["index"] for d in self.get_output_details()}
            return value * (1 + m) if tensor_index in outputs and value.dtype.kind == "f" else value
        return patched
    _wrap(interpreter, "get_tensor", make)


CLASSES = [
    FaultClass("ddp-allreduce", "torch.nn.parallel.DistributedDataParallel", "bucket all-reduce result scaled",
               "ddp/default/ws2", ("dlrm", "sequential"), _ddp_allreduce),
    FaultClass("fsdp2-reduce-scatter", "torch.distributed.fsdp._fully_shard (foreach_reduce)",
               "gradients scaled before the reduce-scatter", "fsdp2/per-layer/no-reshard/fp32/ws2",
               ("dlrm", "sequential"), _fsdp2_reduce_scatter),
    FaultClass("fsdp2-all-gather", "torch.distributed.fsdp._fully_shard (foreach_all_gather_copy_out)",
               "all-gathered parameters scaled", "fsdp2/per-layer/no-reshard/fp32/ws2", ("dlrm", "sequential"),
               _fsdp2_all_gather),
    FaultClass("fsdp1-predivide", "torch.distributed.fsdp._runtime_utils (_div_if_needed)",
               "gradient pre-divide factor off", "fsdp1/full_shard/ws2", ("dlrm", "sequential"), _fsdp1_predivide),
    FaultClass("tp-rowwise-output", "torch.distributed.tensor.parallel.style.RowwiseParallel",
               "rowwise layer's reduced output scaled", "tp/colwise-rowwise/ws2", ("sequential",), _tp_rowwise_output),
    FaultClass("pipeline-scale-grads", "torch.distributed.pipelining.stage (scale_grads)",
               "micro-batch gradient divisor off", "pipeline/gpipe/ws2/stages2/mb2/random,pipeline/1f1b/ws2/stages2/mb2/balanced",
               ("dlrm", "sequential"), _pipeline_scale_grads),
    FaultClass("pipeline-stage-output", "torch.distributed.pipelining.stage (forward_maybe_with_nosync)",
               "activation sent to the next stage scaled", "pipeline/1f1b/ws2/stages2/mb2/balanced",
               ("dlrm", "sequential"), _pipeline_stage_output),
    FaultClass("torchrec-lookup", "torchrec.distributed.embedding_lookup.GroupedPooledEmbeddingsLookup",
               "sharded pooled lookups scaled", "torchrec/ebc/table_wise/ws2", ("dlrm",), _torchrec_lookup),
    FaultClass("torchrec-fused-sgd", "fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen",
               "fused embedding optimizer's learning rate off", "torchrec/ebc/table_wise/ws2", ("dlrm",),
               _torchrec_fused_sgd),
    FaultClass("dcp-load", "torch.distributed.checkpoint.load", "restored tensors scaled",
               "resume/ddp-ws2/ddp-ws2/k3", ("dlrm", "sequential"), _dcp_load),
    FaultClass("tf-allreduce", "keras TFOptimizer (_all_reduce_sum_gradients)", "cross-replica gradient sum scaled",
               "tf/mirrored/r2", ("sequential",), _tf_allreduce),
    FaultClass("c10d-all-gather", "torch.distributed.all_gather", "gathered tensors scaled",
               "partial-reduce/ws2/group2/every-step", ("dlrm", "sequential"), _dist_all_gather),
    FaultClass("quant-dynamic-linear", "torch.ao.nn.quantized.dynamic.Linear", "quantized Linear output scaled",
               "quant/dynamic/qint8/onednn", ("sequential", "dlrm"), _quant_dynamic_linear),
    FaultClass("quant-nbit-embedding", "fbgemm_gpu IntNBitTableBatchedEmbeddingBagsCodegen",
               "dequantized pooled embeddings scaled",
               "quant/torchrec/fp16/out-fp16/unsharded,quant/torchrec/int8/out-fp16/column_wise/sim-ws2", ("dlrm",),
               _quant_nbit_embedding),
    FaultClass("onnx-conversion", "onnx2torch.convert, onnx2pytorch.ConvertModel", "a converted weight scaled",
               "convert/onnx2torch/train,convert/onnx2pytorch/eval", ("sequential",), _onnx_conversion),
    FaultClass("tflite-output", "tf.lite.Interpreter (get_tensor)", "interpreter output scaled",
               "quant/tflite/float16", ("sequential",), _tflite_invoke),
]
BY_NAME = {c.name: c for c in CLASSES}


def _apply_from_environment() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, magnitude = spec.partition(":")
    if name not in BY_NAME:
        raise ValueError(f"{ENV}={spec!r}: unknown fault class; classes: {', '.join(BY_NAME)}")
    BY_NAME[name].patch(float(magnitude))


_apply_from_environment()
