"""Pages and tables written for people (report.html, findings.md) render through Jinja2 templates in
`difftest/reporting/templates/`; HTML is autoescaped, so a message or a setting name can never break the page."""

from __future__ import annotations

from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

_ENV = Environment(loader=PackageLoader("difftest.reporting", "templates"), autoescape=select_autoescape(["html", "html.j2"]),
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def render(template: str, **context: Any) -> str:
    return _ENV.get_template(template).render(**context)
