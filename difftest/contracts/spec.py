"""Pure-data descriptions of models and run configuration, stored as JSON next to the tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftest.contracts.errors import UserError

COMMANDS_KEY = "commands"  # in run.json: the commands run on the folder (words, start, folder), the latest last
PLUGIN_FOLDERS_KEY = "plugin_folders"  # in run.json: where its plugin modules were imported from, every one kept
# what run.json holds beside the configuration: what ran it (difftest.storage.stack), the digests of what generate
# wrote (difftest.storage.integrity), the commands and plugin folders
RECORDED_KEYS = ("stack", "earlier_stacks", "files", COMMANDS_KEY, PLUGIN_FOLDERS_KEY)


@dataclass(frozen=True)
class ModelSpec:
    """What a generator needs to rebuild a model bit for bit: kind, seed, index and the drawn parameters."""

    kind: str
    seed: int
    index: int
    params: dict[str, Any]
    frozen: tuple[str, ...] = ()
    input_seed: int = 0
    # set on a model derived from a generated one (a minimised finding's `min`, a minimiser's trial `c3`): it keeps
    # the weights' and inputs' seeds and differs only by what its params leave out
    variant: str = ""

    @property
    def model_id(self) -> str:
        suffix = "-frozen" if self.frozen else ""
        return f"{self.kind}-s{self.seed}-i{self.index}{suffix}" + (f"-{self.variant}" if self.variant else "")

    @property
    def input_id(self) -> str:
        return f"{self.model_id}/in{self.input_seed}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<spec>") -> ModelSpec:
        try:
            raw = json.loads(text)
            raw["frozen"] = tuple(raw.get("frozen", ()))
            return cls(**raw)
        except (ValueError, TypeError) as exc:
            raise UserError(f"{source}: not a difftest model spec ({exc}); regenerate it with `difftest generate`") from None


@dataclass(frozen=True)
class RunConfig:
    """How a run was generated and is to be trained; saved as run.json so reruns resume the same work."""

    seed: int = 0
    models: int = 2
    kinds: tuple[str, ...] = ("dlrm",)
    # kind -> how many models of it, where not `models` (the default job takes one of each newer, larger kind)
    models_of: dict[str, int] = field(default_factory=dict)
    steps: int = 1
    lr: float = 0.1
    batch_size: int = 24
    plugins: tuple[str, ...] = field(default_factory=tuple)
    # the index of each kind's first model (a campaign's rounds start at others, so every model variant comes round)
    first_index: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    def count(self, kind: str) -> int:
        """How many models of `kind` the run has."""
        return self.models_of.get(kind, self.models)

    def generated(self) -> RunConfig:
        """This configuration less the kinds it makes no model of: what decides the run's models. The default job
        names every kind, the zoos' with 0 models, so a kind a later difftest adds must not stop a rerun resuming."""
        kinds = tuple(k for k in self.kinds if self.count(k) > 0)
        return dataclasses.replace(self, kinds=kinds,
                                   models_of={k: n for k, n in self.models_of.items() if n > 0 or k not in self.kinds})

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        try:
            raw = json.loads(path.read_text())
            for recorded in RECORDED_KEYS:  # not how the run was made
                raw.pop(recorded, None)
            for key in ("kinds", "plugins"):
                raw[key] = tuple(raw.get(key, ()))
            return cls(**raw)
        except FileNotFoundError:
            raise UserError(f"{path.parent}: not a difftest run (no run.json); create one with `difftest generate --out {path.parent}`") from None
        except (ValueError, TypeError) as exc:
            raise UserError(f"{path}: unreadable run config ({exc}); regenerate the run with `difftest generate`") from None


def run_plugin_folders(path: Path) -> tuple[str, ...]:
    """Where the run's plugin modules were imported from (run.json's `plugin_folders`), then the folders its commands
    ran in, the latest first (its `commands`, for a run recorded before it kept the former): where a module given as
    `--model my_model:adapter` is looked for by a command run from another folder."""
    try:
        raw = json.loads(path.read_text())
        folders = [str(f) for f in raw.get(PLUGIN_FOLDERS_KEY) or []]
        commands = raw.get(COMMANDS_KEY) or []
        folders += [str(c["cwd"]) for c in reversed(commands) if isinstance(c, dict) and c.get("cwd")]
    except (OSError, ValueError, AttributeError, TypeError):
        return ()
    return tuple(dict.fromkeys(folders))


def config_with_commands(config: RunConfig, source: Path) -> str:
    """`config` as a run.json holds it, with what the run.json at `source` recorded of its commands and plugin folders:
    a copy of a run made for one finding (or a minimisation round) finds the run's model modules where it does."""
    raw = json.loads(config.to_json())
    with contextlib.suppress(OSError, ValueError, AttributeError):
        recorded = json.loads(source.read_text())
        raw |= {key: recorded[key] for key in (COMMANDS_KEY, PLUGIN_FOLDERS_KEY) if key in recorded}
    return json.dumps(raw, indent=1, sort_keys=True)
