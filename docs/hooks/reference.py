"""The documentation site's reference pages, generated at build time from the code they describe (an mkdocs hook):
`reference/commands.md` from the `difftest` command's own declarations, `reference/settings.md` and
`reference/kinds.md` from the registry with every built-in plugin loaded, `reference/manifest.md` from the manifest of
known bugs. A command, option, setting family or model
kind added to the code is in the site the next time it is built, and a page never describes one that is gone."""

from __future__ import annotations

import inspect
import sys
from collections import defaultdict
from typing import Any

import typer
from mkdocs.structure.files import File, Files

from difftest import Setting
from difftest.cli import app
from difftest.contracts.registry import all_settings, generator_kinds, get_generator, load_plugins, tier


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _first_paragraph(obj: Any) -> str:
    return _cell((inspect.getdoc(obj) or "").split("\n\n")[0])


def commands_page() -> str:
    root = typer.main.get_command(app)
    lines = ["# Commands", "", "Generated from the `difftest` command's own declarations (`difftest/cli/main.py`); "
             "`difftest COMMAND --help` prints the same.", ""]

    def walk(command: Any, path: list[str]) -> None:
        if command.hidden:  # an alias (`triage` is `analyze`)
            return
        if hasattr(command, "commands"):  # a group (typer carries its own copy of click: no isinstance)
            for name in sorted(command.commands):
                walk(command.commands[name], [*path, name])
            return
        usage = " ".join(["difftest", *path] + [p.name.upper() for p in command.params
                                                if p.param_type_name == "argument"])
        lines.extend([f"## `{' '.join(path)}`", "", f"`{usage}`", "", _cell((command.help or "").split("\n\n")[0]), ""])
        options = [p for p in command.params if p.param_type_name == "option" and p.name != "help"]
        if options:
            lines.extend(["| option | default | what it does |", "|---|---|---|"])
            for option in options:
                default = "" if option.default is None or (option.is_flag and not option.default) else option.default
                lines.append(f"| `{', '.join(option.opts)}` | {_cell(default)} | {_cell(option.help or '')} |")
            lines.append("")

    walk(root, [])
    return "\n".join(lines)


def settings_page() -> str:
    load_plugins()
    default = {s.name for s in tier("default")}
    families: dict[str, list[Setting]] = defaultdict(list)
    for setting in all_settings():
        families[setting.family].append(setting)
    lines = ["# Setting families", "", "Generated from the registry (every built-in family loaded); "
             "`difftest settings list` shows the same with what runs on this machine.", "",
             "| family | settings | in the default tier | judged against | for example | what it runs |",
             "|---|---|---|---|---|---|"]
    for family, members in sorted(families.items()):
        references = sorted({s.reference for s in members} - {s.name for s in members})
        shown = ", ".join(f"`{r}`" for r in references[:3]) + (f" and {len(references) - 3} more" if len(references) > 3 else "")
        lines.append(f"| `{family}` | {len(members)} | {sum(s.name in default for s in members)} | "
                     f"{shown or 'its own root'} | `{members[0].name}` | "
                     f"{_first_paragraph(type(members[0]))} |")
    return "\n".join(lines) + "\n"


def kinds_page() -> str:
    load_plugins()
    lines = ["# Model kinds", "", "Generated from the registry; each kind makes its models from (seed, index).", "",
             "| kind | traits | what it generates |", "|---|---|---|"]
    for kind in sorted(generator_kinds()):
        generator = get_generator(kind)
        # a kind's module says what it generates (two kinds may share one)
        lines.append(f"| `{kind}` | {', '.join(sorted(generator.traits))} | "
                     f"{_first_paragraph(sys.modules[type(generator).__module__])} |")
    return "\n".join(lines) + "\n"


def manifest_page() -> str:
    from difftest.findings.known import MANIFEST, load

    header = [line[2:] if line.startswith("# ") else "" for line in MANIFEST.read_text().splitlines()
              if line.startswith("#")]
    lines = ["# The manifest of known bugs", "",
             "`difftest/findings/known_issues.toml`: one `[[issue]]` per root cause in a library. Triage marks a "
             "finding `known`, `related` or `unreported` by the entry that explains its cases (`new` where none "
             "does). Its fields, as the file's own header states them:", "", "```", *header, "```", "",
             "Its entries, generated from the file:", "",
             "| id | library | affects | upstream | references |", "|---|---|---|---|---|"]
    for issue in load():
        references = ", ".join(f"{r.tracker}#{r.number} ({r.state}, {r.relation})" for r in issue.references)
        lines.append(f"| `{issue.id}` | {issue.library} | `{issue.affects}` | {issue.upstream} | "
                     f"{_cell(references) or 'not filed'} |")
    return "\n".join(lines) + "\n"


def on_files(files: Files, config: Any) -> Files:
    for uri, page in (("reference/commands.md", commands_page), ("reference/settings.md", settings_page),
                      ("reference/kinds.md", kinds_page), ("reference/manifest.md", manifest_page)):
        files.append(File.generated(config, uri, content=page()))
    return files
