"""What every CPU worker group's ranks import, imported once into the server they are forked from (`difftest.runner.pool`).

The worker, torch and the built-in plugins, and the libraries those plugins name in a module-level `RANK_IMPORTS`
(TorchRec: a second and more per rank). A rank forked from the server has run nothing, as a spawned one, but starts
in a tenth of a second instead of seconds. Nothing here may touch a GPU: a process forked from one that did cannot.
So the server sees none: where TorchRec and fbgemm are installed their imports and CPU paths ask CUDA for streams and
devices when a GPU is in reach (on a 16-core H200 machine every TorchRec pipeline, optimizer and resume case of a
CPU campaign then failed: "Cannot re-initialize CUDA in forked subprocess", "CUDA error: initialization error"). Its
ranks compute on the CPU alone (`pool.forks_from_import_server`) and see none either (`worker.main`).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: CUDA reads it once, at its first use


def _import_all() -> None:
    import torch
    import torch.distributed  # noqa: F401

    from difftest.contracts.registry import load_plugins
    from difftest.runner import worker  # noqa: F401

    for plugin in load_plugins():
        for name in getattr(sys.modules[plugin], "RANK_IMPORTS", ()):
            try:
                importlib.import_module(name)
            except Exception:  # a library that does not import: the rank that needs it says why
                pass


try:
    _import_all()
except Exception:  # the server must start: each rank imports what is missing, and reports what fails
    pass
# what every process forked from here inherits is never garbage: out of every collection in every rank
# (`difftest.runner.worker`) and resume phase (its collection before exit walked torch's objects: 0.2 CPU-s, 30 % of a
# four-rank phase on 2 cores), and untouched by the collector, so its pages stay shared with the server
gc.collect()
gc.freeze()
