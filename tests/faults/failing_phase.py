"""An entry for `difftest.run_in_processes`: rank 1 fails at once while rank 0 waits for it, as a rank waits in a
rendezvous or a collective for a peer that died."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

WAIT_S = 300


def main(request: Mapping[str, Any], rank: int) -> None:
    if rank == 1:
        raise RuntimeError("planted: rank 1 fails at once")
    time.sleep(WAIT_S)
