"""The contract between the engine and a setting.

A setting is a small frozen dataclass: its fields are its parameters, `name` reads as a path of them
(`torchrec/ebc/row_wise/ws4`), `supports(spec)` says why a model cannot run, and `run(ctx, model, inputs)`
executes on every rank and returns the full, unsharded outputs on rank 0.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import numpy as np

from difftest.contracts.status import Status

if TYPE_CHECKING:  # torch is imported by workers only
    import torch.distributed as dist
    from _typeshed import DataclassInstance

    from difftest.contracts.script import Script, StandaloneCase
    from difftest.contracts.spec import ModelSpec
    from difftest.contracts.tolerance import Tolerance

# Tensor names are "<phase>/<tensor>", e.g. "eval_before/prediction", "param_after_step1/over.0.weight".
Outputs = dict[str, np.ndarray]
# How a name writes a size parameter: a path segment of its own (`ws2`, `sim-ws3`, `stages4`, `mb4`, `r2`, `k3`,
# `pp2`), so that the name without them (`family_key`) is the same at every size.
SIZE_SEGMENT = re.compile(r"(sim-)?ws\d+|stages\d+|mb\d+|r\d+|k\d+|pp\d+")


def without_sizes(name: str) -> str:
    """`pipeline/gpipe/ws2/stages2/mb4/balanced` → `pipeline/gpipe/balanced`."""
    return "/".join(part for part in name.split("/") if not SIZE_SEGMENT.fullmatch(part))
SettingT = TypeVar("SettingT", bound="Setting")


@dataclass(frozen=True)
class RunContext:
    """What a rank knows when it runs a case."""

    rank: int
    world_size: int
    local_world_size: int  # ranks per (simulated) host
    device: str
    backend: str
    group: dist.ProcessGroup | None
    steps: int
    lr: float
    seed: int
    # what a setting wants kept with its case (e.g. the sharding plan it ran); rank 0's are stored
    notes: dict[str, str] = field(default_factory=dict)


class SettingRole(enum.Enum):
    """What a setting is for, as the engine sees it."""

    JUDGED = "judged"  # judged against its reference
    ROOT = "root"  # its own reference: what other settings are judged against
    JUDGE_ONLY = "judge-only"  # exists to judge others (a simulator of their schedule), never a family's representative
    CALIBRATION = "calibration"  # a root run again to measure the noise its envelope is made of


class Setting(abc.ABC):
    """Base class of every setting. Subclasses are frozen dataclasses whose fields are the parameters."""

    family: ClassVar[str]
    world_size: int
    deterministic: ClassVar[bool] = False
    # the setting whose outputs this one is judged against (itself for a reference)
    reference: ClassVar[str] = "reference"
    # the verdict when its outputs differ from the reference's beyond its tolerance
    mismatch_status: ClassVar[str] = Status.INCONSISTENT
    # the parameters whose every value the default tier runs at least once (`difftest.contracts.registry.tier`), at the
    # smallest world size that has it; none: one setting of the class represents it
    tier_axes: ClassVar[tuple[str, ...]] = ()
    # False: the class is in the full tier only, for what a case costs (the docs of its family say how much)
    in_default_tier: ClassVar[bool] = True
    # the arithmetic its result is meant to have ("fp32", "bf16"): the calibrated oracle (`difftest.judging.envelope`)
    # judges it against its root's envelope for that precision
    precision: ClassVar[str] = "fp32"
    framework: ClassVar[str] = "torch"  # or "tensorflow"
    # a root whose result depends on its batches only through sums over all their samples (one full-batch step):
    # any sample order is as legitimate as the stored one, so its calibration may reorder them
    sample_order_free: ClassVar[bool] = False
    # the parameters that scale a case (ranks, micro-batches, steps, a random plan's seed) without changing what it
    # computes: one bug at several sizes is one finding, and the minimiser may lower them
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size"})

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    @property
    def params(self) -> Mapping[str, Any]:
        return dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}

    @property
    def family_key(self) -> str:
        """The name without its sizes (SIZE_SEGMENT): what triage groups disagreements by."""
        return without_sizes(self.name)

    @property
    def family_label(self) -> str:
        """The family as the progress display counts it; a derived setting's names its base's (`rerun/ddp`)."""
        return self.family

    @property
    def sizes(self) -> dict[str, Any]:
        """The values of its size parameters."""
        return {k: v for k, v in self.params.items() if k in self.size_parameters}

    def describe(self) -> str:
        return (self.__doc__ or self.family).strip().splitlines()[0]

    def supports(self, spec: ModelSpec) -> str | None:
        """None if the model can run under this setting, else the reason it cannot."""
        return None

    @property
    def scale(self) -> int:
        """How many ranks or replicas the setting distributes over (its world size, unless it simulates them in one
        process): the default tier prefers the smallest scale of 2 or more, the smallest that is distributed."""
        return self.world_size

    @property
    def judge_only(self) -> bool:
        """True for a setting that exists only to judge others (a simulator of their schedule): tiers run it as
        their reference, never as a representative of its family."""
        return False

    # families besides its own this setting is the root of (the pipeline schedules' gradient-accumulation root)
    judged_families: ClassVar[tuple[str, ...]] = ()

    def judges_family(self, family: str) -> bool:
        """Whether this setting, as a root, exists to judge settings of `family` (the default tier then takes it only
        for values nothing else covers)."""
        return family == self.family or family in self.judged_families

    @property
    def role(self) -> SettingRole:
        if self.reference == self.name:
            return SettingRole.ROOT
        return SettingRole.JUDGE_ONLY if self.judge_only else SettingRole.JUDGED

    @property
    def process_affinity(self) -> str:
        """Cases share warm worker processes only with settings of the same affinity (and world size).

        Empty for most settings; a setting that leaves per-process state a different setting would trip
        over (a runtime configurable once per process) names its own.
        """
        return ""

    @property
    def computes_on_gpu(self) -> bool:
        """True for a setting whose ranks put tensors on a GPU whatever the sweep's device (CPU versus GPU): its
        ranks start as fresh processes where a GPU is in reach, never forked from the import server (a process forked
        from one that touched CUDA cannot use it). It names a process affinity of its own, so its cases never share
        a bucket with settings whose ranks are forked."""
        return False

    def judges(self, tensor_name: str) -> bool:
        """Whether a recorded tensor of the reference is expected from this setting too (default: all)."""
        return True

    def tolerance(self, default: Tolerance) -> Tolerance:
        """The allclose tolerance this setting is judged by: the user's, unless its arithmetic is coarser
        by design (a reduced-precision setting states its own, derived from its unit roundoff)."""
        return default

    def available(self) -> str | None:
        """None if this machine can run the setting (libraries, devices), else the reason it cannot."""
        return None

    @property
    def collectives(self) -> frozenset[str] | None:
        """The torch.distributed operations it runs on tensors of its device ("all_reduce", "all_gather", "send", …),
        including those of processes it starts itself; None: not declared. A backend that does not carry one on the
        sweep's device makes the setting `unsupported` (`difftest.contracts.devices.collective_refusal`)."""
        return None

    def attribute(self, first_divergence: str, notes: Mapping[str, str]) -> str | None:
        """Where one case runs several mechanisms at once (a mixed sharding plan): the name of the registered setting
        that runs only the mechanism its first divergence (`phase/tensor`) lies in, read from what the case recorded
        (its `notes`, by key). Triage signs the case as that setting's where that setting disagrees on the same model too, so one
        bug is one finding however it was reached. None: the case stands for itself."""
        return None

    def standalone(self, case: StandaloneCase) -> Script | None:
        """This setting's part of a script that reproduces a finding without difftest (`difftest.scripts.emit`): the
        library code it runs, copied from its own module. None: its family has no emitter; raises `Unsupported`
        when the emitter cannot express this case."""
        return None

    @abc.abstractmethod
    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        """Train/evaluate on every rank; rank 0 returns the full logical tensors, other ranks None."""


class Repeat(Setting):
    """A registered setting run again another way (a derived setting: `rerun/…`, `calib-…/…`): it runs where its
    base runs, on the models its base supports, and is judged against its base."""

    base: Setting  # a dataclass field of each subclass

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.base.world_size

    @property
    def reference(self) -> str:  # type: ignore[override]
        return self.base.name

    @property
    def process_affinity(self) -> str:
        return self.base.process_affinity

    @property
    def computes_on_gpu(self) -> bool:
        return self.base.computes_on_gpu

    @property
    def family_label(self) -> str:
        return f"{self.family}/{self.base.family_label}"

    def supports(self, spec: ModelSpec) -> str | None:
        return self.base.supports(spec)

    def available(self) -> str | None:
        return self.base.available()

    @property
    def collectives(self) -> frozenset[str] | None:
        return self.base.collectives


def variant_of(base: type[SettingT], setting: Setting, **changes: Any) -> SettingT:
    """`dataclasses.replace(setting, **changes)`, built as `base`: a subclass of a setting (a planted fault) is judged
    against the clean setting it breaks, never against another instance of itself."""
    fields = dataclasses.fields(cast("type[DataclassInstance]", base))  # every setting class is a dataclass
    values = {f.name: getattr(setting, f.name) for f in fields if f.init}
    return base(**{**values, **changes})
