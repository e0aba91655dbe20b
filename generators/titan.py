"""torchtitan's models as kinds (the `[titan]` extra): `titan-llama3` and `titan-qwen3` (its embedding tied to the
output projection), built through torchtitan's own config classes at a debug size smaller than their `debugmodel`
flavours (2 layers, width 32, 4 heads of which 2 key/value, vocabulary 64), their weights from the seed by the
model's own `init_weights`, nothing downloaded.

The `titan` setting family runs the model's own `parallelize` recipe (FSDP2, TP, activation checkpointing, compile
as torchtitan applies them); the generic families run it as any PyTorch model. Attention is torchtitan's
`ScaledDotProductAttention` module, causal: its language models default to FlexAttention, which has no backward on
the CPU, and with one document a sequence the block-causal mask FlexAttention would apply is the causal one.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from difftest import AdapterGenerator, ModelAdapter, register_generator

EXTRA = "install torchtitan: pip install 'difftest[titan]'"
VOCABULARY, POSITIONS = 64, 8
WIDTH, HEADS, KV_HEADS, LAYERS = 32, 4, 2, 2


def llama3_config() -> Any:
    """The Llama 3 model's config at the debug size above, as torchtitan's flavours write theirs."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    config = Llama3Model.Config(
        dim=WIDTH, vocab_size=VOCABULARY,
        tok_embeddings=Embedding.Config(num_embeddings=VOCABULARY, embedding_dim=WIDTH, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=WIDTH, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=WIDTH, out_features=VOCABULARY, param_init=_output_linear_init(WIDTH)),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=WIDTH, n_heads=HEADS, n_kv_heads=KV_HEADS, fuse_qkv=True, attn_backend="flex",
            hidden_dim=compute_ffn_hidden_dim(WIDTH, multiple_of=32),
            rope=ComplexRoPE.Config(dim=WIDTH // HEADS, max_seq_len=8 * POSITIONS, theta=500000, scaling="llama")))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def qwen3_config() -> Any:
    """The Qwen 3 model's config at the same size, as its `debugmodel` flavour writes it: its embedding tied to the
    output projection, normalised queries and keys, cosine/sine rotary embedding."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _qwen3_norm,
    )

    head = WIDTH // HEADS
    config = Qwen3Model.Config(
        vocab_size=VOCABULARY, dim=WIDTH, norm=_qwen3_norm(WIDTH), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCABULARY, embedding_dim=WIDTH,
                                        param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=WIDTH, out_features=VOCABULARY, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(n_layers=LAYERS, dim=WIDTH, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head,
                                   hidden_dim=2 * WIDTH, fuse_qkv=True, attn_backend="flex",
                                   rope=CosSinRoPE.Config(dim=head, max_seq_len=8 * POSITIONS, theta=1000000.0)))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


CONFIGS = {"llama3": llama3_config, "qwen3": qwen3_config}


def _build_module(params: dict[str, Any], device: str, seed: int | None = None) -> Any:
    """The torchtitan model of `params["name"]` from its config, initialised by its own `init_weights` (the weights
    drawn from `seed`, set once the model is built; the kind's) or for its buffers alone (the rotary cache: a
    standalone script's, which then loads the case's weights)."""
    import torch

    model = (llama3_config() if params["name"] == "llama3" else qwen3_config()).build()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.to(device)


def _model(name: str, seed: int) -> Any:
    return _build_module({"name": name}, "cpu", seed)


def _token_batch(seed: int, size: int) -> tuple[Any, Any]:
    """Token ids and the next token of each (the last position predicts the first: every position has a target)."""
    import torch

    ids = torch.randint(0, VOCABULARY, (size, POSITIONS), generator=torch.Generator().manual_seed(seed))
    return ids, torch.roll(ids, -1, dims=1)


def prediction_loss(prediction: Any, target: Any) -> Any:
    """The mean cross-entropy over every position (torchtitan's: the sum over tokens over the global token count)."""
    import torch

    # in fp32 at least, as torchtitan's loss computes; float64 stays float64 (the calibration's centre)
    logits = prediction.reshape(-1, prediction.shape[-1])
    return torch.nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                             target.reshape(-1))


class TitanKind(AdapterGenerator):
    """A torchtitan model as a kind: the library's findings (no "user" trait), its own recipes (trait "titan")."""

    traits = frozenset({"torch", "zoo", "titan"})

    def available(self) -> str | None:
        return None if importlib.util.find_spec("torchtitan") else f"needs torchtitan ({EXTRA})"

    def standalone_model(self, spec: Any, init_state: dict[str, Any], model_dir: Any, train: Any) -> Any:
        """The model as torchtitan builds it from its own config, the case's weights loaded into it."""
        from difftest import ModelCode
        from generators.dlrm import build_model, model_parameters, with_state  # they call this kind's by their names
        from generators.zoo import _batch_inputs, _unwrap, model_loss

        name = self.kind.split("-", 1)[1]
        return ModelCode(
            summary=f"The model is torchtitan's {name} built from its own config classes ({LAYERS} layers, width "
                    f"{WIDTH}, {HEADS} heads of which {KV_HEADS} key/value, vocabulary {VOCABULARY}, {POSITIONS} "
                    "positions), its weights the case's; mean next-token cross-entropy.",
            libraries=("torchtitan",),
            preamble=(f"VOCABULARY, POSITIONS = {VOCABULARY}, {POSITIONS}",
                      f"WIDTH, HEADS, KV_HEADS, LAYERS = {WIDTH}, {HEADS}, {KV_HEADS}, {LAYERS}"),
            functions=(llama3_config, qwen3_config, _build_module, _unwrap, with_state, build_model, _batch_inputs,
                       prediction_loss, model_loss, model_parameters),
            case={"model": {"name": name}, "frozen": list(spec.frozen)},
            data={**{f"state.{k}": v for k, v in init_state.items()}, **train.to_arrays("train")},
            parameters=tuple(self.parameters(self.build(spec, init_state, "cpu"))))


def _register() -> None:
    from functools import partial

    for name in CONFIGS:
        adapter = ModelAdapter(f"titan-{name}", partial(_model, name), _token_batch, prediction_loss,
                               blocks=tuple(f"layers.{i}" for i in range(LAYERS)))
        register_generator(adapter.name, TitanKind(adapter))


_register()
