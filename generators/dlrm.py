"""DLRM-like models: TorchRec EmbeddingBagCollections (unweighted + weighted) and a dense MLP feeding an over-arch.

prediction = sigmoid(mean(over(cat[dense_mlp(dense), pooled embeddings by feature name]))), loss = BCE.
Everything is drawn from numpy generators seeded by (seed, index), so specs, weights and inputs do not
depend on torch's RNG or version. Dense widths are multiples of 4, but in every third model (index 2, 5, 8, …) none
divides by 2, 3 or 4, so the dense layers shard unevenly under FSDP2 and tensor parallel; embedding dimensions stay
multiples of 4 (fbgemm's kernels want them so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from difftest import EmbeddingTable, Generator, ModelCode, ModelSpec, order_by_words, register_generator
from generators.inputs import UNEVEN_SIZES, Batch, jagged_feature

KIND = "dlrm"


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([0xD1F, *key]))


def _draw_tables(rng: np.random.Generator, weighted: bool, first_feature: int) -> list[dict[str, Any]]:
    tables = []
    feature_id = first_feature
    prefix = "w" if weighted else "t"
    for t in range(int(rng.integers(1, 6))):
        # some tables serve two features (shared table), as real models do
        n_features = 2 if rng.random() < 0.3 else 1
        features = [f"{prefix}f{feature_id + j}" for j in range(n_features)]
        feature_id += n_features
        tables.append(
            {
                "name": f"{prefix}{t}",
                "num_embeddings": int(rng.integers(1, 1001)),
                "embedding_dim": int(4 * rng.integers(1, 9)),
                # per-sample weights are only defined for SUM pooling in torch's embedding_bag
                "pooling": "SUM" if weighted else str(rng.choice(["SUM", "MEAN"])),
                "features": features,
                "weighted": weighted,
            }
        )
    return tables


def _mlp_sizes(rng: np.random.Generator, max_layers: int, uneven: bool) -> list[int]:
    """Widths of 4 to 32 in steps of 4; in the uneven variant widths no world size from 2 to 4 divides."""
    return [int(rng.choice(UNEVEN_SIZES[1:11]) if uneven else 4 * rng.integers(1, 9))
            for _ in range(int(rng.integers(1, max_layers + 1)))]


# where a DLRM tensor sits in its computation, by the words its name holds: tables, dense arch, interaction, over arch,
# prediction, loss (TorchRec's own DLRM and DeepFM name their parts the same way)
STAGE_WORDS = (("pooled", 0), ("embedding", 0), ("ebc", 0), ("sparse", 0), ("dense", 1), ("bottom", 1),
               ("interaction", 2), ("over", 3), ("top", 3), ("prediction", 4), ("logits", 4), ("loss", 5))


class DlrmGenerator(Generator):
    kind = KIND
    traits = frozenset({"torch", "torchrec"})

    def spec(self, seed: int, index: int) -> ModelSpec:
        rng = _rng(seed, index)
        uneven = index % 3 == 2  # every third model: dense widths that do not shard evenly (tables' dims stay 4k)
        unweighted = _draw_tables(rng, weighted=False, first_feature=0)
        weighted = _draw_tables(rng, weighted=True, first_feature=0)
        params = {
            "dense_in": int(rng.integers(1, 17)),
            "dense_arch": _mlp_sizes(rng, 3, uneven),
            "over_arch": _mlp_sizes(rng, 2, uneven) + [int(rng.integers(1, 5))],
            "tables": unweighted + weighted,
            "max_bag": int(rng.integers(1, 6)),
        }
        frozen: tuple[str, ...] = ()
        if index % 2 == 1:  # every other model is the frozen-parameter variant
            names = sorted(self.parameter_shapes(params))
            frozen = (names[int(rng.integers(len(names)))],)
        return ModelSpec(kind=KIND, seed=seed, index=index, params=params, frozen=frozen, input_seed=0)

    @staticmethod
    def parameter_shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Canonical parameter names (those of the unsharded torch module) and shapes."""
        shapes: dict[str, tuple[int, ...]] = {}
        for table in params["tables"]:
            collection = "weighted_sparse" if table["weighted"] else "sparse"
            shapes[f"{collection}.embedding_bags.{table['name']}.weight"] = (table["num_embeddings"], table["embedding_dim"])
        width = params["dense_in"]
        for i, out in enumerate(params["dense_arch"]):
            shapes[f"dense.{2 * i}.weight"] = (out, width)
            shapes[f"dense.{2 * i}.bias"] = (out,)
            width = out
        width = params["dense_arch"][-1] + sum(len(t["features"]) * t["embedding_dim"] for t in params["tables"])
        for i, out in enumerate(params["over_arch"]):
            shapes[f"over.{2 * i}.weight"] = (out, width)
            shapes[f"over.{2 * i}.bias"] = (out,)
            width = out
        return shapes

    def frozen_names(self, params: dict[str, Any]) -> set[str]:
        return set(self.parameter_shapes(params))

    def embedding_tables(self, spec: ModelSpec) -> list[EmbeddingTable]:
        return [EmbeddingTable(collection="weighted_sparse" if t["weighted"] else "sparse", name=t["name"],
                               num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                               pooling=t["pooling"], features=tuple(t["features"]), weighted=t["weighted"],
                               outputs=tuple(f"pooled.{f}" for f in t["features"]))
                for weighted in (False, True) for t in spec.params["tables"] if t["weighted"] == weighted]

    def tensor_order(self, tensor: str) -> tuple[int, int]:
        return order_by_words(tensor, STAGE_WORDS)

    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        rng = _rng(spec.seed, spec.index, 1)
        state = {}
        for name, shape in self.parameter_shapes(spec.params).items():
            if ".embedding_bags." in name:
                bound = 0.1
            else:
                fan_in = shape[1] if len(shape) == 2 else self.parameter_shapes(spec.params)[name.replace("bias", "weight")][1]
                bound = 1.0 / np.sqrt(fan_in)
            state[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        return state

    def inputs(self, spec: ModelSpec, batch_size: int) -> dict[str, Batch]:
        rng = _rng(spec.seed, spec.index, 2, spec.input_seed)
        batches = {}
        for split in ("train", "eval"):
            sparse = {}
            for table in spec.params["tables"]:
                for feature in table["features"]:
                    sparse[feature] = jagged_feature(
                        rng, batch_size, table["num_embeddings"], spec.params["max_bag"], table["weighted"]
                    )
            dense = rng.normal(size=(batch_size, spec.params["dense_in"])).astype(np.float32)
            labels = rng.integers(0, 2, size=batch_size).astype(np.float32)
            batches[split] = Batch(labels=labels, dense=dense, sparse=sparse)
        return batches

    # --- minimisation: smaller models of the same structure, most removed first -----------------
    def size(self, spec: ModelSpec) -> dict[str, int]:
        p = spec.params
        return {"tables": len(p["tables"]), "features": sum(len(t["features"]) for t in p["tables"]),
                "layers": len(p["dense_arch"]) + len(p["over_arch"]),
                "rows": sum(t["num_embeddings"] for t in p["tables"]),
                "parameters": sum(int(np.prod(s)) for s in self.parameter_shapes(p).values())}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        """(what it removes, params) for each one-step-smaller model; each collection keeps one table, each arch
        one layer. A frozen parameter the smaller model no longer has is dropped from `frozen` by the minimiser."""
        p = spec.params
        tables = p["tables"]
        out: list[tuple[str, dict[str, Any]]] = []

        def with_tables(kept: list[dict[str, Any]]) -> dict[str, Any]:
            return {**p, "tables": kept}

        for weighted in (False, True):
            mine = [t for t in tables if t["weighted"] == weighted]
            if len(mine) > 1:
                for table in mine:
                    kept = [t for t in tables if t["weighted"] != weighted or t is table]
                    out.append((f"keep only table {table['name']} of its collection", with_tables(kept)))
                for table in mine:
                    out.append((f"drop table {table['name']}", with_tables([t for t in tables if t is not table])))
        for table in tables:
            if len(table["features"]) > 1:
                out.append((f"table {table['name']} serves one feature",
                            with_tables([{**t, "features": t["features"][:1]} if t is table else t for t in tables])))
        for label, key, floor in (("rows", "num_embeddings", 1), ("embedding dims", "embedding_dim", 4)):
            if any(t[key] > floor for t in tables):
                out.append((f"every table {label} to {floor}", with_tables([{**t, key: floor} for t in tables])))
                if any(t[key] > 2 * floor for t in tables):
                    halved = [{**t, key: max(floor, (t[key] // 2) // floor * floor)} for t in tables]
                    out.append((f"every table's {label} halved", with_tables(halved)))
        if len(p["dense_arch"]) > 1:
            out.append(("one dense layer", {**p, "dense_arch": p["dense_arch"][-1:]}))
        if len(p["over_arch"]) > 1:
            out.append(("one over-arch layer", {**p, "over_arch": p["over_arch"][-1:]}))
        if any(w > 1 for w in p["dense_arch"] + p["over_arch"]):
            out.append(("every layer 1 wide", {**p, "dense_arch": [1] * len(p["dense_arch"]),
                                                "over_arch": [1] * len(p["over_arch"])}))
        return out + input_reductions(p)

    # --- torch side (workers only) -------------------------------------------------------------
    def module(self, params: dict[str, Any], device: str) -> Any:
        """The unsharded module of `params`, freshly initialised."""
        return _build_module(params, device)

    def build(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None) -> Any:
        return with_state(self.module(spec.params, device), init_state, spec.frozen)

    def loss(self, prediction: Any, batch: Batch) -> Any:
        import torch

        return prediction_loss(prediction, torch.from_numpy(batch.labels).to(prediction.device))

    def parameters(self, module: Any) -> dict[str, Any]:
        return model_parameters(module)

    def standalone_model(self, spec: ModelSpec, init_state: dict[str, np.ndarray], model_dir: Any,
                         train: Batch) -> ModelCode:
        return self.model_code(
            spec, init_state, train, "The model is a DLRM-like recommendation model in plain PyTorch and TorchRec: "
            "unweighted and weighted EmbeddingBagCollections and a dense MLP feeding an over-arch MLP, binary "
            "cross-entropy.", (_build_module, _unwrap, model_inputs, model_prediction), _chain_units)

    @staticmethod
    def model_code(spec: ModelSpec, init_state: dict[str, np.ndarray], train: Batch, summary: str,
                   kind_functions: tuple[Any, ...], chain_units: Any) -> ModelCode:
        """A TorchRec model's `ModelCode`: the weights and the training batch as data; the kind's own construction and
        inputs (`kind_functions`: `_build_module`, `_unwrap`, `model_inputs`, `model_prediction`) and layer chain
        (`chain_units`), and the functions below that build, train and read every such model by those names."""
        return ModelCode(
            summary=summary, libraries=("torchrec", "fbgemm-gpu-cpu"), preamble=(),
            functions=(*kind_functions, with_state, build_model, prediction_loss, model_loss, model_parameters),
            chain=(chain_units, model_chain),
            case={"model": spec.params, "frozen": list(spec.frozen)},
            data={**{f"state.{k}": v for k, v in init_state.items()}, **train.to_arrays("train")},
            parameters=tuple(init_state))

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """Predictions plus each feature's pooled embedding, so a finding points at the layer it starts in."""
        inner = _unwrap(module)
        inner.captured = {}
        try:
            prediction = self.forward(module, batch, device)
            return {"prediction": prediction, **{f"pooled.{k}": v for k, v in inner.captured.items()}}
        finally:
            inner.captured = None

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        """Predictions of `module` (unsharded or a TorchRec DMP around it) for `batch`."""
        return self.predict(module, self.model_inputs(module, batch, device))

    def predict(self, module: Any, inputs: tuple[Any, ...]) -> Any:
        """Predictions from the model's arguments (`model_inputs`): what a TorchRec train pipeline's batch model calls
        on the fields of its batch."""
        return model_prediction(module, inputs)

    def model_inputs(self, module: Any, batch: Batch, device: str) -> tuple[Any, Any, Any]:
        """(dense tensor, unweighted KJT, weighted KJT) of `batch`, keyed as `module`'s tables are."""
        import torch

        def kjt(weighted: bool) -> Any:
            return feature_kjt(batch, [f for t in self._tables(module, weighted) for f in t["features"]], weighted, device)

        return torch.from_numpy(batch.dense).to(device), kjt(False), kjt(True)

    def chain(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None) -> Any:
        """[features (embeddings + raw dense), one unit per dense-arch layer, one per over-arch layer]."""
        from difftest import BatchSource, LayerChain

        module = self.build(spec, init_state, device)
        source = BatchSource()
        units = _chain_units(module, lambda positions: self.model_inputs(module, source.samples(positions), device))
        return LayerChain(units, source, lambda: dict(module.named_parameters()), "prediction")

    @staticmethod
    def _tables(module: Any, weighted: bool) -> list[dict[str, Any]]:
        return [t for t in _unwrap(module).table_specs if t["weighted"] == weighted]


def input_reductions(params: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One dense input feature, bags of at most one id: the input side of a recommendation model, shrunk."""
    return [(f"{key} 1", {**params, key: 1}) for key in ("dense_in", "max_bag") if params[key] > 1]


def feature_kjt(batch: Batch, names: list[str], weighted: bool, device: str) -> Any:
    """The KeyedJaggedTensor of `batch`'s sparse features `names`, in that order."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    feats = [batch.sparse[n] for n in names]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=names,
        values=torch.from_numpy(np.concatenate([f.values for f in feats])).to(device),
        lengths=torch.from_numpy(np.concatenate([f.lengths for f in feats])).to(device),
        weights=torch.from_numpy(np.concatenate([f.weights for f in feats])).to(device) if weighted else None,
    )


def with_state(module: Any, state: dict[str, np.ndarray], frozen: Any) -> Any:
    """`module` with the weights `state` (parameter name → array) and the parameters `frozen` frozen."""
    import torch

    module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return module


# --- the model in a standalone script (difftest.scripts.emit): its data holds the weights and the training batch -------
def build_model(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> Any:
    import torch

    state = {name[len("state."):]: value for name, value in data.items() if name.startswith("state.")}
    module = with_state(_build_module(case["model"], "cpu"), state, case["frozen"])
    # its floating tensors in `dtype`, as Module.double() and .float() cast them: `.to(dtype)` would also cast a
    # complex buffer (a rotary cache) to its real part
    return {torch.float64: module.double, torch.float32: module.float}[dtype]()


def model_inputs(module: Any, data: dict[str, Any], split: str, start: int, stop: int, dtype: Any) -> tuple[Any, ...]:
    """(dense tensor, unweighted KJT, weighted KJT) of samples start..stop of the script's `split` batch."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def kjt(weighted: bool) -> Any:
        keys = [f for t in _unwrap(module).table_specs if t["weighted"] == weighted for f in t["features"]]
        values, lengths, weights = [], [], []
        for key in keys:
            bags = data[f"{split}.sparse.{key}.lengths"]
            lo, hi = bags[:start].sum(), bags[:stop].sum()
            lengths.append(bags[start:stop])
            values.append(data[f"{split}.sparse.{key}.values"][lo:hi])
            weights.append(data[f"{split}.sparse.{key}.weights"][lo:hi] if weighted else None)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(np.concatenate(values)), lengths=torch.from_numpy(np.concatenate(lengths)),
            weights=torch.from_numpy(np.concatenate(weights)).to(dtype) if weighted else None)

    return torch.from_numpy(data[f"{split}.dense"][start:stop]).to(dtype), kjt(False), kjt(True)


def model_loss(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> Any:
    """The loss on training samples start..stop of the script's data, as `forward` and `loss` compute it."""
    import torch

    labels = torch.from_numpy(data["train.labels"][start:stop]).to(dtype)
    return prediction_loss(model_prediction(module, model_inputs(module, data, "train", start, stop, dtype)), labels)


def model_prediction(module: Any, inputs: tuple[Any, ...]) -> Any:
    return module(*inputs)


def prediction_loss(prediction: Any, labels: Any) -> Any:
    import torch

    return torch.nn.functional.binary_cross_entropy(prediction, labels)


def model_chain(module: Any, data: dict[str, Any], fed: dict[str, str], dtype: Any) -> list[Any]:
    """The model as the chain of units a pipeline splits into stages (`_chain_units`), reading the samples of the
    script's batch `fed["split"]` at the positions its first unit is given."""
    return _chain_units(module, lambda positions: model_inputs(
        module, data, fed["split"], int(positions[0]), int(positions[0]) + len(positions), dtype))


def model_parameters(module: Any) -> dict[str, Any]:
    return dict(_unwrap(module).named_parameters())


def _unwrap(module: Any) -> Any:
    """The DLRM inside DMP/DDP wrappers."""
    while "table_specs" not in vars(module):  # not hasattr: legacy FSDP forwards attribute lookups inward
        module = getattr(module, "_dmp_wrapped_module", None) or module.module
    return module


def _chain_units(module: Any, inputs_at: Callable[[Any], tuple[Any, Any, Any]]) -> list[Any]:
    """[features, one unit per dense-arch layer, one per over-arch layer]; `inputs_at(positions)`: the model's inputs
    (dense tensor, unweighted KJT, weighted KJT) of the samples at those positions of the batch being fed."""
    import torch
    from torch import nn

    class Features(nn.Module):
        """Positions -> (dense input, pooled embeddings concatenated by feature name)."""

        def __init__(self) -> None:
            super().__init__()
            self.sparse, self.weighted_sparse = module.sparse, module.weighted_sparse

        def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            dense, sparse, weighted = inputs_at(positions)
            pooled = {**self.sparse(sparse).to_dict(), **self.weighted_sparse(weighted).to_dict()}
            return dense, torch.cat([pooled[f] for f in module.feature_order], dim=1)

    class DenseLayer(nn.Module):
        def __init__(self, layers: list[nn.Module], last: bool) -> None:
            super().__init__()
            self.layers, self.last = nn.Sequential(*layers), last

        def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> Any:
            hidden = self.layers(dense)
            # a tensor passed through unchanged is cloned: a stage's output must not be its own input
            return torch.cat([hidden, embedded], dim=1) if self.last else (hidden, embedded.clone())

    class OverLayer(nn.Module):
        def __init__(self, layers: list[nn.Module], last: bool) -> None:
            super().__init__()
            self.layers, self.last = nn.Sequential(*layers), last

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.layers(x)
            return torch.sigmoid(y.mean(dim=1)) if self.last else y

    def layers_of(sequential: nn.Sequential) -> list[list[nn.Module]]:
        grouped: list[list[nn.Module]] = []
        for layer in sequential:
            if isinstance(layer, nn.Linear):
                grouped.append([layer])
            else:
                grouped[-1].append(layer)
        return grouped

    dense, over = layers_of(module.dense), layers_of(module.over)
    return ([Features()] + [DenseLayer(g, i == len(dense) - 1) for i, g in enumerate(dense)]
            + [OverLayer(g, i == len(over) - 1) for i, g in enumerate(over)])


def _build_module(params: dict[str, Any], device: str) -> Any:
    import torch
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def mlp(width: int, sizes: list[int], last_relu: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, out in enumerate(sizes):
            layers += [nn.Linear(width, out, device=device)]
            if last_relu or i < len(sizes) - 1:
                layers += [nn.ReLU()]
            width = out
        return nn.Sequential(*layers)

    def collection(weighted: bool) -> EmbeddingBagCollection:
        configs = [EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                                      feature_names=list(t["features"]), pooling=PoolingType[t["pooling"]])
                   for t in params["tables"] if t["weighted"] == weighted]
        return EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device(device))

    class DLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table_specs = params["tables"]
            self.sparse = collection(False)
            self.weighted_sparse = collection(True)
            self.dense = mlp(params["dense_in"], params["dense_arch"], last_relu=True)
            embedded = sum(len(t["features"]) * t["embedding_dim"] for t in params["tables"])
            self.over = mlp(params["dense_arch"][-1] + embedded, params["over_arch"], last_relu=False)
            # Pooled embeddings are concatenated by feature *name*: a sharded collection returns its keys
            # in plan order, so position-based concatenation would differ from the unsharded model.
            self.feature_order = [f for t in params["tables"] for f in t["features"]]
            self.captured: dict[str, torch.Tensor] | None = None

        def forward(self, dense: torch.Tensor, sparse: Any, weighted: Any) -> torch.Tensor:
            pooled = {**self.sparse(sparse).to_dict(), **self.weighted_sparse(weighted).to_dict()}
            if self.captured is not None:
                self.captured.update(pooled)
            x = torch.cat([self.dense(dense)] + [pooled[f] for f in self.feature_order], dim=1)
            return torch.sigmoid(self.over(x).mean(dim=1))

    return DLRM()


register_generator(KIND, DlrmGenerator())
