"""TorchRec's own recommendation models, as TorchRec ships them: `torchrec.models.dlrm.DLRM`, `DLRM_DCN` (low-rank
cross net interaction), `DLRM_Projection` (projected interaction), and `torchrec.models.deepfm.SimpleDeepFMNN`.

Two kinds: `torchrec-dlrm` draws one of the three DLRM variants from the index (DCN, plain, projection, in turn),
`torchrec-deepfm` builds DeepFM. Their configurations (tables, shared tables, widths, depths) are drawn like the
`dlrm` kind's; TorchRec's models need one unweighted EmbeddingBagCollection whose tables share one embedding dim, and
the DLRMs a dense arch ending at that dim. Parameters keep TorchRec's names (`sparse_arch.embedding_bag_collection.
embedding_bags.t0.weight`, `over_arch.model.0._mlp.0._linear.weight`); weights are drawn by numpy in name order, so a
model depends on TorchRec's module layout (pinned) but not on torch's RNG.

prediction = sigmoid(logit) for the DLRMs, DeepFM's own sigmoid output; loss = binary cross-entropy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from difftest import EmbeddingTable, ModelCode, ModelSpec, register_generator
from generators.dlrm import DlrmGenerator, _mlp_sizes, feature_kjt, input_reductions
from generators.inputs import Batch

DLRM_VARIANTS = ("DLRM_DCN", "DLRM", "DLRM_Projection")


def _rng(kind: str, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([0x7C5, sum(map(ord, kind)), *key]))


class TorchRecModelGenerator(DlrmGenerator):
    """One of TorchRec's models; inputs, loss and the sharding-facing API are the `dlrm` kind's."""

    traits = frozenset({"torch", "torchrec"})

    def __init__(self, kind: str, architectures: tuple[str, ...]) -> None:
        self.kind = kind
        self.architectures = architectures

    def spec(self, seed: int, index: int) -> ModelSpec:
        rng = _rng(self.kind, seed, index)
        uneven = index % 3 == 2  # as the dlrm kind: dense widths no world size from 2 to 4 divides
        dim = int(4 * rng.integers(1, 5))
        tables, feature = [], 0
        for t in range(int(rng.integers(1, 5))):
            features = [f"f{feature + j}" for j in range(2 if rng.random() < 0.3 else 1)]
            feature += len(features)
            tables.append({"name": f"t{t}", "num_embeddings": int(rng.integers(1, 1001)), "embedding_dim": dim,
                           "pooling": str(rng.choice(["SUM", "MEAN"])), "features": features, "weighted": False})
        architecture = self.architectures[index % len(self.architectures)]
        params: dict[str, Any] = {"architecture": architecture, "tables": tables, "dense_in": int(rng.integers(1, 17)),
                                  "max_bag": int(rng.integers(1, 6))}
        if architecture == "DeepFM":
            params.update(hidden=int(4 * rng.integers(1, 9)), deep_fm_dimension=int(rng.integers(1, 9)))
        else:
            params.update(dense_arch=_mlp_sizes(rng, 2, uneven) + [dim], over_arch=_mlp_sizes(rng, 2, uneven) + [1])
        if architecture == "DLRM_DCN":
            params.update(dcn_layers=int(rng.integers(1, 4)), dcn_rank=int(rng.integers(1, 5)))
        if architecture == "DLRM_Projection":
            params.update(branch1=_mlp_sizes(rng, 1, uneven) + [dim * int(rng.integers(1, 4))],
                          branch2=_mlp_sizes(rng, 1, uneven) + [dim * int(rng.integers(1, 4))])
        frozen: tuple[str, ...] = ()
        if index % 2 == 1:
            names = sorted(self.parameter_shapes(params))
            frozen = (names[int(rng.integers(len(names)))],)
        return ModelSpec(kind=self.kind, seed=seed, index=index, params=params, frozen=frozen, input_seed=0)

    @staticmethod
    def parameter_shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """TorchRec's parameter names and shapes, read off the module built on the meta device."""
        module = _build_module(params, "meta")
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        rng = _rng(self.kind, spec.seed, spec.index, 1)
        state = {}
        for name, shape in sorted(self.parameter_shapes(spec.params).items()):
            if ".embedding_bags." in name:
                bound = 0.1
            else:
                bound = 1.0 / np.sqrt(shape[-1]) if len(shape) >= 2 else 0.2
            state[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        return state

    def embedding_tables(self, spec: ModelSpec) -> list[EmbeddingTable]:
        """The `dlrm` kind's tables, in the collection TorchRec's model holds them (its state's names say where)."""
        collection = next(name.partition(".embedding_bags.")[0] for name in self.parameter_shapes(spec.params)
                          if ".embedding_bags." in name)
        return [dataclasses.replace(t, collection=collection) for t in super().embedding_tables(spec)]

    def features(self, spec: ModelSpec) -> list[str]:
        out = [spec.params["architecture"], *sorted({f"pooling:{t['pooling']}" for t in spec.params["tables"]})]
        if any(len(t["features"]) > 1 for t in spec.params["tables"]):
            out.append("SharedTable")
        return out

    # --- minimisation ---------------------------------------------------------------------------------------
    def size(self, spec: ModelSpec) -> dict[str, int]:
        p = spec.params
        return {"tables": len(p["tables"]), "features": sum(len(t["features"]) for t in p["tables"]),
                "rows": sum(t["num_embeddings"] for t in p["tables"]),
                "parameters": sum(int(np.prod(s)) for s in self.parameter_shapes(p).values())}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        """The `dlrm` kind's table reductions (one embedding dim for all: TorchRec's models require it)."""
        p = spec.params
        out: list[tuple[str, dict[str, Any]]] = []
        tables = p["tables"]
        if len(tables) > 1:
            for table in tables:
                out.append((f"drop table {table['name']}", {**p, "tables": [t for t in tables if t is not table]}))
        for table in tables:
            if len(table["features"]) > 1:
                out.append((f"table {table['name']} serves one feature", {**p, "tables": [
                    {**t, "features": t["features"][:1]} if t is table else t for t in tables]}))
        if any(t["num_embeddings"] > 1 for t in tables):
            out.append(("every table 1 row", {**p, "tables": [{**t, "num_embeddings": 1} for t in tables]}))
        return out + input_reductions(p)

    # --- torch side ------------------------------------------------------------------------------------------
    def module(self, params: dict[str, Any], device: str) -> Any:
        return _build_module(params, device)

    def model_inputs(self, module: Any, batch: Batch, device: str) -> tuple[Any, Any]:
        """(dense tensor, KJT of every feature in table order)."""
        import torch

        names = [f for t in _unwrap(module).table_specs for f in t["features"]]
        return torch.from_numpy(batch.dense).to(device), feature_kjt(batch, names, False, device)

    def predict(self, module: Any, inputs: tuple[Any, ...]) -> Any:
        return model_prediction(module, inputs)

    def standalone_model(self, spec: ModelSpec, init_state: dict[str, np.ndarray], model_dir: Any,
                         train: Batch) -> ModelCode:
        name = spec.params["architecture"]
        return self.model_code(
            spec, init_state, train, f"The model is TorchRec's own {'SimpleDeepFMNN' if name == 'DeepFM' else name} "
            "(torchrec.models) on one EmbeddingBagCollection, binary cross-entropy.",
            (_build_module, _unwrap, model_inputs, model_prediction), _chain_units)

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """The prediction and each feature's pooled embedding, taken where TorchRec's sparse arch hands them on and
        handed on as the very tensors recorded (a KeyedTensor of them: same values), so the prediction's graph runs
        through them (the quantization bounds differentiate the prediction by them)."""
        from torchrec.sparse.jagged_tensor import KeyedTensor

        pooled: dict[str, Any] = {}

        def recorded(_module: Any, _args: Any, out: Any) -> Any:
            pooled.update(out.to_dict())
            return KeyedTensor.from_tensor_list(list(pooled), list(pooled.values()))

        inner = _unwrap(module)
        handle = inner.sparse_arch.embedding_bag_collection.register_forward_hook(recorded)
        try:
            prediction = self.forward(module, batch, device)
        finally:
            handle.remove()
        return {"prediction": prediction, **{f"pooled.{k}": v for k, v in pooled.items()}}

    def chain(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None) -> Any:
        """TorchRec's forward cut between its arches: [features (pooled embeddings + raw dense), dense arch,
        interaction, over arch's layers]."""
        from difftest import BatchSource, LayerChain

        module = self.build(spec, init_state, device)
        source = BatchSource()
        units = _chain_units(module, lambda positions: self.model_inputs(module, source.samples(positions), device))
        return LayerChain(units, source, lambda: dict(module.named_parameters()), "prediction")


def model_prediction(module: Any, inputs: tuple[Any, ...]) -> Any:
    """The prediction from the model's inputs: TorchRec's DLRMs answer a logit, DeepFM a probability."""
    import torch

    out = module(*inputs).squeeze(1)
    return out if _unwrap(module).params["architecture"] == "DeepFM" else torch.sigmoid(out)


def model_inputs(module: Any, data: dict[str, Any], split: str, start: int, stop: int, dtype: Any) -> tuple[Any, Any]:
    """(dense tensor, KJT of every feature in table order) of samples start..stop of a script's `split` batch."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f for t in _unwrap(module).table_specs for f in t["features"]]
    values, lengths = [], []
    for key in keys:
        bags = data[f"{split}.sparse.{key}.lengths"]
        lengths.append(bags[start:stop])
        values.append(data[f"{split}.sparse.{key}.values"][bags[:start].sum():bags[:stop].sum()])
    features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                                                   lengths=torch.from_numpy(np.concatenate(lengths)))
    return torch.from_numpy(data[f"{split}.dense"][start:stop]).to(dtype), features


def _chain_units(module: Any, inputs_at: Callable[[Any], tuple[Any, Any]]) -> list[Any]:
    """[features, dense arch, interaction, one unit per over-arch layer]; `inputs_at(positions)`: the model's inputs
    (dense tensor, KJT) of the samples at those positions of the batch being fed."""
    import torch
    from torch import nn
    from torchrec.sparse.jagged_tensor import KeyedTensor

    deep_fm = module.params["architecture"] == "DeepFM"

    class Features(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse_arch = module.sparse_arch

        def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            dense, features = inputs_at(positions)
            pooled = self.sparse_arch(features)
            # DeepFM's sparse arch answers a KeyedTensor, which no stage can send: its values travel instead
            return dense, pooled.values() if deep_fm else pooled

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense_arch = module.dense_arch

        def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.dense_arch(dense), pooled.clone()  # a stage's output must not be its own input

    class Interaction(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inter_arch = module.inter_arch

        def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
            if deep_fm:
                keys = [f for t in module.table_specs for f in t["features"]]
                dims = [t["embedding_dim"] for t in module.table_specs for _ in t["features"]]
                pooled = KeyedTensor(keys=keys, length_per_key=dims, values=pooled)
            return self.inter_arch(dense_features=dense, sparse_features=pooled)

    class Over(nn.Module):
        def __init__(self, layer: nn.Module, last: bool) -> None:
            super().__init__()
            self.layer, self.last = layer, last

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.layer(x)
            if not self.last:
                return y
            y = y.squeeze(1)
            return y if deep_fm else torch.sigmoid(y)

    over = list(module.over_arch.model.children()) if isinstance(module.over_arch.model, nn.Sequential) \
        else [module.over_arch.model]
    return [Features(), Dense(), Interaction(), *(Over(layer, i == len(over) - 1) for i, layer in enumerate(over))]


def _unwrap(module: Any) -> Any:
    """TorchRec's model inside DMP/DDP wrappers (marked by the `table_specs` the builder sets on it)."""
    while "table_specs" not in vars(module):
        module = getattr(module, "_dmp_wrapped_module", None) or module.module
    return module


def _build_module(params: dict[str, Any], device: str) -> Any:
    import torch
    from torchrec.models import deepfm, dlrm
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch_device = torch.device(device)
    collection = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                           feature_names=list(t["features"]), pooling=PoolingType[t["pooling"]])
        for t in params["tables"]], device=torch_device)
    architecture = params["architecture"]
    with torch.device(device):  # DeepFM's and the cross net's layers take no device argument
        if architecture == "DeepFM":
            module = deepfm.SimpleDeepFMNN(params["dense_in"], collection, params["hidden"], params["deep_fm_dimension"])
        else:
            common = (collection, params["dense_in"], params["dense_arch"], params["over_arch"])
            if architecture == "DLRM":
                module = dlrm.DLRM(*common, dense_device=torch_device)
            elif architecture == "DLRM_DCN":
                module = dlrm.DLRM_DCN(*common, dcn_num_layers=params["dcn_layers"],
                                       dcn_low_rank_dim=params["dcn_rank"], dense_device=torch_device)
            else:
                module = dlrm.DLRM_Projection(*common, interaction_branch1_layer_sizes=params["branch1"],
                                              interaction_branch2_layer_sizes=params["branch2"],
                                              dense_device=torch_device)
    module.table_specs = params["tables"]  # what the `dlrm` kind's input builder reads
    module.params = params
    return module


register_generator("torchrec-dlrm", TorchRecModelGenerator("torchrec-dlrm", DLRM_VARIANTS))
register_generator("torchrec-deepfm", TorchRecModelGenerator("torchrec-deepfm", ("DeepFM",)))
