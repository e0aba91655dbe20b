"""What building a minimisation round's models costs: one by one in this process, against side by side
(`difftest.generation.generate.ModelBuilders`: this process and one builder process per core more).

    python -m benchmarks.model_builds RUN_DIR [--per-model 10] [--batches 3]

The models are the one-step reductions each generator proposes for every model of RUN_DIR (a `difftest run` or
`difftest generate` folder), `--per-model` of each, built `--batches` times into fresh folders, as a minimisation's
rounds do; TensorFlow is imported first where a kind needs it, as `difftest run` has by then. The first side-by-side
batch starts as the builders do: this process builds alone until they have imported what the kinds need.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path


def main() -> None:
    from difftest.contracts.registry import get_generator, load_plugins, loaded_plugins
    from difftest.generation.generate import ModelBuilders, try_materialise
    from difftest.storage.run_folder import list_models

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--per-model", type=int, default=10)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    load_plugins()
    specs = []
    for _, spec in list_models(args.run_dir):
        for number, (_, params) in enumerate(get_generator(spec.kind).reductions(spec)[:args.per_model]):
            specs.append(dataclasses.replace(spec, params=params, variant=f"bench{number}"))
    with tempfile.TemporaryDirectory() as scratch:
        for spec in {s.kind: s for s in specs}.values():  # each kind's libraries imported here first
            try_materialise(spec, Path(scratch) / "warm" / spec.model_id, 24)
        print(f"{len(specs)} models\n| method | batch | wall s |\n|---|---|---|")
        for method in ("one by one", "side by side"):
            builders = ModelBuilders(loaded_plugins(), processes=0 if method == "one by one" else None)
            builders.warm_up([(s, 24) for s in specs])  # as a minimisation does with its findings' examples
            try:
                for batch in range(1, args.batches + 1):
                    folder = Path(scratch) / method.replace(" ", "-") / str(batch)
                    started = time.perf_counter()
                    builders.build([(s, folder / s.model_id, 24) for s in specs])
                    print(f"| {method} | {batch} | {time.perf_counter() - started:.2f} |", flush=True)
            finally:
                builders.close()


if __name__ == "__main__":
    main()
