"""A plugin whose import fails inside a rank with a ConnectionError of its own (a feature store it cannot reach), the
kind of error a rank once took for its parent's pipe closing: it exited 0, and its log said nothing of why."""

from __future__ import annotations

import os

if "LOCAL_RANK" in os.environ:  # set by a rank before it loads plugins; the sweep's own process imports this quietly
    raise ConnectionRefusedError("the feature store at 127.0.0.1:9 refused the connection")
