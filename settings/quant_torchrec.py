"""TorchRec quantized inference embeddings (QuantEmbeddingBagCollection), unsharded and sharded.

`quant/torchrec/<weights>/out-<output>/unsharded` swaps every EmbeddingBagCollection of the float model for its
quantized form (row-wise int8/int4/int2 with fp16 scale and bias, or fp16/bf16 weights) and is judged against
the float `reference` within a bound derived from that rounding (oracle 2).

`quant/torchrec/<weights>/out-<output>/<sharding>/sim-ws<N>` then shards the same quantized model with
TorchRec's quantized sharder over N simulated ranks in this one process (`ShardingEnv.from_local`, as TorchRec's
inference tests and D3 do) and is judged against the unsharded quantized model (oracle 1): same quantized bytes,
so all that may differ is the order of additions, a few units of the output type; anything past that is a
distribution bug.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import (
    Outputs,
    RunContext,
    Script,
    Setting,
    StandaloneCase,
    Unsupported,
    refuse_changed_hooks,
    register_settings,
    to_numpy,
    traits_of,
)
from settings import _error_bounds as bounds
from settings._quantized_tables import (
    OUTPUT_TYPES,
    WEIGHT_TYPES,
    _cpu_inference_sharding,
    on_rank,
    quantize,
    quantized_placement,
    quantized_plan,
    shard_quantized,
    single_process,
    standalone_quantized,
)
from settings._torchrec_plan import _column_shards, collection_tables, embedding_collections
from settings._torchrec_script import (
    _pooled,
    bag_runs_kjt,
    embedding_script_data,
    standalone_features,
    standalone_tables,
)

# name -> (torch dtype attribute, bits of a row-wise integer scheme or 0 for a float type)
# what QuantEmbeddingBagCollectionSharder offers on CPU (it refuses table_row_wise, table_column_wise, data_parallel)
SHARDINGS = ("table_wise", "row_wise", "column_wise")
SIMULATED_WORLDS = (1, 2, 3, 4)


@dataclass(frozen=True)
class QuantizedEmbeddings(Setting):
    """A DLRM's EmbeddingBagCollections quantized for inference (TorchRec QuantEmbeddingBagCollection)."""

    family: ClassVar[str] = "quant"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "simulated_world"})
    precision: ClassVar[str] = "quantized"  # judged by the bounds its scheme's rounding implies, not an envelope
    tier_axes: ClassVar[tuple[str, ...]] = ("weights", "output", "sharding")
    weights: str
    output: str
    sharding: str = "unsharded"
    simulated_world: int = 1
    world_size: int = 1  # one process; the sharded world is simulated inside it

    @property
    def scale(self) -> int:
        return self.simulated_world

    @property
    def name(self) -> str:
        base = f"quant/torchrec/{self.weights}/out-{self.output}/unsharded"
        return base if self.sharding == "unsharded" else base.replace("unsharded", f"{self.sharding}/sim-ws{self.simulated_world}")

    @property
    def reference(self) -> str:  # type: ignore[override]
        if self.sharding == "unsharded":
            return "reference"
        return QuantizedEmbeddings(self.weights, self.output).name

    def describe(self) -> str:
        what = f"{self.weights} embedding weights, {self.output} pooled output"
        if self.sharding == "unsharded":
            return f"Quantized EBC ({what}), unsharded, vs float within the rounding bound"
        return f"Quantized EBC ({what}), {self.sharding} over {self.simulated_world} simulated ranks, vs unsharded"

    def judges(self, tensor_name: str) -> bool:
        return tensor_name.startswith("eval_before/")

    def supports(self, spec: Any) -> str | None:
        if "torchrec" not in traits_of(spec.kind):
            return f"quantized TorchRec embeddings need EmbeddingBagCollections; model kind {spec.kind!r} has none"
        return None

    def table_weights(self, tables: list[dict]) -> dict[str, str]:
        """Each table's weight type: this setting's, except int2 on a table whose packed row is an odd number
        of bytes (fbgemm aligns rows to the fp16 scale/bias), which stays int4, as a deployment would."""
        bits = WEIGHT_TYPES[self.weights][1]
        return {
            t["name"]: "int4" if bits == 2 and (t["embedding_dim"] * bits // 8) % 2 else self.weights for t in tables
        }

    def available(self) -> str | None:
        try:
            import fbgemm_gpu  # noqa: F401
            import torchrec  # noqa: F401
        except Exception as exc:
            return f"torchrec/fbgemm do not import ({type(exc).__name__}: {exc}); run ./install.sh"
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        float_module = model.build(ctx.device)
        by_name = {t["name"]: t for t in model.spec.params["tables"]}
        # quantizing swaps each collection in place: where they live is read off the float model
        layout = {path: [by_name[t["name"]] for t in collection_tables(collection)]
                  for path, collection in embedding_collections(float_module).items()}
        per_table = self.table_weights(model.spec.params["tables"])
        if set(per_table.values()) != {self.weights}:
            ctx.notes["weights"] = " ".join(f"{t}={w}" for t, w in sorted(per_table.items()))
        quantized = quantize(float_module, per_table, self.output)
        with _cpu_inference_sharding(ctx.device):
            if self.sharding != "unsharded":
                quantized = self.shard(ctx, quantized, layout)
            with torch.no_grad():
                predicted = model.evaluate(quantized, inputs.eval, ctx.device)
        outputs = {f"eval_before/{name}": to_numpy(value.float()) for name, value in predicted.items()}
        outputs.update(self.allowed_error(ctx, model, float_module, inputs.eval, per_table, layout))
        return outputs

    # --- oracle 1: the sharded copy of the same quantized model --------------------------------------------
    def shard(self, ctx: RunContext, quantized: Any, layout: dict[str, list[dict]]) -> Any:
        try:
            plan = quantized_plan(quantized, layout, self.sharding, self.simulated_world, ctx.device.split(":")[0])
        except (ValueError, AssertionError, NotImplementedError) as exc:
            raise Unsupported(f"TorchRec cannot build this plan: {type(exc).__name__}: {exc}") from exc
        ctx.notes["plan"] = " ".join(
            sorted(f"{t}={p.sharding_type}@{p.ranks}" for m in plan.plan.values() for t, p in m.items())
        )
        state = quantized.state_dict()
        sharded = shard_quantized(quantized, plan, self.simulated_world, ctx.device)
        self.load_quantized_state(sharded, state)
        return sharded

    def load_quantized_state(self, sharded: Any, state: dict) -> None:
        """TorchRec's own way of giving a sharded inference model its weights (a hook for planted faults)."""
        sharded.load_state_dict(state)

    # --- a standalone script (difftest.scripts.emit) ------------------------------------------------
    def standalone(self, case: StandaloneCase) -> Script:
        refuse_changed_hooks(self, QuantizedEmbeddings, "load_quantized_state")
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        pooled = {f"eval_before/{name}": name for t in tables for name in t.outputs}
        phase, _, tensor = case.first_divergence.partition("/")
        if not case.failure:
            if self.sharding == "unsharded":
                raise Unsupported("an unsharded quantized model is judged by the bound its rounding implies, which "
                                  "the script does not compute")
            if phase != "eval_before" or not tensor.startswith("pooled"):
                raise Unsupported(f"it first diverges at {case.first_divergence or 'no tensor'}, not at a pooled "
                                  "embedding, which is what the script compares")
        batch = case.inputs["eval"]
        data, table_list = embedding_script_data(case, tables)
        how = "unsharded" if self.sharding == "unsharded" else (
            f"sharded {self.sharding} over {self.simulated_world} ranks simulated in one process "
            "(ShardingEnv.from_local, as TorchRec's inference tests do)")
        return Script(
            summary=f"TorchRec EmbeddingBagCollections quantized for inference ({self.weights} weights, {self.output} "
                    f"pooled output: QuantEmbeddingBagCollection), {how}"
                    + case.against("the same quantized collections unsharded, which hold the same quantized bytes "
                                   "(only the order of additions may differ): the pooled embeddings of one batch")
                    + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import contextlib", "import copy", "", f"WEIGHT_TYPES = {WEIGHT_TYPES!r}",
                      f"OUTPUT_TYPES = {OUTPUT_TYPES!r}"),
            case={"sharding": self.sharding, "world": self.simulated_world, "output": self.output, "device": "cpu",
                  "batch": batch.size, "per_table": self.table_weights(case.spec.params["tables"]),
                  "tables": table_list},
            functions=(standalone_tables, standalone_features, bag_runs_kjt, _pooled, quantize, _cpu_inference_sharding,
                       _column_shards, quantized_placement, quantized_plan, shard_quantized, standalone_quantized,
                       single_process, on_rank),
            tensors={name: recorded for recorded, name in pooled.items()},
            data=data, world_size=1)

    # --- the bounds ---------------------------------------------------------------------------------------
    def allowed_error(self, ctx: RunContext, model: Any, float_module: Any, batch: Any, per_table: dict,
                      layout: dict[str, list[dict]]) -> Outputs:
        """`allowed/eval_before/*`: per pooled bag, then to first order through the dense part to the prediction.

        Unsharded (oracle 2, vs float): each element may be off by its table's rounding error, and an fp16
        output by one more rounding. Sharded (oracle 1, vs unsharded, same quantized bytes): only the order of
        the additions may change; with fp16 output each rank's partial sum is rounded before the ranks' sums are
        added, so an element may be off by (ranks + 2) units of the output type times the bag's magnitude.
        """
        import torch

        output_unit = bounds.FP16_UNIT if self.output == "fp16" else bounds.FP32_UNIT
        pooled_bounds: dict[str, np.ndarray] = {}
        reference = bounds.trainable_copy(float_module)
        evaluated = model.evaluate(reference, batch, ctx.device)  # with grad: sensitivities of the prediction
        for path, table in ((path, t) for path, tables in layout.items() for t in tables):
            weights = model.init_state[f"{path}.embedding_bags.{table['name']}.weight"]
            rounding = element_rounding(weights, per_table[table["name"]])
            if self.sharding != "unsharded":
                rounding = (self.simulated_world + 2) * output_unit * (np.abs(weights.astype(np.float64)) + rounding)
            for feature in table["features"]:
                bound = bounds.pooled_bound(batch.sparse[feature], rounding, weights, table["pooling"], batch.size)
                if self.sharding == "unsharded" and self.output == "fp16":
                    value = to_numpy(evaluated[f"pooled.{feature}"]).astype(np.float64)
                    bound = bound + bounds.output_rounding(np.abs(value) + bound, bounds.FP16_UNIT)
                pooled_bounds[feature] = bound
        sources = [(evaluated[f"pooled.{f}"], torch.from_numpy(b)) for f, b in pooled_bounds.items()]
        allowed = {f"allowed/eval_before/pooled.{f}": b.astype(np.float32) for f, b in pooled_bounds.items()}
        prediction = bounds.first_order_bound(evaluated["prediction"], sources)
        allowed["allowed/eval_before/prediction"] = (prediction + 4 * bounds.FP32_UNIT).astype(np.float32)
        return allowed


def element_rounding(weights: np.ndarray, weight_type: str) -> np.ndarray:
    """Bound on each stored weight's error under the table's scheme."""
    bits = WEIGHT_TYPES[weight_type][1]
    if bits:
        return bounds.rowwise_nbit_rounding(weights, bits)
    if weight_type == "bf16":
        return np.abs(weights.astype(np.float64)) * bounds.BF16_UNIT
    return bounds.fp16_rounding(weights.astype(np.float64))


def _variants() -> list[QuantizedEmbeddings]:
    variants = []
    for weights, output in itertools.product(WEIGHT_TYPES, OUTPUT_TYPES):
        variants.append(QuantizedEmbeddings(weights, output))
        if weights == "bf16":
            continue  # quantizing bf16 tables already dies (SIGFPE in fbgemm's N-bit packer): nothing to shard
        variants += [
            QuantizedEmbeddings(weights, output, sharding, world)
            for sharding, world in itertools.product(SHARDINGS, SIMULATED_WORLDS)
        ]
    return variants


register_settings(_variants())
