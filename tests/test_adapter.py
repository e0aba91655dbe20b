"""A user's own model through `difftest.ModelAdapter`: the documentation's example, as written there, runs under DDP
and FSDP2 and agrees; the same model with BatchNorm (per-rank statistics under DDP, a mistake of the model's) is a
finding marked `your-model`; a broken adapter is one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = "ddp/default/ws2,fsdp2/per-layer/reshard/fp32/ws2,ac/single/non-reentrant/ws1"


def documented_example() -> str:
    return re.search(r"```python\n(.*?)```", (ROOT / "docs" / "your-model.md").read_text(), re.DOTALL).group(1)


def _run(folder: Path, module: str, source: str, settings: str = SETTINGS) -> tuple[subprocess.CompletedProcess, Path]:
    (folder / f"{module}.py").write_text(source)
    out = folder / "run"
    done = subprocess.run([sys.executable, "-m", "difftest.cli", "run", "--out", str(out), "--model", f"{module}:adapter",
                           "--settings", settings, "--minimise-budget", "0"], capture_output=True, text=True,
                          timeout=600, cwd=folder, env={**os.environ, "PYTHONPATH": str(folder)})
    return done, out


def documented_command() -> list[str]:
    """The page's command after the example, as written (`difftest run --model my_model:adapter --out …`)."""
    return re.search(r"```\n(difftest run --model [^\n]+)\n```", (ROOT / "docs" / "your-model.md").read_text()).group(1).split()


def test_the_documented_adapter_runs_under_every_setting_that_takes_it_and_agrees(tmp_path: Path) -> None:
    example = documented_example()
    assert len(example.strip().splitlines()) <= 20  # the promise: about twenty lines
    # saved in the current folder and run by the documented command as written: the venv's console script, whose
    # own path does not hold the current folder, and no PYTHONPATH
    (tmp_path / "my_model.py").write_text(example)
    command = documented_command()
    assert command[:3] == ["difftest", "run", "--model"] and command[3] == "my_model:adapter", command
    done = subprocess.run([str(Path(sys.executable).parent / "difftest"), *command[1:]], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    cases = pd.read_csv(tmp_path / command[command.index("--out") + 1] / "summary.csv", index_col=0)
    assert cases.loc["ddp/default/ws2", "ok"] == 2 and cases.loc["fsdp2/per-layer/no-reshard/fp32/ws2", "ok"] == 2
    assert cases.loc["ac/single/selective/ws1", "unsupported"] == 2  # no blocks given: refused with the reason
    # a model of Linear layers alone keeps no parameter once dynamically quantized: still called in float
    assert cases.loc["quant/dynamic/qint8/onednn", "ok"] == 2
    # every setting agrees but where the loss is taken on DTensors: there torch's mse_loss gradient is off, a
    # library bug the manifest knows (the built-in kinds, trained with cross_entropy, agree there)
    agreeing = cases["ok"] + cases["unsupported"] == cases["cases"]
    assert set(cases.index[~agreeing]) == {"dtensor/batch-sharded/sharded-loss/ws2"}, cases[~agreeing].to_string()
    findings = pd.read_csv(tmp_path / command[command.index("--out") + 1] / "findings.csv")
    assert list(findings["known_issue"]) == ["dtensor-loss-backward-local-numel"], findings.to_string()
    # its script builds the user's model from the user's own code, copied (the module imports difftest)
    _assert_script_reproduces(tmp_path / command[command.index("--out") + 1], findings.iloc[0]["id"], "def make_model")
    # from another folder, where my_model does not import, the finding's minimal case reruns: the model module is
    # looked for where the run's commands ran
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = subprocess.run([str(Path(sys.executable).parent / "difftest"), "repro",
                            str(tmp_path / command[command.index("--out") + 1]), findings.iloc[0]["id"]],
                           capture_output=True, text=True, timeout=300, cwd=elsewhere,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert again.returncode == 1 and "the finding reproduces" in again.stdout, (again.stdout + again.stderr)[-3000:]


def _assert_script_reproduces(out: Path, finding: str, copied: str) -> None:
    folder = out / "findings" / finding
    said = (folder / "standalone.txt").read_text()
    assert said.startswith("standalone.py reproduces (exit 1)"), said[:3000]
    script = (folder / "standalone.py").read_text()
    assert copied in script and "difftest import" not in script and "ModelAdapter" not in script


# two mistakes of a model's training setup, each planted in the documented example: the text it replaces, the text
# put there, then what the one finding's title and fix say
MISTAKES = {
    "batchnorm": ("torch.nn.Linear(8, 16), torch.nn.Tanh()",
                  "torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh()",
                  "share of the batch", "SyncBatchNorm.convert_sync_batchnorm(model)"),
    "summed-loss": ("torch.nn.functional.mse_loss)",
                    "lambda p, y: torch.nn.functional.mse_loss(p, y, reduction='sum'))",
                    "adds its samples' losses", 'reduction="mean"'),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_of_the_users_model_is_a_finding_marked_as_possibly_the_models(tmp_path: Path, mistake: str) -> None:
    was, planted, title, fix = MISTAKES[mistake]
    example = documented_example()
    assert example.count(was) == 1
    done, out = _run(tmp_path, "my_model_with_a_mistake", example.replace(was, planted))
    assert done.returncode == 0, done.stderr[-3000:]
    # one cause (DDP's and FSDP2's cases alike), the model's, with its fix
    findings = pd.read_csv(out / "findings.csv")
    assert len(findings) == 1 and findings.iloc[0]["upstream"] == "your-model", findings.to_string()
    assert title in findings.iloc[0]["title"] and findings.iloc[0]["settings"] == 2
    said = (out / "findings.md").read_text()
    assert "not a library's bug" in said and fix in said
    # the user's model, mistake and all (a lambda loss too), in a script that shows it without difftest
    _assert_script_reproduces(out, findings.iloc[0]["id"], planted)


# a model whose forward returns a dataclass, as many users' models do; its adapter takes the prediction from it
OUTPUT_OBJECT = """
import dataclasses

import torch

from difftest import ModelAdapter


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.body(x))


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Net()


def make_batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)


adapter = ModelAdapter("my-output", make_model, make_batch, torch.nn.functional.mse_loss,
                       prediction=lambda output: output.logits)
"""


def test_a_model_that_returns_an_object_trains_under_ddp_and_static_graph_is_the_known_ddp_bug(tmp_path: Path) -> None:
    """The adapter's `prediction` reads the tensor from the output outside DDP, as a training loop does: DDP agrees
    with one process, and DDP with static_graph=True, which finds no tensor in a dataclass to hook its first
    all-reduce on, trains each rank on its own gradients: the manifest's known torch bug, not the user's model."""
    done, out = _run(tmp_path, "my_output_model", OUTPUT_OBJECT, "ddp/default/ws2,ddp/static-graph/ws2")
    assert done.returncode == 0, done.stderr[-3000:]
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    assert cases.loc["ddp/default/ws2", "ok"] == cases.loc["ddp/default/ws2", "cases"] == 2, cases.to_string()
    assert cases.loc["ddp/static-graph/ws2", "inconsistent"] == 2, cases.to_string()
    findings = pd.read_csv(out / "findings.csv")
    assert list(findings["known_issue"]) == ["ddp-static-graph-output-object"], findings.to_string()
    assert list(findings["upstream"]) == ["known"] and "pytorch/pytorch#124666" in findings.iloc[0]["references"]


def test_a_loss_that_sums_is_told_from_one_that_averages() -> None:
    import torch

    from difftest.contracts.adapter import loss_sums_over_the_batch

    prediction, target = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 3)
    mse = torch.nn.functional.mse_loss
    assert loss_sums_over_the_batch(lambda p, y: mse(p, y, reduction="sum"), prediction, target)
    assert not loss_sums_over_the_batch(mse, prediction, target)
    # a bf16 model's prediction: told apart all the same (bf16's rounding is wider than the test's margin)
    assert loss_sums_over_the_batch(lambda p, y: mse(p, y, reduction="sum"), prediction.bfloat16(), target.bfloat16())
    labels = torch.tensor([0, 2, 1, 0])
    cross_entropy = torch.nn.functional.cross_entropy
    assert loss_sums_over_the_batch(lambda p, y: cross_entropy(p, y, reduction="sum"), prediction, labels)
    assert not loss_sums_over_the_batch(cross_entropy, prediction, labels)


def test_a_chain_of_units_runs_a_pipeline_only_where_it_composes_to_the_forward() -> None:
    """`ModelAdapter(chain=…)`: units for a forward that is more than its layers in order (here keyword inputs and a
    mask applied between them); a chain that does not compute the forward is refused with the difference."""
    import torch

    from difftest import ModelAdapter, Unsupported
    from difftest.contracts.adapter import AdapterGenerator

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(x)) * mask)

    class First(torch.nn.Module):
        def __init__(self, module: Masked, masked: bool) -> None:
            super().__init__()
            self.layer, self.masked = module.first, masked

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.layer(x)) * mask if self.masked else torch.tanh(self.layer(x))

    def make_model(seed: int) -> Masked:
        torch.manual_seed(seed)
        return Masked()

    def make_batch(seed: int, size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        mask = (torch.rand(size, 1, generator=generator) > 0.5).float()
        return {"x": torch.randn(size, 4, generator=generator), "mask": mask}, torch.randn(size, 1, generator=generator)

    def kind(masked: bool) -> AdapterGenerator:
        return AdapterGenerator(ModelAdapter("masked", make_model, make_batch, torch.nn.functional.mse_loss,
                                             chain=lambda module: [First(module, masked), module.second]))

    right = kind(True)
    spec = right.spec(0, 0)
    chain = right.chain(spec, right.init_state(spec), "cpu")
    assert [type(unit).__name__ for unit in chain.units] == ["FedUnit", "Linear"]
    assert set(chain.parameters_of(chain.units)) == {"first.weight", "first.bias", "second.weight", "second.bias"}
    wrong = kind(False)  # the mask forgotten: the units compute another function
    with pytest.raises(Unsupported, match="its chain of units does not compute the module's forward"):
        wrong.chain(spec, wrong.init_state(spec), "cpu")


@pytest.mark.parametrize(("source", "said"), [
    ("adapter = 3\n", "has no ModelAdapter named 'adapter'"),
    ("adapter = (\n", "broken_model.py, line 1: '(' was never closed; fix the module"),
    ("from difftest import ModelAdapter\nadapter = ModelAdapter('My Model', None, None, None)\n", "lower-case"),
    ("from difftest import ModelAdapter\nadapter = ModelAdapter('broken', lambda seed: 3, lambda seed, size: (1, 2), "
     "None)\n", "not a torch.nn.Module"),
    (OUTPUT_OBJECT.replace(",\n                       prediction=lambda output: output.logits", ""),
     "the module's forward returned a Output, not a tensor; give ModelAdapter(..., prediction="),
])
def test_a_broken_adapter_is_one_line(tmp_path: Path, source: str, said: str) -> None:
    done, _ = _run(tmp_path, "broken_model", source)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


LAYERED = '''
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from difftest import ModelAdapter


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down, self.head = (torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                                                   torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.head(self.down(self.act(self.up(x))))


def make_model(seed):
    torch.manual_seed(seed)
    return Mlp()


def make_batch(seed, size):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)


def plan(module, world_size):
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


adapter = ModelAdapter("my-layered", make_model, make_batch, torch.nn.functional.mse_loss,
                       layers=("up", "act", "down", "head"), tp_plan=plan)
'''


def test_an_adapter_with_a_layer_list_and_a_plan_runs_pipelines_and_its_own_tensor_parallel_plan(
        tmp_path: Path) -> None:
    """`layers` lets the pipeline schedules cut the model; `tp_plan` is what tensor parallelism runs (the plan it
    recorded names the user's modules); the variants the plan does not cover are refused with the reason."""
    done, out = _run(tmp_path, "my_layered", LAYERED, "pipeline/gpipe/ws2/stages2/mb2/balanced,"
                     "pipeline/1f1b/ws2/stages2/mb4/random,tp/colwise-rowwise/ws2,tp/sequence-parallel/ws2")
    assert done.returncode == 0, done.stderr[-3000:]
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    for setting in ("pipeline/gpipe/ws2/stages2/mb2/balanced", "pipeline/1f1b/ws2/stages2/mb4/random",
                    "tp/colwise-rowwise/ws2"):
        assert cases.loc[setting, "ok"] == 2, cases.to_string()
    assert cases.loc["tp/sequence-parallel/ws2", "unsupported"] == 2
    refused = pd.read_csv(out / "inconsistencies.csv")
    assert refused["message"].str.contains("gives a tensor-parallel plan, not a sequence").any()
    compared = pd.read_csv(out / "comparisons.csv")
    tp_notes = set(compared[compared["setting"] == "tp/colwise-rowwise/ws2"]["message"])
    assert tp_notes == {"plan: up: ColwiseParallel, down: RowwiseParallel(output R)"}, tp_notes  # the user's plan
    assert "no findings" in done.stdout


SEVERAL_INPUTS = '''
import torch

from difftest import ModelAdapter


class MaskedPool(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, ids, mask):
        return (self.embed(ids) * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.head = MaskedPool(), torch.nn.Linear(8, 1)

    def forward(self, ids, mask):
        return self.head(self.pool(ids, mask))


def make_model(seed):
    torch.manual_seed(seed)
    return Classifier()


def make_batch(seed, size):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (size, 6), generator=generator)
    mask = (torch.rand(size, 6, generator=generator) > 0.3).float()
    mask[:, 0] = 1.0
    return AS_GIVEN, torch.randn(size, 1, generator=generator)


adapter = ModelAdapter("masked", make_model, make_batch, torch.nn.functional.mse_loss, layers=("pool", "head"))
'''


@pytest.mark.parametrize(("given", "pipeline"), [("(ids, mask)", "ok"), ('{"ids": ids, "mask": mask}', "unsupported")])
def test_a_batch_of_several_inputs_is_split_by_every_setting(tmp_path: Path, given: str, pipeline: str) -> None:
    """Ids and a mask, as a tuple (positional arguments: a pipeline feeds them to its first layer) or a dict (keyword
    arguments: a pipeline stage cannot take them, and says so); every tensor split along the batch."""
    settings = "ddp/default/ws2,fsdp2/per-layer/reshard/fp32/ws2,accumulate/mb2,pipeline/gpipe/ws2/stages2/mb2/balanced"
    done, out = _run(tmp_path, "masked_model", SEVERAL_INPUTS.replace("AS_GIVEN", given), settings)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = pd.read_csv(out / "summary.csv", index_col=0)
    for setting in ("ddp/default/ws2", "fsdp2/per-layer/reshard/fp32/ws2", "accumulate/mb2"):
        assert cases.loc[setting, "ok"] == 2, cases.to_string()
    assert cases.loc["pipeline/gpipe/ws2/stages2/mb2/balanced", pipeline] == 2, cases.to_string()
    if pipeline == "unsupported":
        refused = pd.read_csv(out / "inconsistencies.csv")
        assert refused["message"].str.contains("takes keyword inputs").any()
    assert "no findings" in done.stdout


# a user's model file as users write them: imports, a constant, a helper, a class, the factory, the adapter itself
USER_MODULE = '''
"""A user's model file."""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from difftest import ModelAdapter

WIDTH = 16  # the hidden width
SCALE, UNUSED = 2.0, 3.0


def _scaled(x):
    return x / math.sqrt(WIDTH) * SCALE


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.second(_scaled(torch.tanh(self.first(x))))


def make_model(seed):
    torch.manual_seed(seed)
    return Net()


def make_batch(seed, size):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)


def reads_the_adapter(seed):
    return adapter.model(seed)


def nested():
    def inner(seed):
        return Net()
    return inner


adapter = ModelAdapter("net", make_model, make_batch, torch.nn.functional.mse_loss,
                       prediction=lambda output: output * WIDTH / WIDTH)
partial_model = functools.partial(make_model)

if __name__ == "__main__":
    print(adapter)
'''


def test_a_users_callables_are_copied_with_what_they_read_and_run_without_difftest(tmp_path: Path) -> None:
    """A standalone script of a user's model copies the factory, the lambda and what they read from the user's module
    (never the adapter, nor what uses difftest), imports a library's loss, and refuses what it cannot copy with why."""
    import importlib.util

    import torch

    from difftest import Unsupported
    from difftest.contracts.user_code import user_code

    (tmp_path / "users_net.py").write_text(USER_MODULE)
    spec = importlib.util.spec_from_file_location("users_net", tmp_path / "users_net.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["users_net"] = module
    try:
        spec.loader.exec_module(module)
        adapter = module.adapter
        code = user_code("net", {"model": adapter.model, "loss": adapter.loss, "prediction": adapter.prediction})
        assert [d.__name__ for d in code.definitions] == ["WIDTH", "SCALE", "_scaled", "Net", "make_model"]
        assert code.imports == ["import math", "from torch import nn"]  # `import torch`: every script has it
        assert code.named == {"model": "make_model", "loss": "torch.nn.functional.mse_loss",
                              "prediction": "(lambda output: output * WIDTH / WIDTH)"}
        assert "# the hidden width" in code.definitions[0].text
        # what the script runs: the copied code alone builds the same module and computes the same prediction
        namespace: dict = {"torch": torch}
        exec("\n".join([*code.imports, *(d.text for d in code.definitions), code.binding().text]), namespace)
        copied, original = namespace["ADAPTER"]["model"](0), module.make_model(0)
        x = torch.randn(3, 8)
        assert torch.equal(namespace["ADAPTER"]["prediction"](copied(x)), adapter.prediction(original(x)))
        for value, why in [(module.reads_the_adapter, "uses difftest"), (module.nested(), "defined inside another"),
                           (module.partial_model, "partial")]:
            with pytest.raises(Unsupported, match=why):
                user_code("net", {"model": value, "loss": adapter.loss})
    finally:
        del sys.modules["users_net"]


# what a script cannot copy as the module has it: each a factory reading one such name, and the reason it is refused
UNCOPYABLE = {
    "try:\n    from apex.normalization import FusedLayerNorm as Norm\nexcept ImportError:\n    Norm = None\n":
        ("Norm", "top-level try statement"),
    "TABLE = {'a': 1}\nTABLE['b'] = 2\n": ("TABLE", "changed by a top-level statement"),
    "from math import *\n": ("sqrt", "a star import"),
    "def load_data():\n    return 1\n": ("load_data", "every standalone script has"),
    "from typing import Any as np\n": ("np", "every standalone script has"),
    "import users_layers\n": ("users_layers", "imported whole"),
    "from users_layers import Block as Piece\n": ("Piece", "imported under another name"),
}


@pytest.mark.parametrize("defined", UNCOPYABLE)
def test_what_a_script_cannot_copy_is_refused_with_the_reason(tmp_path: Path, defined: str) -> None:
    import importlib.util

    from difftest import Unsupported
    from difftest.contracts.user_code import user_code

    name, why = UNCOPYABLE[defined]
    (tmp_path / "users_layers.py").write_text("Block = 1\n")
    (tmp_path / "users_model.py").write_text(f"{defined}\n\ndef make_model(seed):\n    return {name}\n")
    sys.path.insert(0, str(tmp_path))
    spec = importlib.util.spec_from_file_location("users_model", tmp_path / "users_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["users_model"] = module
    try:
        spec.loader.exec_module(module)
        with pytest.raises(Unsupported, match=why):
            user_code("net", {"model": module.make_model})
    finally:
        del sys.modules["users_model"]
        sys.modules.pop("users_layers", None)
        sys.path.remove(str(tmp_path))


def test_a_statement_binding_several_names_is_copied_for_any_of_them() -> None:
    from difftest.scripts.emit import _called_from

    sources = {"main": "def main():\n    return DEPTH\n", "HIDDEN": "HIDDEN, DEPTH = 64, 4\n"}
    assert _called_from("main", sources)[0] == {"main"}  # by its first name alone, it would be left out
    assert _called_from("main", sources, {"DEPTH": "HIDDEN"})[0] == {"main", "HIDDEN"}


# a user's model spread over a package, as teams keep theirs: the layers in one module (with the planted mistake, a
# BatchNorm trained on each rank's share), the model and its adapter in another that imports them relatively
PACKAGE = {
    "__init__.py": "",
    "layers.py": """import torch
from torch import nn

HIDDEN = 16  # the block's width


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
""",
    "model.py": """import torch

from difftest import ModelAdapter

from .layers import HIDDEN, Block


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(Block(), torch.nn.Linear(HIDDEN, 1))


def make_batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)


adapter = ModelAdapter("shop-mlp", make_model, make_batch, torch.nn.functional.mse_loss)
""",
}


def test_a_model_spread_over_the_users_package_is_copied_from_each_module_into_its_script(tmp_path: Path) -> None:
    """What the model imports from the user's other modules (relatively too) is copied from there, before what reads
    it, and the finding's script shows the planted mistake without difftest and without the package."""
    (tmp_path / "shop").mkdir()
    for name, text in PACKAGE.items():
        (tmp_path / "shop" / name).write_text(text)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "difftest.cli", "run", "--out", str(out), "--model",
                           "shop.model:adapter", "--settings", "ddp/default/ws2", "--minimise-budget", "0"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    findings = pd.read_csv(out / "findings.csv")
    assert len(findings) == 1 and findings.iloc[0]["upstream"] == "your-model", findings.to_string()
    _assert_script_reproduces(out, findings.iloc[0]["id"], "class Block(nn.Module):")
    script = (out / "findings" / findings.iloc[0]["id"] / "standalone.py").read_text()
    assert "HIDDEN = 16  # the block's width" in script and "import shop" not in script and "from ." not in script
    assert script.index("class Block") < script.index("def make_model")
