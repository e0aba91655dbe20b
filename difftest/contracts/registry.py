"""Name → object registries for settings and generators, filled by plugin modules on import.

A plugin is any importable module that calls `register_setting(...)` / `register_generator(...)` at import
time. The built-in ones come from the `difftest.plugins` entry point (the `settings` package); tests and
users add theirs with `--plugin module.name`. Worker processes import the same plugin list, so a setting
registered by a test exists in the workers too.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from difftest.contracts.errors import UserError
from difftest.contracts.generator import Generator, UnregisteredKind
from difftest.contracts.setting import Setting, SettingRole
from difftest.contracts.spec import ModelSpec

_SETTINGS: dict[str, Setting] = {}
_GENERATORS: dict[str, Generator] = {}
_LOADED_PLUGINS: set[str] = set()
# prefix -> factory making a setting out of any registered one (`rerun/<name>`); made on demand, so a
# default sweep does not double, and kept apart from _SETTINGS so `all_settings` lists only the base ones
_DERIVED: dict[str, Callable[[Setting], Setting | None]] = {}  # None: the base has no such derived setting
_DERIVED_MADE: dict[str, Setting | None] = {}
# calibration prefix -> the precisions whose envelope needs it (`difftest.judging.envelope`); every sweep runs them beside
# the roots its settings are judged down to
_CALIBRATIONS: dict[str, tuple[str, ...]] = {}
_CALIBRATION_CENTRE: list[str] = []  # the prefix of the float64 run every envelope is centred on

_WORLD_RESETS: list[Callable[[], None]] = []

BUILTIN_PLUGINS = ("generators", "settings")


def register_setting(setting: Setting) -> Setting:
    existing = _SETTINGS.get(setting.name)
    if existing is not None and existing != setting:
        raise ValueError(f"setting name {setting.name!r} registered twice with different parameters")
    _SETTINGS[setting.name] = setting
    return setting


def register_settings(settings: Iterable[Setting]) -> None:
    for setting in settings:
        register_setting(setting)


def register_derived(prefix: str, factory: Callable[[Setting], Setting | None]) -> None:
    """Settings named `<prefix>/<any registered setting>`, each made by `factory(that setting)`."""
    _DERIVED[prefix] = factory


def register_calibration(prefix: str, factory: Callable[[Setting], Setting | None], precisions: Iterable[str],
                         centre: bool = False) -> None:
    """A derived setting `<prefix>/<root>` that reruns a root (a setting judged against itself) to measure its noise;
    sweeps add it for every root whose dependants judge at one of `precisions`, unless they are judged bitwise.
    `factory` returns None for a root the calibration does not apply to. The `centre` one is the exact result
    (float64) the others are measured from."""
    register_derived(prefix, factory)
    _CALIBRATIONS[prefix] = tuple(precisions)
    if centre:
        _CALIBRATION_CENTRE[:] = [prefix]


def is_calibration(name: str) -> bool:
    """Whether a setting name is a calibration run (`<calibration prefix>/<root>`): a measurement, not a claim."""
    return name.split("/", 1)[0] in _CALIBRATIONS


def calibration_prefixes(precision: str) -> list[str]:
    return [p for p, needed in _CALIBRATIONS.items() if precision in needed]


def calibrations_of(root: Setting, precision: str) -> tuple[str | None, list[str]]:
    """(the centre's setting name, the names of the legitimate runs at `precision`) calibrating `root`; the root
    itself is one of those runs when it computes at that precision."""
    centre = _CALIBRATION_CENTRE[0] if _CALIBRATION_CENTRE else None
    runs = [root.name] if root.precision == precision else []
    runs += [made.name for p in calibration_prefixes(precision) if p != centre
             and (made := _derived(f"{p}/{root.name}")) is not None]
    return (f"{centre}/{root.name}" if centre and _derived(f"{centre}/{root.name}") else None), runs


def root_of(setting: Setting) -> Setting:
    """The end of the setting's reference chain: the computation its result should equal."""
    seen = {setting.name}
    while setting.reference != setting.name:
        setting = get_setting(setting.reference)
        if setting.name in seen:
            raise ValueError(f"reference chain of {setting.name!r} loops")
        seen.add(setting.name)
    return setting


def _derived(name: str) -> Setting | None:
    prefix, _, base = name.partition("/")
    if prefix not in _DERIVED or base not in _SETTINGS:
        return None
    if name not in _DERIVED_MADE:
        _DERIVED_MADE[name] = _DERIVED[prefix](_SETTINGS[base])
    return _DERIVED_MADE[name]


def register_world_reset(reset: Callable[[], None]) -> Callable[[], None]:
    """`reset()` runs on every rank after each case's process group is destroyed: a plugin (or the library it
    drives) that keeps process groups or meshes in module globals forgets them there, since every case runs
    in a fresh default group (`difftest.runner.worker`)."""
    _WORLD_RESETS.append(reset)
    return reset


def reset_world_state() -> None:
    for reset in _WORLD_RESETS:
        reset()


def derived_prefixes() -> list[str]:
    return sorted(_DERIVED)


def register_generator(kind: str, generator: Generator) -> Generator:
    if not isinstance(generator, Generator):
        raise TypeError(f"model kind {kind!r}: its generator must subclass difftest.contracts.generator.Generator "
                        f"(got {type(generator).__name__})")
    _GENERATORS[kind] = generator
    return generator


def _import_plugin(module: str, folders: tuple[str, ...]) -> Any:
    """`module`, imported from the path as it is, else from the first of `folders` it imports from (that folder then
    kept on the path, after the user's own entries, and added to PYTHONPATH for the processes a run starts afresh)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if not exc.name or exc.name.split(".")[0] != top:
            raise  # the module imports, but something it imports does not: its own words
        missing = exc
    for folder in (f for f in folders if f not in sys.path):
        sys.path.append(folder)
        importlib.invalidate_caches()
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as again:
            sys.path.remove(folder)  # not there (a folder of that name without the module is a namespace package)
            for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
                del sys.modules[name]
            if again.name and again.name.split(".")[0] == top:
                continue
            raise  # found there, but something it imports is missing: its own words
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), folder) if p)
        return imported
    raise missing


def user_plugin_folders() -> list[str]:
    """The folders the loaded plugins that are not difftest's own were imported from: the path entry holding each one's
    top-level package or module (what run.json keeps, so a command elsewhere finds them)."""
    folders = []
    for plugin in sorted(_LOADED_PLUGINS - set(builtin_plugins())):
        top = sys.modules.get(plugin.partition(":")[0].split(".")[0])
        # a package (namespace ones too) is the folder its __path__ names; a module, the file its __file__ names
        where = next(iter(getattr(top, "__path__", [])), None) or getattr(top, "__file__", None)
        if where:
            folders.append(str(Path(where).parent))
    return list(dict.fromkeys(folders))


def load_run_plugins(run_dir: Path, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The run's plugins (its run.json's) and `extra`, looked for where the run's commands ran too."""
    from difftest.contracts.spec import RunConfig, run_plugin_folders

    return load_plugins(RunConfig.load(run_dir / "run.json").plugins + tuple(extra),
                        run_plugin_folders(run_dir / "run.json"))


def builtin_plugins() -> tuple[str, ...]:
    names = {ep.value for ep in entry_points(group="difftest.plugins")}
    return tuple(sorted(names | set(BUILTIN_PLUGINS)))


def load_plugins(extra: Iterable[str] = (), folders: Iterable[str] = ()) -> tuple[str, ...]:
    """Import built-in and extra plugin modules once; returns the full list (for workers to repeat). A module not
    importable here is looked for in `folders` too (where the run's commands ran: `run_plugin_folders`), so a run
    made with `--model my_model:adapter` in the model's folder is analysed and reproduced from any other."""
    modules, folders = builtin_plugins() + tuple(m for m in extra if m not in BUILTIN_PLUGINS), tuple(folders)
    for plugin in modules:
        if plugin in _LOADED_PLUGINS:
            continue
        module, _, attribute = plugin.partition(":")  # `mypkg.models:adapter`: a user's model adapter in a module
        try:
            imported = _import_plugin(module, folders)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                where = f" (nor in {', '.join(folders)}, where the run's commands ran)" if folders else ""
                raise UserError(f"plugin {module!r} is not importable{where}; check --plugin/--model and PYTHONPATH") \
                    from None
            raise
        except SyntaxError as exc:  # the user's own file: where, and what Python says
            raise UserError(f"plugin {module!r} does not compile: {exc.filename}, line {exc.lineno}: {exc.msg}; fix "
                            "the module and run again") from None
        if attribute:
            adapter = getattr(imported, attribute, None)
            if not callable(getattr(adapter, "register_as_kind", None)):
                raise UserError(f"--model {plugin}: {module} has no ModelAdapter named {attribute!r} (make one with "
                                "difftest.ModelAdapter)")
            adapter.register_as_kind()  # type: ignore[union-attr]
        _LOADED_PLUGINS.add(plugin)
    return modules


def loaded_plugins() -> tuple[str, ...]:
    """The plugin modules this process has imported, in a form `load_plugins` takes (for processes it starts)."""
    return tuple(sorted(_LOADED_PLUGINS))


def get_setting(name: str) -> Setting:
    try:
        return _SETTINGS[name]
    except KeyError:
        derived = _derived(name)
        if derived is not None:
            return derived
        raise UserError(f"unknown setting {name!r}; `difftest settings list` shows the registered ones") from None


def all_settings() -> list[Setting]:
    return sorted(_SETTINGS.values(), key=lambda s: (s.name != "reference", s.name))


def select_settings(patterns: str | None, tier_name: str | None = None) -> list[Setting]:
    """Settings whose names match any of the comma-separated glob patterns (all when None), within a tier. A pattern
    `<derived prefix>/<glob>` selects the derived settings of the registered ones its glob matches.

    Without patterns the tier defaults to `default`; with patterns, to `full` (a glob means what it matches)."""
    settings = tier(tier_name or ("full" if patterns else "default"))
    if not patterns:
        return settings
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [s for s in settings if any(fnmatch.fnmatchcase(s.name, g) for g in globs)]
    for glob in globs:
        prefix, _, rest = glob.partition("/")
        if prefix in _DERIVED:
            chosen += [get_setting(f"{prefix}/{s.name}") for s in settings if fnmatch.fnmatchcase(s.name, rest)]
    chosen = list({s.name: s for s in chosen}.values())
    if not chosen:
        raise UserError(f"--settings {patterns!r} matches no registered setting; `difftest settings list` shows them")
    return chosen


TIERS = ("default", "full")


def tier(name: str) -> list[Setting]:
    """The settings of a tier. `full` is every registered setting. `default` covers every class of setting and,
    within it, every value of each parameter the class names in `tier_axes` (each sharding type, schedule,
    quantization scheme, oracle mode) with the fewest, cheapest settings (a class that says it is too costly,
    `Setting.in_default_tier`, is left to `full`): a greedy set cover that prefers the
    setting adding the most uncovered values, then the smallest scale of 2 or more (`Setting.scale`). A setting that exists to judge its own
    family (an uninterrupted run, a simulator, a one-rank bf16 run) is only a candidate for values nothing else
    covers; it comes in anyway through `with_references` where the tier needs it."""
    settings = all_settings()
    if name == "full":
        return settings
    if name != "default":
        raise UserError(f"unknown tier {name!r}; tiers: {', '.join(TIERS)}")
    # the roots that exist to judge their own family (`Setting.judges_family`), whatever module holds them; a plugin's
    # planted fault, judged against a family's root, judges nothing of it
    judges_own_family = {s.reference for s in settings
                         if s.reference != s.name and get_setting(s.reference).judges_family(s.family)}
    judges_own_family |= {s.name for s in settings if s.judge_only}
    by_class: dict[type, list[Setting]] = {}
    for setting in settings:
        if type(setting).in_default_tier:
            by_class.setdefault(type(setting), []).append(setting)
    chosen: list[Setting] = []
    for members in by_class.values():
        members = sorted(members, key=lambda s: (s.name in judges_own_family, s.scale < 2, s.scale, s.name))
        axes = type(members[0]).tier_axes
        values = {s.name: {(axis, repr(s.params[axis])) for axis in axes} for s in members}
        candidates = [s for s in members if s.name not in judges_own_family] or members
        uncovered = set().union(*values.values())
        picked = [candidates[0]]
        uncovered -= values[candidates[0].name]
        for pool in (candidates, members):  # family-internal judges last, for values only they have
            while uncovered and (gains := [(len(values[s.name] & uncovered), s) for s in pool]):
                gain, best = max(gains, key=lambda g: (g[0], -pool.index(g[1])))
                if gain == 0:
                    break
                picked.append(best)
                uncovered -= values[best.name]
        chosen += picked
    return with_references(sorted(chosen, key=lambda s: (s.name != "reference", s.name)))


def with_references(settings: list[Setting], calibrate: bool = True) -> list[Setting]:
    """`settings` followed by every setting they are judged against, transitively (a rerun needs its first run, a
    moved pipeline its uninterrupted one, that one its accumulation), so that any selection can be judged on its own;
    with `calibrate`, also the calibration runs of the roots they are judged down to (without them a case keeps D3's
    verdict), for the settings this machine can run."""
    chosen = {s.name: s for s in settings}
    pending = [s.reference for s in settings]
    while pending:
        name = pending.pop()
        if name not in chosen:
            chosen[name] = get_setting(name)
            pending.append(chosen[name].reference)
    for setting in list(chosen.values()) if calibrate else []:
        if setting.role in (SettingRole.ROOT, SettingRole.CALIBRATION) or _bitwise(setting):
            continue
        if setting.available() is not None:
            continue  # it is `unsupported` here: nothing to judge, no noise to measure for it
        root = root_of(setting)
        for prefix in calibration_prefixes(setting.precision):
            calibration = _derived(f"{prefix}/{root.name}")
            if calibration is not None:  # None: a freedom that root does not have
                chosen.setdefault(calibration.name, calibration)
    return list(chosen.values())


def _bitwise(setting: Setting) -> bool:
    from difftest.contracts.tolerance import Tolerance

    return setting.tolerance(Tolerance()) == Tolerance(0.0, 0.0)


def get_generator(kind: str) -> Generator:
    try:
        return _GENERATORS[kind]
    except KeyError:
        known = ", ".join(sorted(_GENERATORS)) or "none"
        raise UserError(f"unknown model kind {kind!r}; known kinds: {known}") from None


def capabilities_of(kind: str) -> Generator:
    """The kind's generator, or for a kind no loaded plugin registers one whose capabilities are all neutral: judging
    a run reads what it can without the plugin it was made with."""
    return _GENERATORS.get(kind) or UnregisteredKind(kind)


def generator_kinds() -> list[str]:
    return sorted(_GENERATORS)


def kind_unavailable(kind: str) -> str | None:
    """None if this machine can generate models of `kind` (its libraries import), else why not."""
    return get_generator(kind).available()


def features_of(spec: ModelSpec) -> frozenset[str]:
    """The layer kinds one model has, as its generator reads them (`Generator.features`: "BatchNorm", "Conv1D", …):
    a setting whose arithmetic a layer kind changes decides `supports` by them."""
    return frozenset(capabilities_of(spec.kind).features(spec))


def traits_of(kind: str) -> frozenset[str]:
    """What a model kind is made of, as its generator declares (`traits`): "torchrec" (EmbeddingBagCollections),
    "keras" (a Keras model with a converted PyTorch form), "transformer", … Settings decide `supports` by these,
    never by a kind's name, so a new kind runs every family its traits admit."""
    return frozenset(get_generator(kind).traits)
