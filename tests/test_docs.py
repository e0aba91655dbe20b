"""The README and the documentation site: two set-up commands first, no figure left unmeasured, every link whole."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_opens_with_its_two_commands_and_is_short() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("```", 2)[1].strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]  # CI runs the README's test command, as written
    assert block == ["./install.sh && .venv/bin/difftest run", ci] and ci.startswith(".venv/bin/python -m pytest")
    assert text.count("\n") <= 120 and max(len(line) for line in text.splitlines()) <= 120
    assert not re.search(r"__[A-Z_]+__", text), "a figure was left to fill in"


def test_the_documentation_site_builds_with_every_link_whole(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    nav = set(re.findall(r":\s*([\w-]+\.md)", (ROOT / "mkdocs.yml").read_text()))
    assert nav == pages  # every page is in the site's navigation, and every entry is a page
    for link in re.findall(r"\]\((docs/[\w-]+\.md)\)", (ROOT / "README.md").read_text()):
        assert (ROOT / link).is_file(), link
    # the reference pages are the code's own account: every command, setting family and model kind registered
    import typer

    from difftest.cli import app
    from difftest.contracts.registry import all_settings, generator_kinds, get_generator, load_plugins

    load_plugins()
    site = tmp_path / "site" / "reference"
    commands, families, kinds, manifest = ((site / page / "index.html").read_text()
                                           for page in ("commands", "settings", "kinds", "manifest"))
    names = [name for name, command in typer.main.get_command(app).commands.items() if not command.hidden]
    assert len(names) >= 10 and all(f"<code>{name}" in commands for name in names)
    # the built-in ones (the site is built with them alone; other tests of this session register plugins of their own)
    builtin = [s for s in all_settings() if type(s).__module__.startswith("settings.")]
    assert len(builtin) > 100 and all(f"<code>{s.family}</code>" in families for s in builtin)
    kinds_builtin = [k for k in generator_kinds() if type(get_generator(k)).__module__.startswith("generators.")]
    assert len(kinds_builtin) >= 7 and all(f"<code>{kind}</code>" in kinds for kind in kinds_builtin)
    from difftest.findings.known import load

    assert all(f"<code>{issue.id}</code>" in manifest for issue in load())
