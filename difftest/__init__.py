"""difftest: differential testing of distributed and quantized training settings.

This module is the public API: what a user's adapter, a setting family and a model kind import (the built-in ones in
`settings/` and `generators/` import nothing else, which `lint-imports` checks). Everything below it is internal.

The engine's folders, in the order a run goes through them (a folder imports only the ones listed after it; the
layers contract in pyproject.toml checks it):

    cli/          the `difftest` command
    campaign/     rounds of fresh models for hours, sampling where causes were found, the live page
    pipeline.py   judge → triage → minimise → scripts → report, on a swept run folder
    reporting/    report.html, findings.md/csv, ISSUE.md, the CI summary, the terminal's progress
    releases/     an environment per torch release, bisect, two runs compared
    scripts/      a finding's standalone script: emitted, checked sealed, reduced
    findings/     signatures, triage, the manifest of known bugs, live findings, minimisation, reproduction
    generation/   models and inputs from (seed, index), written in parallel
    judging/      the oracle, the calibrated envelope, a run's comparisons
    runner/       the sweep: warm rank groups, the scheduler, local and Ray executors, processes a setting starts
    storage/      the case store, model artifacts, the run folder, the recorded stack, integrity checks
    contracts/    what plugins are written against: Setting, Generator, ModelSpec, Batch, Status, errors, devices
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

from difftest.contracts.adapter import AdapterGenerator, ModelAdapter
from difftest.contracts.batch import Batch, JaggedFeature
from difftest.contracts.devices import (
    DATA_PARALLEL,
    POINT_TO_POINT,
    SHARDED,
    across,
    collective_refusal,
    device_refusal,
    rank_device,
    visible_gpus,
)
from difftest.contracts.errors import ConversionFailed, InvariantViolated, Unsupported, UserError
from difftest.contracts.generator import UNPLACED, EmbeddingTable, Generator, ModelCode, order_by_words
from difftest.contracts.model import Inputs, LoadedModel
from difftest.contracts.registry import (
    features_of,
    get_setting,
    register_calibration,
    register_derived,
    register_generator,
    register_setting,
    register_settings,
    register_world_reset,
    traits_of,
)
from difftest.contracts.script import Script, StandaloneCase, failure_pattern, refuse_changed_hooks
from difftest.contracts.setting import Outputs, Repeat, RunContext, Setting, SettingRole, variant_of
from difftest.contracts.spec import ModelSpec
from difftest.contracts.status import Status
from difftest.contracts.tolerance import ACTIVATION, UNIT_ROUNDOFF, Tolerance
from difftest.contracts.training import EVAL_BEFORE, gather_to_rank0, loss_record, record_training, to_numpy

__all__ = [
    "ACTIVATION",
    "DATA_PARALLEL",
    "EVAL_BEFORE",
    "POINT_TO_POINT",
    "SHARDED",
    "UNIT_ROUNDOFF",
    "UNPLACED",
    "AdapterGenerator",
    "Batch",
    "BatchSource",
    "ChainStage",
    "ConversionFailed",
    "EmbeddingTable",
    "Generator",
    "Inputs",
    "InvariantViolated",
    "JaggedFeature",
    "LayerChain",
    "LoadedModel",
    "ModelAdapter",
    "ModelCode",
    "ModelSpec",
    "Outputs",
    "ProcessesFailed",
    "Repeat",
    "Reproduction",
    "RunContext",
    "Script",
    "Setting",
    "SettingRole",
    "StandaloneCase",
    "Status",
    "Tolerance",
    "Unsupported",
    "UserError",
    "across",
    "collective_refusal",
    "current_stack",
    "device_refusal",
    "failure_pattern",
    "features_of",
    "gather_to_rank0",
    "get_setting",
    "load_model",
    "loss_record",
    "order_by_words",
    "rank_device",
    "record_training",
    "refuse_changed_hooks",
    "register_calibration",
    "register_derived",
    "register_generator",
    "register_setting",
    "register_settings",
    "register_world_reset",
    "reproduce",
    "run_in_processes",
    "to_numpy",
    "traits_of",
    "variant_of",
    "visible_gpus",
]

# imported when asked for, not with every setting module: they reach the store, pandas or the runner
_LAZY = {
    "reproduce": ("difftest.findings.repro", "reproduce"),
    "Reproduction": ("difftest.findings.repro", "Reproduction"),
    "run_in_processes": ("difftest.runner.processes", "run_in_processes"),
    "ProcessesFailed": ("difftest.runner.processes", "ProcessesFailed"),
    "load_model": ("difftest.storage.artifacts", "load_model"),
    "current_stack": ("difftest.storage.stack", "current"),
    # torch modules: imported with torch, when a pipeline setting or a kind that splits into a chain asks
    "BatchSource": ("difftest.contracts.chain", "BatchSource"),
    "ChainStage": ("difftest.contracts.chain", "ChainStage"),
    "LayerChain": ("difftest.contracts.chain", "LayerChain"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'difftest' has no attribute {name!r}")


# The engine's modules before they moved into folders by stage: a plugin or script that imports one by its old name
# gets the module it became, with a DeprecationWarning. Kept for one release.
MOVED = {
    "adapter": "contracts.adapter", "batch": "contracts.batch", "devices": "contracts.devices",
    "errors": "contracts.errors", "generator": "contracts.generator", "logs": "contracts.logs",
    "registry": "contracts.registry", "setting": "contracts.setting", "spec": "contracts.spec",
    "standalone_runtime": "contracts.script_runtime", "status": "contracts.status",
    "artifacts": "storage.artifacts", "integrity": "storage.integrity", "paths": "storage.paths",
    "run_folder": "storage.run_folder", "stack": "storage.stack", "store": "storage.store",
    "verify": "storage.verify",
    "analysis": "judging.analysis", "envelope": "judging.envelope", "oracle": "judging.oracle",
    "generate": "generation.generate",
    "known": "findings.known", "live": "findings.live", "minimize": "findings.minimise", "repro": "findings.repro",
    "signature": "findings.signature", "triage": "findings.triage",
    "script_check": "scripts.check", "script_reduce": "scripts.reduce", "standalone": "scripts.emit",
    "standalone_findings": "scripts.write",
    "ci_summary": "reporting.ci_summary", "finding_folders": "reporting.finding_folders",
    "issue_report": "reporting.issue_report", "progress": "reporting.progress", "render": "reporting.render",
    "report": "reporting.report",
    "bisect": "releases.bisect", "releases": "releases.environments", "run_diff": "releases.diff",
    "campaign": "campaign.rounds", "campaign_page": "campaign.page", "sampling": "campaign.sampling",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`difftest.<old name>` → the module it moved to (the same module object, so state is shared)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, old = fullname.partition(".")
        if prefix != "difftest" or old not in MOVED or "." in old:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = f"difftest.{MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there (or the public names from difftest)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        pass  # the module it moved to is already executed


# a package of the same name (difftest/campaign, difftest/releases) is found by the normal finders first: only the
# modules whose old name is no package today go through this one
sys.meta_path.append(_MovedModule())
