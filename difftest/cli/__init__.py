"""The `difftest` command: every subcommand is declared in `difftest.cli.main`."""

from difftest.cli.main import app, main

__all__ = ["app", "main"]
