"""Library findings difftest already knows, as data: `difftest/findings/known_issues.toml`.

Each entry says which cases one library bug produces (setting globs, statuses, a message pattern for failures, the
model traits it needs, whether only the calibrated oracle sees it), which library and releases it affects, and what
upstream knows of it (tracker references, each the same bug or a related one). Triage marks every finding with
the entry its cases match — `known` (upstream has the same bug), `related` (upstream has a related one),
`unreported` (we know it, upstream does not seem to) — or `new` (no entry: look at it first). Tests that run real
sweeps take the library findings they expect from here, keyed by the installed releases, so an upstream fix reads
"known finding X no longer reproduces on torch 2.15", never as a broken assertion.
"""

from __future__ import annotations

import enum
import fnmatch
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from difftest.contracts.errors import UserError
from difftest.contracts.status import Status

MANIFEST = Path(__file__).with_name("known_issues.toml")
# a library by the name the manifest uses -> the distributions that install it (CPU and CUDA builds)
_DISTRIBUTIONS = {"fbgemm-gpu": ("fbgemm-gpu", "fbgemm-gpu-cpu"), "tensorflow": ("tensorflow", "tensorflow-cpu")}


class Upstream(enum.StrEnum):
    KNOWN = "known"
    RELATED = "related"
    UNREPORTED = "unreported"
    NEW = "new"
    # no entry explains it and every case is on a user's own model (`difftest.ModelAdapter`): the cause may be the
    # model (BatchNorm without SyncBatchNorm, dropout drawn per rank, a loss that sums) before it is the library
    YOUR_MODEL = "your-model"


@dataclass(frozen=True)
class Reference:
    tracker: str  # owner/repo
    number: int
    title: str
    state: str  # open | closed | merged
    relation: str  # same | related

    def __str__(self) -> str:
        return f"{self.tracker}#{self.number} ({self.state}, {self.relation})"


@dataclass(frozen=True)
class KnownIssue:
    id: str
    title: str
    library: str  # the distribution the bug lives in, as pip names it
    affects: str  # a version specifier of `library`: the releases it is known to reproduce on
    statuses: tuple[str, ...]
    settings: tuple[str, ...]  # fnmatch globs over setting names
    message: str = ""  # a regex the case's message must contain (failures)
    traits: tuple[str, ...] = ()  # the model must have one of these generator traits
    calibrated_only: bool = False  # D3's allclose passes it; only the calibrated oracle sees it
    default_job: bool = False  # the default job shows it wherever it reproduces (the end-to-end test expects it)
    references: tuple[Reference, ...] = ()
    notes: str = ""
    # the largest relative difference (|setting - reference| / |reference| at its first divergence) the bug explains:
    # a larger divergence in the same setting is another bug, not this one
    explains_relative: float | None = None

    @property
    def upstream(self) -> Upstream:
        relations = {r.relation for r in self.references}
        if "same" in relations:
            return Upstream.KNOWN
        return Upstream.RELATED if relations else Upstream.UNREPORTED

    def matches(self, setting: str, status: str, message: str, traits: Iterable[str], d3_status: str = "",
                relative: float | None = None) -> bool:
        """Whether this bug explains one case: its status, setting, message and traits, and — where the entry states
        the size it explains (`explains_relative`) and the case's divergence is sized (`relative`: the largest
        |setting - reference| / |reference| of its tensors) — no larger than that."""
        if status not in self.statuses or not any(fnmatch.fnmatchcase(setting, g) for g in self.settings):
            return False
        if self.explains_relative is not None and relative is not None and relative > self.explains_relative:
            return False
        if self.message and not re.search(self.message, str(message)):
            return False
        if self.traits and not set(self.traits) & set(traits):
            return False
        return not (self.calibrated_only and d3_status and d3_status != Status.OK)

    def reproduces_on(self, versions: Mapping[str, str | None]) -> bool | None:
        """Whether the installed release of its library is one it is known on; None if the library is missing."""
        installed = versions.get(self.library)
        if installed is None:
            return None
        return SpecifierSet(self.affects).contains(Version(installed).base_version, prereleases=True)

    def describe_upstream(self) -> str:
        if not self.references:
            return f"{self.upstream}: not found upstream"
        return f"{self.upstream}: " + ", ".join(str(r) for r in self.references)


def _parse(entry: dict[str, Any], where: str) -> KnownIssue:
    try:
        references = tuple(Reference(r["tracker"], int(r["number"]), r["title"], r["state"], r["relation"])
                           for r in entry.get("references", ()))
        issue = KnownIssue(
            id=entry["id"], title=entry["title"], library=entry["library"], affects=entry["affects"],
            statuses=tuple(entry["statuses"]), settings=tuple(entry["settings"]), message=entry.get("message", ""),
            traits=tuple(entry.get("traits", ())), calibrated_only=bool(entry.get("calibrated_only", False)),
            default_job=bool(entry.get("default_job", False)), references=references, notes=entry.get("notes", ""),
            explains_relative=float(entry["explains_relative"]) if "explains_relative" in entry else None)
        SpecifierSet(issue.affects)
        re.compile(issue.message)
    except (KeyError, TypeError, ValueError, InvalidSpecifier, re.error) as error:
        raise UserError(f"{where}: entry {entry.get('id', '?')!r} is malformed ({type(error).__name__}: {error}); "
                        "fix it against the fields described at the top of the file") from None
    if any(r.relation not in ("same", "related") for r in references):
        raise UserError(f"{where}: entry {issue.id!r}: a reference's relation must be 'same' or 'related'")
    return issue


def load(path: Path = MANIFEST) -> tuple[KnownIssue, ...]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise UserError(f"{path}: cannot read the known-issues manifest ({error})") from None
    issues = tuple(_parse(entry, str(path)) for entry in data.get("issue", ()))
    ids = [i.id for i in issues]
    if len(set(ids)) != len(ids):
        raise UserError(f"{path}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return issues


@cache
def manifest() -> tuple[KnownIssue, ...]:
    return load()


def get(issue_id: str) -> KnownIssue:
    found = next((i for i in manifest() if i.id == issue_id), None)
    if found is None:
        raise KeyError(f"{MANIFEST}: no entry {issue_id!r}")
    return found


def reproduces_here(issue_id: str) -> bool:
    """Whether the installed release of the entry's library is one the bug is known on (tests expect it there)."""
    issue = get(issue_id)
    return bool(issue.reproduces_on({issue.library: installed_version(issue.library)}))


def match(setting: str, status: str, message: str, traits: Iterable[str], d3_status: str = "",
          issues: Iterable[KnownIssue] | None = None,
          versions: Mapping[str, str | None] | None = None, relative: float | None = None) -> KnownIssue | None:
    """The first entry that explains one case that is not ok, or None (a new finding). With `versions` (the run's
    libraries, `stack_versions`), an entry whose `affects` excludes its library's release there explains nothing: the
    same symptom on a release the bug is not known on is a regression or another bug, and stays visible as new."""
    traits = tuple(traits)
    return next((i for i in (manifest() if issues is None else issues)
                 if i.matches(setting, status, message, traits, d3_status, relative)
                 and (versions is None or i.reproduces_on(versions) is not False)), None)


def stack_versions(libraries: Mapping[str, str]) -> dict[str, str | None]:
    """A recorded stack's `libraries` (distribution -> version, as run.json holds them) keyed by the manifest's
    library names (`fbgemm-gpu` for either fbgemm build); a version that is no release (a local build) is left out."""
    def release(version: str | None) -> bool:
        try:
            return version is not None and bool(Version(version))
        except InvalidVersion:
            return False

    versions: dict[str, str | None] = {}
    for library in {i.library for i in manifest()}:
        found = next((v for d in _DISTRIBUTIONS.get(library, (library,)) if release(v := libraries.get(d))), None)
        if found is not None:
            versions[library] = found
    return versions


def installed_version(library: str) -> str | None:
    for distribution in _DISTRIBUTIONS.get(library, (library,)):
        try:
            found = metadata.version(distribution)
            Version(found)
        except (metadata.PackageNotFoundError, InvalidVersion):
            continue
        return found
    return None


def installed_versions(libraries: Iterable[str]) -> dict[str, str | None]:
    return {name: installed_version(name) for name in libraries}
