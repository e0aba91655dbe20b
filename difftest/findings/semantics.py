"""Known semantic differences between one process and distributed training (`model_semantics.toml`): a model whose
layers compute a sample's result from its batch-mates or from a random draw computes something else wherever a
setting splits the batch. Such a disagreement is the model's (or its training setup's), with a one-line fix, not the
library's bug; triage gives it that cause, one finding per cause."""

from __future__ import annotations

import fnmatch
import functools
import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

MANIFEST = Path(__file__).with_name("model_semantics.toml")


@dataclass(frozen=True)
class SemanticDifference:
    id: str
    layer: str  # the layer kind the model must have (`Generator.features`)
    title: str
    fix: str
    statuses: tuple[str, ...]
    settings: tuple[str, ...]  # fnmatch globs: the settings that split the batch
    exempt: tuple[str, ...] = ()  # globs: the settings that undo the difference (the fix, run)

    def explains(self, setting: str, status: str, layers: Iterable[str]) -> bool:
        return (status in self.statuses and self.layer in set(layers)
                and any(fnmatch.fnmatchcase(setting, g) for g in self.settings)
                and not any(fnmatch.fnmatchcase(setting, g) for g in self.exempt))


@functools.cache
def differences() -> tuple[SemanticDifference, ...]:
    with MANIFEST.open("rb") as f:
        entries = tomllib.load(f)["difference"]
    return tuple(SemanticDifference(id=e["id"], layer=e["layer"], title=e["title"], fix=e["fix"],
                                    statuses=tuple(e["statuses"]), settings=tuple(e["settings"]),
                                    exempt=tuple(e.get("exempt", ()))) for e in entries)


def semantic_difference_of(rows: pd.DataFrame, layers: Mapping[str, Iterable[str]]) -> SemanticDifference | None:
    """The semantic difference that explains every one of a finding's cases (`layers`: model → its layer kinds), if
    any: a finding with a case it does not explain has another cause too, and stays the library's to answer."""
    explained: Counter[SemanticDifference] = Counter()
    for r in rows.itertuples():
        found = next((d for d in differences()
                      if d.explains(getattr(r, "signed_as", r.setting), r.status, layers.get(r.model, ()))), None)
        if found is None:
            return None
        explained[found] += 1
    return explained.most_common(1)[0][0] if explained else None
