"""TorchRec's checkpoint resharding: train under one sharding plan, save the sharded model and its fused optimizer's
state with `torch.distributed.checkpoint` (DCP), and resume under another plan or world size, as production jobs do
when their number of trainers or their plan changes between runs.

`torchrec-reshard/<optimizer>/<before>-ws<N>/<after>-ws<M>` trains the first `AT_STEP` steps with every table
`before`-sharded over N new processes (the tables trained by the fused optimizer inside the lookup, the dense part by
SGD, as `torchrec-optim` does), saves `dmp.state_dict()` and `dmp.fused_optimizer.state_dict()` (ShardedTensors: each
rank writes its shards), and in M new processes shards the model under `after`, loads both from the checkpoint (DCP
reshards on load; `load_state_dict` of the model and the fused optimizer, as TorchRec's own checkpoint tests do) and
takes the other steps. Judged against the family's root, `torchrec-optim`'s for the family's two steps: the unsharded
model trained by the same optimizer's PyTorch class without an interruption: the pooled outputs before, the loss of every step, every parameter
and the optimizer's state after every step (a row-wise accumulator that a reshard drops or misplaces shows on the step
after the resume, before the weights it scales). `row_wise-ws2/row_wise-ws2` saves and loads under the same plan: what
a resume alone changes, apart from what resharding changes.

Data-parallel tables are not among the plans: DMP hands them back as plain parameters trained by an unfused optimizer
whose state is not the fused optimizer's, so their checkpoint is a DDP one, which the `resume` family tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from difftest import Outputs, RunContext, register_settings
from settings._torchrec_plan import SHARDING_TYPES
from settings.torchrec_optimizers import OPTIMIZERS, FusedOptimizerReference, FusedOptimizerSharding, frozen_tables

if TYPE_CHECKING:
    from difftest import Script, StandaloneCase

AT_STEP = 1  # the steps before the checkpoint
TOTAL_STEPS = 2  # the family's own, whatever the sweep's: the second phase's step reads the state the first saved
# (before, world size, after, world size): a round trip under one plan, and plans whose shards cut the tables
# differently (rows, columns, whole tables, grids) at a smaller and a larger world size
RESHARDS = (
    ("row_wise", 2, "row_wise", 2),
    ("column_wise", 2, "table_wise", 2),
    ("row_wise", 2, "table_wise", 4),
    ("table_wise", 4, "row_wise", 2),
    ("column_wise", 2, "table_row_wise", 4),
    ("table_column_wise", 4, "column_wise", 2),
    ("grid_shard", 4, "table_wise", 2),
)


@dataclass(frozen=True)
class ReshardedResume(FusedOptimizerSharding):
    """The first phase under `sharding` over `before_world_size` new processes, a DCP checkpoint, the second under
    `after_sharding` over `after_world_size` new processes. The sweep runs the case on one rank, which starts both
    groups; `phase` and `checkpoint` are set for the processes of each phase."""

    family: ClassVar[str] = "torchrec-reshard"
    tier_axes: ClassVar[tuple[str, ...]] = ()  # the default tier: the cheapest reshard, columns to tables on 2 ranks
    size_parameters: ClassVar[frozenset[str]] = frozenset()
    world_size: int = 1
    before_world_size: int = 2
    after_sharding: str = "table_wise"
    after_world_size: int = 4
    phase: int = 0  # 0: the sweep's case; 1 and 2: a process of that phase
    checkpoint: str = ""

    @property
    def name(self) -> str:
        return (f"torchrec-reshard/{self.optimizer}/{self.sharding}-ws{self.before_world_size}/"
                f"{self.after_sharding}-ws{self.after_world_size}")

    @property
    def reference(self) -> str:  # type: ignore[override]
        return UninterruptedReference(optimizer=self.optimizer).name

    @property
    def scale(self) -> int:
        return max(self.before_world_size, self.after_world_size)

    def describe(self) -> str:
        return (f"TorchRec DMP trained by fused {self.optimizer}: {AT_STEP} step(s) every table {self.sharding} over "
                f"{self.before_world_size} ranks, a DCP checkpoint, the rest every table {self.after_sharding} over "
                f"{self.after_world_size} ranks")

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        from settings._resumable import train_in_new_processes

        workdir = Path(tempfile.mkdtemp(prefix="difftest-torchrec-reshard-"))
        try:
            first = dataclasses.replace(self, phase=1, checkpoint=str(workdir / "checkpoint"))
            before = train_in_new_processes(first, dataclasses.replace(ctx, steps=AT_STEP), model,
                                            self.before_world_size, f"the {self.sharding} phase")
            second = dataclasses.replace(first, phase=2, sharding=self.after_sharding)
            after = train_in_new_processes(second, dataclasses.replace(ctx, steps=TOTAL_STEPS - AT_STEP), model,
                                           self.after_world_size, f"the {self.after_sharding} phase")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        assert before is not None and after is not None
        ctx.notes["resharded"] = (f"after step {AT_STEP}: {self.sharding} over {self.before_world_size} ranks to "
                                  f"{self.after_sharding} over {self.after_world_size}")
        return resumed_outputs(before, after, AT_STEP)

    def train(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """One process's part of its phase: the fused-optimizer family's training under this phase's plan
        (`load_initial_state` and `after_training` load and save the checkpoint)."""
        return FusedOptimizerSharding.run(self, ctx, model, inputs)

    def load_initial_state(self, ctx: RunContext, dmp: Any, state: dict) -> None:
        super().load_initial_state(ctx, dmp, state)
        if self.phase != 2:
            return
        import torch.distributed.checkpoint as dcp

        model_state, optimizer_state = dmp.state_dict(), dmp.fused_optimizer.state_dict()
        loaded = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(loaded, checkpoint_id=self.checkpoint, process_group=ctx.group)
        dmp.load_state_dict(loaded["model"])
        dmp.fused_optimizer.load_state_dict(loaded["optimizer"])

    def after_training(self, ctx: RunContext, dmp: Any, optimizer: Any) -> None:
        if self.phase != 1:
            return
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": dmp.state_dict(), "optimizer": dmp.fused_optimizer.state_dict()},
                 checkpoint_id=self.checkpoint, process_group=ctx.group)

    def standalone(self, case: StandaloneCase) -> Script:
        """The tables alone (settings/_torchrec_reshard_script.py): the first phase's steps under its plan in new
        processes, the checkpoint, the other steps under the second plan in new processes loading it, against the
        optimizer's PyTorch class in one process; every table after the steps, judged by allclose (the script's
        loss is the tables' own, not the model's the envelope was measured on)."""
        from difftest import Script, Unsupported, refuse_changed_hooks
        from settings import _torchrec_reshard_script as script
        from settings._torchrec_optim_script import (
            fbgemm_options,
            fuse_as_trained,
            fuse_table_optimizers,
            second_tables,
            table_name,
            table_optimizer,
            trained_tables,
            unfused_table_optimizers,
            whole_tables,
        )
        from settings._torchrec_plan import _plan_helpers, plan_functions
        from settings._torchrec_script import (
            bag_runs_kjt,
            embedding_script_data,
            sharded_tables,
            standalone_features,
            standalone_tables,
        )
        from settings.torchrec_vbe import pooled_loss

        refuse_changed_hooks(self, ReshardedResume, "table_optimizer", "dense_optimizer", "optimizer_state",
                             "load_initial_state", "after_training", "sharded_module", "trainer", "full_state")
        tables = case.generator.embedding_tables(case.spec)
        if tables is None:
            raise Unsupported(f"model kind {case.spec.kind!r} does not declare its embedding tables")
        data, table_list = top_level_collections(*embedding_script_data(case, tables))
        spec = OPTIMIZERS[self.optimizer]
        phases = [{"sharding": self.sharding, "world_size": self.before_world_size, "steps": AT_STEP, "load": False,
                   "save": True},
                  {"sharding": self.after_sharding, "world_size": self.after_world_size,
                   "steps": TOTAL_STEPS - AT_STEP, "load": True, "save": False}]
        plans = plan_functions(self.sharding, tables, 0, self.before_world_size) + \
            _plan_helpers(self.after_sharding, tables, 0, self.after_world_size)
        return Script(
            summary=f"TorchRec EmbeddingBagCollections trained by fused {spec.cls} inside the lookup "
                    f"(apply_optimizer_in_backward) under DistributedModelParallel on CPU ranks (gloo), each rank on "
                    f"its share of one batch: {AT_STEP} step(s) with every table {self.sharding} over "
                    f"{self.before_world_size} ranks, a torch.distributed.checkpoint of the tables and the fused "
                    f"optimizer's state, {TOTAL_STEPS - AT_STEP} more in {self.after_world_size} new processes with "
                    f"every table {self.after_sharding}, loading it"
                    + case.against(f"torch's {spec.cls} on the same collections in one process, {TOTAL_STEPS} "
                                   "steps without an interruption: every table after them") + ".",
            libraries=("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy"),
            preamble=("import random", "", f"SHARDING_TYPES = {SHARDING_TYPES!r}"),
            case={"sharding": self.sharding, "device": "cpu", "batch": case.inputs["eval"].size, "lr": case.lr,
                  "optimizer": (spec.module, spec.cls), "options": dict(spec.options), "tables": table_list,
                  "steps": TOTAL_STEPS, "phases": phases, "frozen": frozen_tables(tables, case)},
            functions=(*dict.fromkeys(plans), sharded_tables, standalone_tables, standalone_features, bag_runs_kjt,
                       pooled_loss, table_optimizer, fbgemm_options, second_tables, fuse_table_optimizers,
                       fuse_as_trained, unfused_table_optimizers, trained_tables, table_name, whole_tables,
                       script.single_process, script.on_rank,
                       script.run_distributed),
            # named apart from the run's tensors: the envelope measured the model's loss, not the script's
            tensors={name[len("state."):]: f"script/{name[len('state.'):]}" for name in data if name.startswith("state.")},
            data=data,
            world_size=max(self.before_world_size, self.after_world_size))


def top_level_collections(data: dict[str, Any], tables: list[dict]) -> tuple[dict[str, Any], list[dict]]:
    """A script's data and tables (`embedding_script_data`) with every collection at the top of the script's module:
    a nested one (`sparse_arch.embedding_bag_collection`) under its path with `_` for the dots, its weights renamed
    alike."""
    moved = {t["collection"]: t["collection"].replace(".", "_") for t in tables}

    def renamed(key: str) -> str:
        for path, top in moved.items():
            if key.startswith(f"state.{path}."):
                return f"state.{top}." + key[len(f"state.{path}."):]
        return key

    return {renamed(k): v for k, v in data.items()}, [{**t, "collection": moved[t["collection"]]} for t in tables]


@dataclass(frozen=True)
class UninterruptedReference(FusedOptimizerReference):
    """The family's root: `torchrec-optim`'s, the unsharded model trained by the optimizer's PyTorch class in one
    process, for the family's `TOTAL_STEPS` steps without an interruption."""

    family: ClassVar[str] = "torchrec-reshard"

    @property
    def name(self) -> str:
        return f"torchrec-reshard/{self.optimizer}/single/ws1"

    def describe(self) -> str:
        return super().describe() + f", {TOTAL_STEPS} steps without an interruption"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        return super().run(dataclasses.replace(ctx, steps=TOTAL_STEPS), model, inputs)


def resumed_outputs(before: Outputs, after: Outputs, at_step: int) -> Outputs:
    """One uninterrupted run's outputs from a run of `at_step` steps and one of the rest: the first's evaluation
    before training and its steps, the second's steps numbered on from `at_step`, and its evaluation after the last
    (the evaluations at the checkpoint, which the uninterrupted run does not record, are left out)."""
    import re

    def renumbered(name: str) -> str:
        return re.sub(r"(?<=step)(\d+)(?=/)", lambda m: str(int(m.group(1)) + at_step), name, count=1)

    merged = {k: v for k, v in before.items() if not k.startswith(f"eval_after_step{at_step}/")}
    merged |= {renumbered(k): v for k, v in after.items() if not k.startswith("eval_before/")}
    return merged


register_settings([UninterruptedReference(optimizer=optimizer) for optimizer in OPTIMIZERS]
                  + [ReshardedResume(sharding=before, before_world_size=n, after_sharding=after, after_world_size=m,
                                   optimizer=optimizer)
                     for optimizer, (before, n, after, m) in itertools.product(OPTIMIZERS, RESHARDS)])
