"""The quantization sweep: derived bounds hold against the libraries' own rounding, and the two oracles separate
planted faults and known findings from clean settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from difftest.findings import known
from difftest.judging.analysis import analyze
from difftest.runner.sweep import SweepOptions, list_models, run_sweep
from settings import _error_bounds as bounds
from settings.quant_torchrec import SHARDINGS
from tests.conftest import PLANTED


@pytest.mark.parametrize("bits,dtype", [(8, "qint8"), (4, "quint4x2"), (2, "quint2x4")])
def test_rowwise_bound_holds_for_torchrec_quantized_tables_and_is_tight(bits: int, dtype: str) -> None:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.quant.embedding_modules import quant_prep_enable_quant_state_dict_split_scale_bias_for_types

    rng = np.random.default_rng(bits)
    table = rng.uniform(-0.1, 0.1, size=(300, 16)).astype(np.float32)
    table[0] = 0.05  # a constant row
    table[1] *= 40  # a wide row
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", num_embeddings=300, embedding_dim=16, feature_names=["f"])])
    ebc.embedding_bags["t"].weight.data.copy_(torch.from_numpy(table))
    holder = torch.nn.ModuleDict({"ebc": ebc})  # quantization swaps children, never the root
    quant_prep_enable_quant_state_dict_split_scale_bias_for_types(holder, [EmbeddingBagCollection])
    state = {k.removeprefix("ebc."): v for k, v in quantize_embeddings(holder, dtype=getattr(torch, dtype), inplace=False).state_dict().items()}
    stored = state["embedding_bags.t.weight"]
    packed = getattr(stored, "elem", stored).numpy().astype(np.int64)  # int4/int2 come as a packed-uint8 subclass
    per_byte = 8 // bits
    codes = np.stack([(packed >> (bits * k)) & (2**bits - 1) for k in range(per_byte)], axis=-1).reshape(300, -1)[:, :16]
    dequantized = codes * state["embedding_bags.t.weight_qscale"].float().numpy() + state["embedding_bags.t.weight_qbias"].float().numpy()
    error = np.abs(dequantized - table)
    allowed = bounds.rowwise_nbit_rounding(table, bits)
    assert np.all(error <= allowed), f"worst ratio {np.max(error / allowed)}"
    assert np.max(error / allowed) > 0.5  # the bound is not vacuous


def test_the_swept_shardings_are_what_the_quantized_sharder_offers() -> None:
    from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

    assert set(SHARDINGS) == set(QuantEmbeddingBagCollectionSharder().sharding_types("cpu"))


def _means(run_dir: Path) -> dict[str, set[str]]:
    """Per model, the features pooled by MEAN."""
    return {
        spec.model_id: {f for t in spec.params["tables"] if t["pooling"] == "MEAN" for f in t["features"]}
        for _, spec in list_models(run_dir)
    }


def test_oracles_flag_planted_table_errors_and_row_wise_mean_but_not_clean_settings(fresh_run: Path) -> None:
    settings = ",".join([
        "reference", "faults/quant_table_*", "quant/torchrec/int8/out-fp32/*", "quant/torchrec/int4/out-fp16/unsharded",
        "quant/torchrec/int4/out-fp16/row_wise/sim-ws2", "quant/torchrec/fp16/out-fp32/unsharded",
        "quant/dynamic/*", "quant/bf16-autocast",
    ])
    run_sweep(fresh_run, SweepOptions(settings=settings, jobs=1, timeout_s=300, plugins=(PLANTED,)))
    analysis = analyze(fresh_run, plugins=(PLANTED,))
    verdict = {(c.model, c.setting): c.verdict for c in analysis.cases.itertuples()}
    models = sorted({m for m, _ in verdict})
    means = _means(fresh_run)

    for model in models:
        # oracle 1 catches a 2% scale or a one-step bias error in one table of one shard
        assert verdict[(model, "faults/quant_table_scale/int8/table_wise/sim-ws2")] == "inconsistent"
        assert verdict[(model, "faults/quant_table_bias/int8/table_wise/sim-ws2")] == "inconsistent"
        # oracle 2: clean quantized models stay within their derived bound
        for setting in ("quant/torchrec/int8/out-fp32/unsharded", "quant/torchrec/int4/out-fp16/unsharded",
                        "quant/torchrec/fp16/out-fp32/unsharded", "quant/dynamic/qint8/x86", "quant/dynamic/qint8/qnnpack",
                        "quant/dynamic/float16/fbgemm", "quant/bf16-autocast"):
            assert verdict[(model, setting)] == "ok", (model, setting)
        # oracle 1 on clean shardings: table- and column-wise on every simulated world, row-wise on one rank
        for world in (1, 2, 3, 4):
            assert verdict[(model, f"quant/torchrec/int8/out-fp32/table_wise/sim-ws{world}")] == "ok"
            assert verdict[(model, f"quant/torchrec/int8/out-fp32/column_wise/sim-ws{world}")] == "ok"
        assert verdict[(model, "quant/torchrec/int8/out-fp32/row_wise/sim-ws1")] == "ok"
        # the engines that cannot pack fp16 weights say so, as unsupported
        for engine in ("onednn", "qnnpack"):
            assert verdict[(model, f"quant/dynamic/float16/{engine}")] == "unsupported"

    # finding: row-wise sharded quantized MEAN bags are wrong on 2+ ranks; SUM bags are not
    rows = analysis.comparisons
    quantized_mean = known.reproduces_here("torchrec-quantized-rowwise-mean")
    row_wise = rows[(rows["setting"] == "quant/torchrec/int8/out-fp32/row_wise/sim-ws2") & rows["tensor"].str.startswith("pooled.")]
    assert len(row_wise) > 0
    is_mean = [row.tensor.removeprefix("pooled.") in means[row.model] for row in row_wise.itertuples()]
    assert (row_wise[[not m for m in is_mean]]["status"] == "ok").all()
    assert (row_wise[is_mean]["status"] == "inconsistent").any() == quantized_mean

    # oracle 2 reports the measured error beside its bound
    bounded = rows[(rows["setting"] == "quant/torchrec/int8/out-fp32/unsharded")]
    assert (bounded["oracle"] == "bound").all()
    assert pd.notna(bounded["bound"]).all() and (bounded["bound_ratio"] <= 1).all()
    assert (bounded["linf"] > 0).any()  # quantization did change something
