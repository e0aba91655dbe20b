"""`python -m difftest.cli …`: what the `difftest` command runs (the ranks and tests start it this way)."""

from difftest.cli.main import main

main()
