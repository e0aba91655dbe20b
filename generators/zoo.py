"""Model zoos as kinds (the `[zoo]` extra): what users train, with the parallel plans their libraries ship.

`hf-<architecture>`: Hugging Face `transformers` models built from their config classes at small sizes — Llama,
Qwen2, Qwen3 and Mixtral (a mixture of experts) as causal language models, GPT-2, BERT as a sequence classifier — their
weights drawn from the seed (nothing is downloaded). Their batch is what the library takes, `input_ids` and an
`attention_mask` with right padding, by keyword. The tensor-parallel settings (and FSDP2 × TP) run the model's own
plan as the library applies it: `transformers.distributed.tensor_parallel.apply_tensor_parallelism` with the plan the
model resolves for the world size (`_resolve_parallel_plans`, what `from_pretrained(tp_plan=…)` runs); an
architecture that ships no plan is refused with that reason. FSDP2's units and activation checkpointing take the
decoder or encoder layers. The decoder-only architectures (Llama, Qwen2, Qwen3, Mixtral) are a chain of pipeline units
— the embedding, each decoder layer (its causal mask and rotary embeddings made as the model's forward makes them),
the norm and output projection — checked to compose to the model's forward before a pipeline cuts them into stages;
the `hf` family (`settings/hf_distributed.py`) runs transformers' own `DistributedConfig`.

`timm-<model>`: small `timm` vision models (a ResNet with BatchNorm, a ViT, a ConvNeXt) from
`timm.create_model(…, pretrained=False)`, classifying 32×32 images; FSDP2 and checkpointing take their blocks. The
ResNet's BatchNorm normalises by the batch's statistics, so wherever a setting splits the batch (ranks, micro-batches)
it computes something else by design: triage names that cause (`difftest/findings/model_semantics.toml`), and
`ddp/sync-batchnorm` runs the fix torch documents.

A zoo's findings are the library's (triaged against the manifest like any built-in kind's), not the user's.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from difftest import AdapterGenerator, ModelAdapter, Unsupported, register_generator

EXTRA = "install the zoo: pip install 'difftest[zoo]'"
VOCABULARY, POSITIONS, CLASSES = 64, 8, 5

# architecture → (config class, model class, config fields, the blocks' module path). Dropout is off: each process
# would draw its own masks, a difference of the setup, not of the library (GPT-2's and BERT's defaults are 0.1)
# use_cache off, as for training: a decoder's key/value cache grows at every forward, so a checkpointed layer's
# recomputation would attend over the keys twice (HF's own gradient checkpointing turns it off for that reason)
_SMALL = dict(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4 * POSITIONS, use_cache=False)
HUGGING_FACE: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _SMALL, "model.layers"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _SMALL, "model.layers"),
    # Qwen 3 normalises each head's queries and keys (its plan replicates those norms, their gradients all-reduced)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_SMALL, "head_dim": 4}, "model.layers"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
                "model.layers"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCABULARY, n_embd=32, n_layer=2, n_head=8,
                                                   n_positions=4 * POSITIONS, bos_token_id=0, eos_token_id=0,
                                                   use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0),
             "transformer.h"),
    "bert": ("BertConfig", "BertForSequenceClassification", dict(vocab_size=VOCABULARY, hidden_size=32,
                                                                 num_hidden_layers=2, num_attention_heads=8,
                                                                 intermediate_size=64, num_labels=CLASSES,
                                                                 max_position_embeddings=4 * POSITIONS,
                                                                 hidden_dropout_prob=0.0,
                                                                 attention_probs_dropout_prob=0.0),
             "bert.encoder.layer"),
}
# timm model → its options and its blocks' module names
TIMM: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "resnet": ("resnet10t", dict(channels=(8, 16, 24, 32), stem_width=8, zero_init_last=False),
               ("layer1", "layer2", "layer3", "layer4")),
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4),
            ("blocks.0", "blocks.1")),
    "convnext": ("convnext_atto", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64)), ("stages.0", "stages.1")),
}
LAYERS = 2


def _missing(library: str) -> str | None:
    return None if importlib.util.find_spec(library) else f"needs {library} ({EXTRA})"


@functools.cache  # one class per process, made at the first zoo model (not a new class per build)
def _module_class() -> Any:
    import torch  # here, not at import: the plugin loads in every rank, a zoo kind only where it runs

    class LibraryModel(torch.nn.Module):
        """The library's model, called as the library documents it, its output's tensor handed back."""

        def __init__(self, model: Any, output: str) -> None:
            super().__init__()
            self.lm, self.output = model, output

        def forward(self, **inputs: Any) -> Any:
            if next(self.parameters()).dtype == torch.float64 and self.lm._can_set_experts_implementation():
                # the calibration's float64 centre: torch's grouped_mm, the experts' default kernel, has no float64
                # form; the eager loop computes the same experts (every other run keeps the default)
                self.lm.set_experts_implementation("eager")
            return getattr(self.lm(**inputs), self.output) if self.output else self.lm(**inputs)

    return LibraryModel


def _hugging_face_params(architecture: str) -> dict[str, Any]:
    config_class, model_class, fields, _ = HUGGING_FACE[architecture]
    return {"library": "transformers", "config": config_class, "model": model_class, "fields": dict(fields)}


def _timm_params(name: str) -> dict[str, Any]:
    model, options, _ = TIMM[name]
    return {"library": "timm", "model": model, "options": dict(options), "classes": CLASSES}


def _build_module(params: dict[str, Any], device: str) -> Any:
    """The zoo's model as its library builds it from `params` (`_hugging_face_params`, `_timm_params`): the kind's
    and its standalone script's (which then loads the case's weights), on `device`."""
    if params["library"] == "transformers":
        import transformers

        config = getattr(transformers, params["config"])(**params["fields"])
        return _module_class()(getattr(transformers, params["model"])(config), "logits").to(device)
    import timm

    return timm.create_model(params["model"], pretrained=False, num_classes=params["classes"],
                             **params["options"]).to(device)


def _hugging_face_model(architecture: str, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return _build_module(_hugging_face_params(architecture), "cpu")


def _token_batch(architecture: str, seed: int, size: int) -> tuple[dict[str, Any], Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCABULARY, (size, POSITIONS), generator=generator)
    lengths = torch.randint(POSITIONS // 2, POSITIONS + 1, (size,), generator=generator)
    mask = (torch.arange(POSITIONS)[None, :] < lengths[:, None]).long()  # right padding, as a tokenizer pads
    if architecture == "bert":
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, CLASSES, (size,), generator=generator)
    return {"input_ids": ids, "attention_mask": mask}, torch.roll(ids, -1, dims=1)


def prediction_loss(prediction: Any, target: Any) -> Any:
    """The mean cross-entropy over every position's (or sample's) classes."""
    import torch

    return torch.nn.functional.cross_entropy(prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1))


def _library_plan(module: Any, world_size: int) -> dict[str, Any]:
    """The model's own tensor-parallel plan, applied by the library: one ParallelStyle at the wrapped model whose
    `_apply` is transformers' own."""
    from torch.distributed.tensor.parallel import ParallelStyle
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if not module.lm._tp_plan:
        raise Unsupported(f"{type(module.lm).__name__} ships no tensor-parallel plan in this transformers release")

    class TransformersTensorParallel(ParallelStyle):
        def _apply(self, model: Any, device_mesh: Any) -> Any:
            plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=device_mesh.size()))
            return apply_tensor_parallelism(model, device_mesh, plan)

    return {"lm": TransformersTensorParallel()}


def _decoder_chain(module: Any) -> list[Any]:
    """A causal language model's forward as pipeline units, its decoder layers each one unit: the token embedding;
    each decoder layer given what the model's forward gives it (its causal mask — sliding where the config says —
    the rotary position embeddings, the positions), built from the padding mask the units hand on; the final norm
    and the output projection. `ModelAdapter(chain=…)` checks that they compose to the model's forward."""
    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    lm = module.lm
    config = lm.config

    class Embedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = lm.model.embed_tokens

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, Any]:
            return self.embed_tokens(input_ids), attention_mask

    class Decoder(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.layer, self.rotary_emb = lm.model.layers[index], lm.model.rotary_emb
            kind = config.layer_types[index] if getattr(config, "layer_types", None) else (
                "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention")
            self.mask = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask

        def forward(self, hidden: Any, attention_mask: Any) -> tuple[Any, Any]:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            mask = self.mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                             position_ids=positions)
            hidden = self.layer(hidden, attention_mask=mask, position_embeddings=self.rotary_emb(hidden, positions),
                                position_ids=positions)
            return hidden, attention_mask

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lm_head = lm.model.norm, lm.lm_head

        def forward(self, hidden: Any, attention_mask: Any) -> Any:
            return self.lm_head(self.norm(hidden))

    return [Embedding(), *(Decoder(i) for i in range(config.num_hidden_layers)), Head()]


def _image_model(name: str, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return _build_module(_timm_params(name), "cpu")


def _image_batch(seed: int, size: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)


# --- the model in a standalone script (difftest.scripts.emit): its data holds the weights and the training batch -------
def _unwrap(module: Any) -> Any:
    """The zoo's model inside DDP or legacy FSDP (FSDP2 and tensor parallelism leave it in place)."""
    while type(module).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
        module = module.module
    return module


def _batch_inputs(data: dict[str, Any], split: str, start: int, stop: int, dtype: Any) -> Any:
    """Samples start..stop of the script's batch `split` as the model takes them: its keyword tensors (token ids and
    masks), or its one input (images in `dtype`, token ids as they are)."""
    import torch

    prefix = f"{split}.named."
    named = {k[len(prefix):]: torch.from_numpy(v[start:stop]) for k, v in data.items() if k.startswith(prefix)}
    dense = None if named else torch.from_numpy(data[f"{split}.dense"][start:stop])
    return named or (dense.to(dtype) if dense.is_floating_point() else dense)


def model_loss(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> Any:
    """The loss on training samples start..stop of the script's data, as the kind's forward and loss compute it."""
    import torch

    inputs = _batch_inputs(data, "train", start, stop, dtype)
    labels = torch.from_numpy(data["train.labels"][start:stop])
    return prediction_loss(module(**inputs) if isinstance(inputs, dict) else module(inputs), labels)


def model_tp_plan(module: Any, world_size: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """The model's own tensor-parallel plan, applied by its library (`_library_plan`); it has no sequence- or
    loss-parallel form (the settings that need one refuse the kind)."""
    return _library_plan(_unwrap(module), world_size)


def model_chain(module: Any, data: dict[str, Any], fed: dict[str, str], dtype: Any) -> list[Any]:
    """The decoder as the chain of units a pipeline splits into stages (`_decoder_chain`), its first unit reading the
    inputs of the script's batch `fed["split"]` at the positions it is given."""
    import torch

    units = _decoder_chain(_unwrap(module))

    class Fed(torch.nn.Module):
        def __init__(self, unit: Any) -> None:
            super().__init__()
            self.unit = unit

        def forward(self, positions: Any) -> Any:
            start = int(positions[0])
            return self.unit(**_batch_inputs(data, fed["split"], start, start + len(positions), dtype))

    return [Fed(units[0]), *units[1:]]


class ZooKind(AdapterGenerator):
    """A zoo model as a kind: the adapter's protocol, the library's findings (no "user" trait); its library is a
    trait too, for the families that run that library's own parallelism (`settings/hf_distributed.py`)."""

    traits = frozenset({"torch", "zoo"})

    def __init__(self, adapter: ModelAdapter, library: str) -> None:
        super().__init__(adapter)
        self.library = library
        self.traits = self.traits | {library}

    def available(self) -> str | None:
        return _missing(self.library)

    def standalone_model(self, spec: Any, init_state: dict[str, Any], model_dir: Any, train: Any) -> Any:
        """The model as its library builds it from its config (`_build_module`), the case's weights loaded into it."""
        from difftest import ModelCode
        from generators.dlrm import build_model, model_parameters, with_state  # they call this kind's by their names

        name = self.kind.split("-", 1)[1]
        hugging_face = self.library == "transformers"
        params = _hugging_face_params(name) if hugging_face else _timm_params(name)
        if hugging_face:
            built = f"transformers' {params['model']} from a {params['config']} ({params['fields']})"
            task = "next-token" if params["model"].endswith("CausalLM") else f"{CLASSES}-class"
        else:
            built = f"timm's {params['model']} (create_model with {params['options']}) on 32×32 images"
            task = f"{CLASSES}-class"
        own = (_module_class, _build_module, _unwrap, with_state, build_model, _batch_inputs, prediction_loss,
               model_loss, model_parameters)
        return ModelCode(
            summary=f"The model is {built}, its weights the case's; mean {task} cross-entropy.",
            libraries=(self.library,), preamble=("import functools",),  # `_module_class` caches with it
            functions=(*own, *((_library_plan, model_tp_plan) if self.adapter.tp_plan is not None else ())),
            chain=(_decoder_chain, model_chain) if self.adapter.chain is not None else (),
            case={"model": params, "frozen": list(spec.frozen)},
            data={**{f"state.{k}": v for k, v in init_state.items()}, **train.to_arrays("train")},
            parameters=tuple(self.parameters(self.build(spec, init_state, "cpu"))))


def _register() -> None:
    from functools import partial

    for architecture, (_, _, _, blocks) in HUGGING_FACE.items():
        adapter = ModelAdapter(f"hf-{architecture}", partial(_hugging_face_model, architecture),
                               partial(_token_batch, architecture), prediction_loss,
                               blocks=tuple(f"lm.{blocks}.{i}" for i in range(LAYERS)), tp_plan=_library_plan,
                               chain=_decoder_chain if blocks == "model.layers" else None)
        register_generator(adapter.name, ZooKind(adapter, "transformers"))
    for name, (_, _, units) in TIMM.items():
        adapter = ModelAdapter(f"timm-{name}", partial(_image_model, name), _image_batch, prediction_loss, blocks=units)
        register_generator(adapter.name, ZooKind(adapter, "timm"))


_register()
