"""Name → object registries for settings and generators, filled by plugin modules on import.

A plugin is any importable module that calls `register_setting(...)` / `register_generator(...)` at import
time. The built-in ones come from the `difftest.plugins` entry point (the `settings` package); tests and
users add theirs with `--plugin module.name`. Worker processes import the same plugin list, so a setting
registered by a test exists in the workers too.
"""

from __future__ import annotations

import fnmatch
import importlib
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable

from difftest.errors import UserError
from difftest.setting import Setting

_SETTINGS: dict[str, Setting] = {}
_GENERATORS: dict[str, Any] = {}
_LOADED_PLUGINS: set[str] = set()
# prefix -> factory making a setting out of any registered one (`rerun/<name>`); made on demand, so a
# default sweep does not double, and kept apart from _SETTINGS so `all_settings` lists only the base ones
_DERIVED: dict[str, Callable[[Setting], Setting]] = {}
_DERIVED_MADE: dict[str, Setting] = {}

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


def register_derived(prefix: str, factory: Callable[[Setting], Setting]) -> None:
    """Settings named `<prefix>/<any registered setting>`, each made by `factory(that setting)`."""
    _DERIVED[prefix] = factory


def _derived(name: str) -> Setting | None:
    prefix, _, base = name.partition("/")
    if prefix not in _DERIVED or base not in _SETTINGS:
        return None
    if name not in _DERIVED_MADE:
        _DERIVED_MADE[name] = _DERIVED[prefix](_SETTINGS[base])
    return _DERIVED_MADE[name]


def derived_prefixes() -> list[str]:
    return sorted(_DERIVED)


def register_generator(kind: str, generator: Any) -> Any:
    _GENERATORS[kind] = generator
    return generator


def builtin_plugins() -> tuple[str, ...]:
    names = {ep.value for ep in entry_points(group="difftest.plugins")}
    return tuple(sorted(names | set(BUILTIN_PLUGINS)))


def load_plugins(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Import built-in and extra plugin modules once; returns the full list (for workers to repeat)."""
    modules = builtin_plugins() + tuple(m for m in extra if m not in BUILTIN_PLUGINS)
    for module in modules:
        if module in _LOADED_PLUGINS:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                raise UserError(f"plugin {module!r} is not importable; check --plugin and PYTHONPATH") from None
            raise
        _LOADED_PLUGINS.add(module)
    return modules


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


def select_settings(patterns: str | None) -> list[Setting]:
    """Settings whose names match any of the comma-separated glob patterns (all when None). A pattern
    `<derived prefix>/<glob>` selects the derived settings of the registered ones its glob matches."""
    settings = all_settings()
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


def with_references(settings: list[Setting]) -> list[Setting]:
    """`settings` followed by every setting they are judged against, transitively (a rerun needs its first run, a
    moved pipeline its uninterrupted one, that one its accumulation), so that any selection can be judged on its own."""
    chosen = {s.name: s for s in settings}
    pending = [s.reference for s in settings]
    while pending:
        name = pending.pop()
        if name not in chosen:
            chosen[name] = get_setting(name)
            pending.append(chosen[name].reference)
    return list(chosen.values())


def get_generator(kind: str) -> Any:
    try:
        return _GENERATORS[kind]
    except KeyError:
        known = ", ".join(sorted(_GENERATORS)) or "none"
        raise UserError(f"unknown model kind {kind!r}; known kinds: {known}") from None


def generator_kinds() -> list[str]:
    return sorted(_GENERATORS)
