"""The end-to-end tier's set-up: the oldest release's environment is made while the tests before it run."""

from __future__ import annotations

import threading

import pytest


def _make_the_oldest_environment() -> None:
    from difftest.releases.environments import environment, supported

    try:
        environment(supported()[0])
    except Exception:  # the test makes it again and fails with the reason
        pass


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the oldest release's test is selected, its environment (made once and cached: on a fresh machine
    minutes of downloading and unpacking, which leave the cores idle) is made in the background from the start of the
    session, beside the CPU-bound tests before it; the test waits for it (`environment` holds a file lock while it
    makes one)."""
    if not session.config.option.collectonly and any(item.get_closest_marker("oldest") for item in session.items):
        threading.Thread(target=_make_the_oldest_environment, name="oldest-environment", daemon=True).start()
