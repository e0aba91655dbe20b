"""TorchRec's gradient clipping: `GradientClippingOptimizer` (clipping by norm, 2 and inf) around the optimizer of a
sharded model's dense part, as TorchRec users clip — the parameters outside the fused tables wrapped in a
`KeyedOptimizerWrapper` and clipped by TorchRec before each step — against `torch.nn.utils.clip_grad_norm_` over the
same parameters in one process (the family's root).

The fused tables are trained inside fbgemm's lookup kernel during the backward and have no gradient to clip, so
neither run clips them: they take plain SGD in both. Data-parallel tables come back from DMP as plain parameters;
they are trained by plain SGD beside the clipped optimizer, as the root trains every table. `MAX_NORM` is the
gradient-clipping family's, small enough that every generated model's dense gradient exceeds it: the clipping really
scales; each case notes the total norm the clipping found.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

from difftest import Outputs, RunContext, Setting, Unsupported, record_training, register_settings, traits_of
from settings._torchrec_plan import SHARDING_TYPES, embedding_collections, plan_functions
from settings._training import build_for_training, canonical_parameters
from settings.gradient_clipping import MAX_NORM
from settings.torchrec_optimizers import Optimizers, _is_table
from settings.torchrec_sharding import TorchRecSharding

NORMS = {"norm2": 2.0, "norminf": float("inf")}
WORLD_SIZES = (2, 4)


@dataclass(frozen=True)
class TorchRecClipping(TorchRecSharding):
    """TorchRec DMP with an explicit sharding plan, its dense part clipped by TorchRec's GradientClippingOptimizer."""

    family: ClassVar[str] = "torchrec-clip"
    # the default tier runs one case of the family (norm 2, column-wise, two ranks): both norms take one code path
    tier_axes: ClassVar[tuple[str, ...]] = ()
    norm: str = "norm2"

    @property
    def name(self) -> str:
        return f"torchrec-clip/{self.norm}/{self.sharding}/ws{self.world_size}"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return TorchRecClippingReference(norm=self.norm).name

    def describe(self) -> str:
        return (f"TorchRec DMP, every table {self.sharding}, {self.world_size} ranks, the dense gradients clipped to "
                f"{self.norm} {MAX_NORM:g} by GradientClippingOptimizer")

    def dense_optimizer(self, ctx: RunContext, named: list[tuple[str, Any]]) -> Any:
        import torch
        from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
        from torchrec.optim.keyed import KeyedOptimizerWrapper

        dense = {n: p for n, p in named if not _is_table(n)}
        tables = [p for n, p in named if _is_table(n)]
        clipped = GradientClippingOptimizer(
            KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=ctx.lr)),
            clipping=GradientClipping.NORM, max_gradient=MAX_NORM, norm_type=NORMS[self.norm]) if dense else None
        return Optimizers(clipped, torch.optim.SGD(tables, lr=ctx.lr) if tables else None)

    def dense_step(self, ctx: RunContext, optimizer: Any) -> None:
        optimizer.step()
        clipped = optimizer.optimizers[0] if optimizer.optimizers else None
        norm = getattr(clipped, "last_total_grad_norm", None)
        if norm is not None:
            ctx.notes["total norm before clipping"] = f"{float(norm):.4g} (max_norm {MAX_NORM:g})"

    def standalone(self, case: Any) -> Any:
        """The whole model, its tables sharded under the case's plan and its other parameters clipped by
        GradientClippingOptimizer, against clip_grad_norm_ in one process (settings/_torchrec_clip_script.py): the
        parameters outside the tables after the steps, which the clipping scales."""
        import dataclasses

        from difftest import refuse_changed_hooks
        from settings import _torchrec_clip_script as script
        from settings._training_script import training_script

        refuse_changed_hooks(self, TorchRecClipping, "dense_optimizer", "dense_step", "table_optimizer", "sharder",
                             "_plan", "initial_state", "optimizer_state", "load_initial_state", "sharded_module",
                             "trainer", "full_state")
        if _is_table(case.first_divergence.partition("/")[2]):
            raise Unsupported(f"it first diverges at a table ({case.first_divergence}), which the clipping leaves "
                              "alone; the script compares the parameters it clips")
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        clipped = (f"every table {self.sharding}, fused with SGD, the other parameters clipped to {self.norm} "
                   f"{MAX_NORM:g} by TorchRec's GradientClippingOptimizer before each step")
        made = training_script(
            case, f"TorchRec DistributedModelParallel over the whole model, {clipped}", self.world_size,
            (*plan_functions(self.sharding, tables, self.plan_seed, self.world_size), _is_table, script.sharded_with_fused_sgd,
             script.distribute, script.sgd_on_share, script.full_parameters),
            {"sharding": self.sharding, "plan_seed": self.plan_seed, "local_world_size": case.local_world_size,
             "lr": case.lr}, libraries=("fbgemm-gpu",))
        return dataclasses.replace(
            made, tensors={k: v for k, v in made.tensors.items() if not _is_table(k.partition("/")[2])},
            preamble=(*made.preamble, "import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}",
                      f"MAX_NORM = {MAX_NORM!r}",
                      f"CLIP_NORM = float({str(NORMS[self.norm])!r})"))  # repr(inf) is no Python name


@dataclass(frozen=True)
class TorchRecClippingReference(Setting):
    """The family's root: the unsharded model in one process, the gradients outside its tables clipped by
    `clip_grad_norm_`, every parameter stepped by SGD."""

    norm: str
    world_size: int = 1
    family: ClassVar[str] = "torchrec-clip"
    deterministic: ClassVar[bool] = True
    sample_order_free: ClassVar[bool] = True  # one full-batch step: any sample order is as good

    @property
    def name(self) -> str:
        return f"torchrec-clip/{self.norm}/single/ws1"

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.name

    def describe(self) -> str:
        return f"one process, the gradients outside the tables clipped to {self.norm} {MAX_NORM:g} by clip_grad_norm_"

    def supports(self, spec: Any) -> str | None:
        if "torchrec" not in traits_of(spec.kind):
            return (f"TorchRec's clipping optimizer trains models with EmbeddingBagCollections; model kind "
                    f"{spec.kind!r} has none")
        return None

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch

        module = build_for_training(model, ctx.device)
        tables = {f"{path}.{n}" for path, c in embedding_collections(module).items() for n, _ in c.named_parameters()}
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        dense = [p for n, p in trainable if n not in tables]
        optimizer = torch.optim.SGD([p for _, p in trainable], lr=ctx.lr)

        def train_step(batch: Any) -> float:
            optimizer.zero_grad()
            loss = model.loss(model.forward(module, batch, ctx.device), batch)
            loss.backward()
            if dense:
                norm = torch.nn.utils.clip_grad_norm_(dense, MAX_NORM, NORMS[self.norm])
                ctx.notes["total norm before clipping"] = f"{float(norm):.4g} (max_norm {MAX_NORM:g})"
            optimizer.step()
            return loss.item()

        return record_training(ctx, inputs, lambda b: model.evaluate(module, b, ctx.device), train_step,
                               lambda: canonical_parameters(model, module))


register_settings(
    [TorchRecClippingReference(norm=n) for n in NORMS]
    + [TorchRecClipping(sharding=s, world_size=ws, norm=n)
       for n, s, ws in itertools.product(NORMS, SHARDING_TYPES, WORLD_SIZES)]
)
