"""The contract every registered model kind keeps, built in or a plugin's (the example plugin `tiny-mlp` and the
planted faults' kinds included): specs reproducible from (seed, index) and different across indices, and every
reduction the minimiser is offered a change (never the same model) that grows nothing the kind's size measures (a
smaller input, a shorter bag, leaves the model's size as it is)."""

from __future__ import annotations

import dataclasses

import pytest

from difftest.cli.main import BUILTIN_KINDS
from difftest.contracts.registry import generator_kinds, get_generator, load_plugins
from generators.titan import CONFIGS as TITAN
from generators.zoo import HUGGING_FACE, TIMM
from tests.conftest import PLANTED

# the kinds as parameters, without loading a plugin at collection: a plugin's settings registered while pytest collects
# would join every tier of a session that runs none of these tests (the end-to-end one)
PLUGINS = (PLANTED, "tests.plugins.tiny")
ZOO = (*(f"hf-{name}" for name in HUGGING_FACE), *(f"timm-{name}" for name in TIMM),
       *(f"titan-{name}" for name in TITAN))
KINDS = (*BUILTIN_KINDS, *ZOO, "tiny-mlp")


def test_the_contract_covers_every_registered_kind() -> None:
    load_plugins(PLUGINS)
    assert set(generator_kinds()) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_kind_is_reproducible_and_its_reductions_never_grow_it(kind: str) -> None:
    load_plugins(PLUGINS)
    generator = get_generator(kind)
    specs = [generator.spec(5, index) for index in range(4)]
    assert [s.to_json() for s in specs] == [generator.spec(5, index).to_json() for index in range(4)]
    assert len({s.to_json() for s in specs}) == len(specs)  # each index its own model
    for spec in specs:
        size = tuple(generator.size(spec).values())
        for what, params in generator.reductions(spec):
            assert params != spec.params, (kind, spec.index, what)
            smaller = tuple(generator.size(dataclasses.replace(spec, params=params)).values())
            assert all(s <= b for s, b in zip(smaller, size)) and len(smaller) == len(size), (kind, what, smaller, size)
