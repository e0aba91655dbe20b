"""Embedding tables quantized as TorchRec's inference modules quantize them and sharded for inference, as the quantized
setting runs them and its standalone script copies them (these functions as they are)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

from settings._torchrec_plan import _column_shards
from settings._torchrec_script import _pooled, standalone_features, standalone_tables

# the quantized weight types (torch dtype, bits) and output types TorchRec's inference modules offer
WEIGHT_TYPES = {"int8": ("qint8", 8), "int4": ("quint4x2", 4), "int2": ("quint2x4", 2), "fp16": ("float16", 0), "bf16": ("bfloat16", 0)}
OUTPUT_TYPES = {"fp32": "float32", "fp16": "float16"}


def quantize(float_module: Any, per_table: dict[str, str], output: str) -> Any:
    """A copy of the model whose EmbeddingBagCollections are TorchRec's quantized inference modules."""
    import torch
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.quant.embedding_modules import quant_prep_enable_quant_state_dict_split_scale_bias_for_types

    module = copy.deepcopy(float_module)
    # scale and bias as their own state-dict entries: the only mode in which TorchRec shards row-/column-wise
    quant_prep_enable_quant_state_dict_split_scale_bias_for_types(module, [EmbeddingBagCollection])
    dtypes = {table: getattr(torch, WEIGHT_TYPES[weights][0]) for table, weights in per_table.items()}
    quantize_embeddings(
        module, dtype=next(iter(dtypes.values())), inplace=True, output_dtype=getattr(torch, OUTPUT_TYPES[output]),
        per_table_weight_dtype=dtypes,
    )
    return module


def quantized_placement(sharding: str, position: int, table: dict, world: int) -> Any:
    from torchrec.distributed import sharding_plan as sp

    if sharding == "table_wise":
        return sp.table_wise(rank=position % world)
    if sharding == "row_wise":
        return sp.row_wise()
    count = _column_shards(table["embedding_dim"], world)
    return sp.column_wise(ranks=[(position + j) % world for j in range(count)])


def quantized_plan(quantized: Any, layout: dict[str, list[dict]], sharding: str, world: int, device_type: str) -> Any:
    """TorchRec's plan for the quantized collections (`layout`: each collection's path and its tables, in order)."""
    from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan({path: construct_module_sharding_plan(
        quantized.get_submodule(path), {t["name"]: quantized_placement(sharding, i, t, world) for i, t in enumerate(tables)},
        sharder=QuantEmbeddingBagCollectionSharder(), local_size=world, world_size=world, device_type=device_type,
    ) for path, tables in layout.items()})


def shard_quantized(quantized: Any, plan: Any, world: int, device: str) -> Any:
    """The quantized model sharded over `world` ranks simulated in this process (its state not loaded yet)."""
    import torch
    from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from torchrec.distributed.shard import _shard_modules
    from torchrec.distributed.types import ShardingEnv

    return _shard_modules(module=quantized, env=ShardingEnv.from_local(world, 0), plan=plan,
                          sharders=[QuantEmbeddingBagCollectionSharder()], device=torch.device(device))


# --- what a standalone script runs (plain torch/torchrec: copied into the script as they are) ------------------------
def standalone_quantized(data: dict[str, Any], case: dict[str, Any]) -> Any:
    """The script's collections with the initial weights, quantized as the case says."""
    import torch

    tables = standalone_tables(case)
    tables.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    return quantize(tables, case["per_table"], case["output"])


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the quantized collections unsharded, on the whole batch (quantized bytes: `dtype` is moot)."""
    import torch

    with _cpu_inference_sharding(case["device"]), torch.no_grad():
        pooled = standalone_quantized(data, case)(standalone_features(data, case, 0, case["batch"], torch.float32))
    return {k: v.astype(np.float32) for k, v in _pooled(pooled, case).items()}


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: the quantized collections, sharded over the simulated ranks unless unsharded, on the whole batch."""
    import torch

    quantized = standalone_quantized(data, case)
    with _cpu_inference_sharding(case["device"]), torch.no_grad():
        if case["sharding"] != "unsharded":
            layout = {path: [t for t in case["tables"] if t["collection"] == path]
                      for path in dict.fromkeys(t["collection"] for t in case["tables"])}
            plan = quantized_plan(quantized, layout, case["sharding"], case["world"], case["device"])
            state = quantized.state_dict()
            quantized = shard_quantized(quantized, plan, case["world"], case["device"])
            quantized.load_state_dict(state)
        pooled = quantized(standalone_features(data, case, 0, case["batch"], torch.float32))
    return {k: v.astype(np.float32) for k, v in _pooled(pooled, case).items()}


@contextlib.contextmanager
def _cpu_inference_sharding(device: str) -> Iterator[None]:
    """TorchRec places inference shards on cuda:<rank> unless told to follow the given device (global flag)."""
    from torchrec.distributed import global_settings

    before = global_settings.get_propogate_device()
    global_settings.set_propogate_device(True)
    try:
        yield
    finally:
        global_settings.set_propogate_device(before)
