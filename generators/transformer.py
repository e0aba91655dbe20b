"""Decoder-only transformers written natively in PyTorch, the architecture tensor, sequence and loss parallelism,
FSDP2 per block and pipelines over blocks are built for.

Modules carry torchtitan's Llama names (`tok_embeddings`, `layers.<i>.attention.{wq,wk,wv,wo}`, `attention_norm`,
`feed_forward.{w1,w2,w3}`, `ffn_norm`, `norm`, `output`), so the tensor-parallel plan below is the one torchtitan
applies to its own models. Drawn per (seed, index): width, heads, grouped-query attention (fewer key/value heads),
RMSNorm or LayerNorm, SwiGLU or GELU feed-forward, tied input/output embeddings, depth, vocabulary and sequence
length. Rotary position embeddings are computed from positions in every forward (no buffer), so a float64 build is
float64 throughout. Training is next-token prediction: cross-entropy over the vocabulary at every position.

Head counts are multiples of 4 and the sequence length a multiple of 4, so every world size up to 4 divides the
heads (tensor parallel) and the positions (sequence parallel) — except in every third model (index 2, 5, 8, …), the
uneven variant, where head counts (6 or 10), the feed-forward width and the vocabulary (none divisible by 2, 3 or 4)
and the sequence length (5 or 6) leave shards of different sizes: FSDP2's dim-0 shards, the column- and row-wise
shards of tensor parallel, the vocabulary shards of loss parallel. A plan whose heads or positions do not split over
the ranks is refused, as torchtitan's is; a head's width stays even (rotary embeddings rotate its two halves).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from difftest import Generator, ModelSpec, Unsupported, order_by_words, register_generator
from generators.inputs import UNEVEN_SIZES, Batch

KIND = "transformer"
LOOPED_KIND = "transformer-looped"


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([0x7F4, *key]))


# stages of a decoder: token embeddings, its blocks in order, the final norm, the output projection, the loss
_STAGE_WORDS = (("tok_embeddings", 0), ("norm", 3), ("output", 4), ("prediction", 4), ("loss", 5))


class TransformerGenerator(Generator):
    kind = KIND
    traits = frozenset({"torch", "transformer", "blocks"})

    def spec(self, seed: int, index: int) -> ModelSpec:
        rng = _rng(seed, index)
        uneven = index % 3 == 2
        kv_heads = int(rng.choice([6, 10] if uneven else [4, 8]))
        params = {
            "layers": int(rng.integers(1, 4)),
            "kv_heads": kv_heads,
            "heads": kv_heads * int(rng.choice([1, 2])),  # more query than key/value heads: grouped-query attention
            "head_dim": int(rng.choice([2, 4])),  # even: rotary embeddings rotate the two halves of a head
            "norm": str(rng.choice(["rmsnorm", "layernorm"])),
            "ffn": str(rng.choice(["swiglu", "gelu"])),
            "hidden": int(rng.choice(UNEVEN_SIZES[1:8]) if uneven else 4 * rng.integers(2, 9)),
            "vocab": int(rng.choice(UNEVEN_SIZES[5:16]) if uneven else 4 * rng.integers(4, 13)),
            "seq_len": int(rng.choice([5, 6] if uneven else [4, 8])),
            "tied": bool(rng.random() < 0.3),
        }
        frozen: tuple[str, ...] = ()
        if index % 2 == 1:  # the frozen-parameter variant: one block's projection or norm does not train
            names = sorted(n for n in self.parameter_shapes(params) if n.startswith("layers."))
            frozen = (names[int(rng.integers(len(names)))],)
        return ModelSpec(kind=self.kind, seed=seed, index=index, params=params, frozen=frozen, input_seed=0)

    @staticmethod
    def parameter_shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Canonical names (the unsharded module's, a tied output weight named once as the embedding) and shapes."""
        dim = params["heads"] * params["head_dim"]
        kv = params["kv_heads"] * params["head_dim"]
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (params["vocab"], dim)}

        def norm(prefix: str) -> None:
            shapes[f"{prefix}.weight"] = (dim,)
            if params["norm"] == "layernorm":
                shapes[f"{prefix}.bias"] = (dim,)

        for i in range(params["layers"]):
            block = f"layers.{i}"
            norm(f"{block}.attention_norm")
            shapes.update({f"{block}.attention.wq.weight": (dim, dim), f"{block}.attention.wk.weight": (kv, dim),
                           f"{block}.attention.wv.weight": (kv, dim), f"{block}.attention.wo.weight": (dim, dim)})
            norm(f"{block}.ffn_norm")
            shapes[f"{block}.feed_forward.w1.weight"] = (params["hidden"], dim)
            shapes[f"{block}.feed_forward.w2.weight"] = (dim, params["hidden"])
            if params["ffn"] == "swiglu":
                shapes[f"{block}.feed_forward.w3.weight"] = (params["hidden"], dim)
        norm("norm")
        if not params["tied"]:
            shapes["output.weight"] = (params["vocab"], dim)
        return shapes

    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        rng = _rng(spec.seed, spec.index, 1)
        state = {}
        for name, shape in self.parameter_shapes(spec.params).items():
            if "norm" in name:
                value = rng.uniform(0.5, 1.5, size=shape) if name.endswith("weight") else rng.uniform(-0.2, 0.2, size=shape)
            elif name == "tok_embeddings.weight":
                value = rng.uniform(-1.0, 1.0, size=shape)
            else:
                value = rng.uniform(-1.0, 1.0, size=shape) * math.sqrt(3.0 / shape[1])
            state[name] = value.astype(np.float32)
        return state

    def inputs(self, spec: ModelSpec, batch_size: int) -> dict[str, Batch]:
        """Token ids (int64, batch × seq_len) and their next tokens as labels."""
        rng = _rng(spec.seed, spec.index, 2, spec.input_seed)
        vocab, length = spec.params["vocab"], spec.params["seq_len"]
        batches = {}
        for split in ("train", "eval"):
            stream = rng.integers(0, vocab, size=(batch_size, length + 1)).astype(np.int64)
            batches[split] = Batch(labels=stream[:, 1:].copy(), dense=stream[:, :-1].copy())
        return batches

    def features(self, spec: ModelSpec) -> list[str]:
        p = spec.params
        norm = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[p["norm"]]
        ffn = {"swiglu": "SwiGLU", "gelu": "GELU-FeedForward"}[p["ffn"]]
        out = ["CausalSelfAttention", "RotaryEmbedding", norm, ffn, f"Blocks{p['layers']}"]
        if p["heads"] != p["kv_heads"]:
            out.append("GroupedQueryAttention")
        if p["tied"]:
            out.append("TiedEmbeddings")
        return sorted(out)

    def tensor_order(self, tensor: str) -> tuple[int, int]:
        block = re.match(r"layers\.(\d+)\.", tensor)  # a block's tensors, blocks in order
        return (1, int(block.group(1))) if block else order_by_words(tensor, _STAGE_WORDS)

    def frozen_names(self, params: dict[str, Any]) -> set[str]:
        return set(self.parameter_shapes(params))

    # --- minimisation -----------------------------------------------------------------------------
    def size(self, spec: ModelSpec) -> dict[str, int]:
        p = spec.params
        return {"layers": p["layers"], "width": p["heads"] * p["head_dim"] + p["hidden"],
                "parameters": sum(math.prod(s) for s in self.parameter_shapes(p).values())}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        p = spec.params
        out: list[tuple[str, dict[str, Any]]] = []
        if p["layers"] > 1:
            out.append(("one block", {**p, "layers": 1}))
        if p["layers"] > 2:  # where one block is too few (a pipeline of 4 stages needs 2 between its ends)
            out.append(("one block fewer", {**p, "layers": p["layers"] - 1}))
        if p["heads"] != p["kv_heads"]:
            out.append(("as many query as key/value heads", {**p, "heads": p["kv_heads"]}))
        if p["kv_heads"] > 4:
            out.append(("4 key/value heads", {**p, "kv_heads": 4, "heads": 4 * p["heads"] // p["kv_heads"]}))
        if p["head_dim"] > 2:
            out.append(("head dim 2", {**p, "head_dim": 2}))
        if p["hidden"] > 8:
            out.append(("feed-forward 8 wide", {**p, "hidden": 8}))
        if p["vocab"] > 16:
            out.append(("vocabulary 16", {**p, "vocab": 16}))
        if p["seq_len"] > 4:
            out.append(("4 positions", {**p, "seq_len": 4}))
        if p["tied"]:
            out.append(("untied embeddings", {**p, "tied": False}))
        return out

    # --- torch side (workers only) ----------------------------------------------------------------
    def build(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None) -> Any:
        return with_state(_build_module(spec.params, device), init_state, spec.frozen)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        import torch

        return module(torch.from_numpy(batch.dense).to(device))

    def loss(self, prediction: Any, batch: Batch) -> Any:
        import torch

        return prediction_loss(prediction, torch.from_numpy(batch.labels).to(prediction.device))

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """The logits and each block's output (`layers.<i>/act`), the latter only where a rank holds all positions
        (sequence parallel keeps a block's output sharded over positions between blocks)."""
        from torch.distributed.tensor import DTensor

        inner = _unwrap(module)
        seen: dict[str, Any] = {}
        handles = [block.register_forward_hook(lambda _m, _a, out, i=i: seen.update({f"layers.{i}/act": out}))
                   for i, block in enumerate(inner.layers)]
        try:
            logits = self.forward(module, batch, device)
        finally:
            for handle in handles:
                handle.remove()
        full = {name: v.full_tensor() if isinstance(v, DTensor) else v for name, v in seen.items()}
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        length = batch.dense.shape[1]
        return {"logits": logits, **{n: v for n, v in full.items() if v.dim() == 3 and v.shape[1] == length}}

    def parameters(self, module: Any) -> dict[str, Any]:
        return dict(_unwrap(module).named_parameters())

    def blocks(self, module: Any) -> list[tuple[str, Any]]:
        """The transformer blocks: FSDP2's units when it wraps per block (torchtitan's wrapping)."""
        return [(f"layers.{i}", block) for i, block in enumerate(_unwrap(module).layers)]

    def tp_plan(self, module: Any, world_size: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        return model_tp_plan(module, world_size, sequence_parallel, loss_parallel)

    def standalone_model(self, spec: ModelSpec, init_state: dict[str, np.ndarray], model_dir: Any,
                         train: Batch) -> Any:
        from difftest import ModelCode
        from generators.dlrm import build_model, model_parameters  # they call this kind's functions by their names

        p = spec.params
        return ModelCode(
            summary=f"The model is a decoder-only transformer in plain PyTorch ({p['layers']} block(s) named as "
                    f"torchtitan's Llama: {p['heads']} query and {p['kv_heads']} key/value heads of {p['head_dim']}, "
                    f"{p['norm']}, {p['ffn']} feed-forward {p['hidden']} wide, rotary positions, "
                    f"{'tied' if p['tied'] else 'untied'} embeddings"
                    f"{f', each block applied {loops} times in a row' if (loops := p.get('loops', 1)) > 1 else ''}), "
                    f"next-token cross-entropy.",
            libraries=(), preamble=(),
            functions=(_unwrap, _rotate, _build_module, with_state, build_model, prediction_loss, model_loss,
                       model_parameters, model_tp_plan),
            chain=(_chain_units, model_chain),
            case={"model": p, "frozen": list(spec.frozen)},
            data={**{f"state.{k}": v for k, v in init_state.items()}, **train.to_arrays("train")},
            parameters=tuple(init_state))

    def chain(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None) -> Any:
        """[token embedding, one unit per block, final norm + output projection]."""
        from difftest import BatchSource, LayerChain

        if spec.params["tied"]:
            raise Unsupported("tied input/output embeddings: the first and the last stage would train two copies of "
                              "one tensor (torchtitan refuses pipelines over tied embeddings too)")
        import torch

        module = self.build(spec, init_state, device)
        source = BatchSource()
        units = _chain_units(module, lambda positions: torch.from_numpy(source.samples(positions).dense).to(device))
        return LayerChain(units, source, lambda: dict(module.named_parameters()), "logits")


def model_tp_plan(module: Any, world_size: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """torchtitan's Llama plan: attention and feed-forward column- then row-wise; with sequence parallel the
    norms and the residual stream between blocks sharded over positions; with loss parallel the logits sharded
    over the vocabulary. Tied embeddings stay replicated (one tensor cannot be sharded row-wise as the embedding
    and column-wise as the output projection)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    p = _unwrap(module).params
    if p["kv_heads"] % world_size:
        raise Unsupported(f"{p['kv_heads']} key/value heads do not split over {world_size} ranks")
    if sequence_parallel and p["seq_len"] % world_size:
        raise Unsupported(f"{p['seq_len']} positions do not split over {world_size} ranks")
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    if p["tied"]:
        if loss_parallel:
            raise Unsupported("tied embeddings keep the output projection replicated: no vocabulary-sharded logits "
                              "for loss parallel")
        if sequence_parallel:
            plan["tok_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
            plan["norm"] = SequenceParallel()
            plan["output"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    else:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=residual,
                                         output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    for i, _block in enumerate(_unwrap(module).layers):
        prefix = f"layers.{i}"
        if sequence_parallel:
            plan[f"{prefix}.attention_norm"] = SequenceParallel()
            plan[f"{prefix}.ffn_norm"] = SequenceParallel()
            plan[f"{prefix}.attention"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                             desired_input_layouts=(Replicate(),))
            plan[f"{prefix}.feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                                desired_input_layouts=(Replicate(),))
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            if name != "feed_forward.w3" or p["ffn"] == "swiglu":
                plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"{prefix}.{name}"] = RowwiseParallel(output_layouts=residual)
    return plan


def with_state(module: Any, state: dict[str, np.ndarray], frozen: Any) -> Any:
    """`module` with the weights `state` (a tied output projection is the embedding's) and `frozen` frozen."""
    import torch

    missing, unexpected = module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - ({"output.weight"} if module.params["tied"] else set()):
        raise ValueError(f"initial state does not fit the module: missing {missing}, unexpected {unexpected}")
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return module


def prediction_loss(prediction: Any, labels: Any) -> Any:
    """Mean next-token cross-entropy; `prediction` may be a vocabulary-sharded DTensor (loss parallel)."""
    import torch

    return torch.nn.functional.cross_entropy(prediction.flatten(0, 1), labels.flatten(0, 1))


# --- the model in a standalone script (difftest.scripts.emit): its data holds the weights and the training batch -------
def model_loss(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> Any:
    """The loss on training samples start..stop of the script's data, as `forward` and `loss` compute it."""
    import torch

    tokens, labels = (torch.from_numpy(data[f"train.{part}"][start:stop]) for part in ("dense", "labels"))
    return prediction_loss(module(tokens), labels)


def model_chain(module: Any, data: dict[str, Any], fed: dict[str, str], dtype: Any) -> list[Any]:
    """The model as the chain of units a pipeline splits into stages (`_chain_units`), reading the tokens of the
    script's batch `fed["split"]` at the positions its first unit is given."""
    import torch

    return _chain_units(module, lambda positions: torch.from_numpy(
        data[f"{fed['split']}.dense"][int(positions[0]):int(positions[0]) + len(positions)]))


def _unwrap(module: Any) -> Any:
    """The Transformer inside DDP/FSDP wrappers."""
    while "params" not in vars(module):
        module = module.module
    return module


def _rotate(x: Any) -> Any:
    """Rotary position embedding (rotate-half form) of x: (batch, seq, heads, head_dim)."""
    import torch

    length, half = x.shape[1], x.shape[-1] // 2
    inverse = 1.0 / (10000.0 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angles = torch.arange(length, dtype=x.dtype, device=x.device)[:, None] * inverse[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def _build_module(params: dict[str, Any], device: str) -> Any:
    import torch
    from torch import nn

    dim = params["heads"] * params["head_dim"]

    def norm() -> nn.Module:
        if params["norm"] == "rmsnorm":
            return nn.RMSNorm(dim, eps=1e-6, device=device)
        return nn.LayerNorm(dim, eps=1e-6, device=device)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = params["head_dim"]
            self.repeats = params["heads"] // params["kv_heads"]
            kv = params["kv_heads"] * self.head_dim
            self.wq = nn.Linear(dim, dim, bias=False, device=device)
            self.wk = nn.Linear(dim, kv, bias=False, device=device)
            self.wv = nn.Linear(dim, kv, bias=False, device=device)
            self.wo = nn.Linear(dim, dim, bias=False, device=device)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, length, _ = x.shape
            # -1 heads: under tensor parallel each rank holds its share of the heads
            q = _rotate(self.wq(x).view(batch, length, -1, self.head_dim))
            k = _rotate(self.wk(x).view(batch, length, -1, self.head_dim))
            v = self.wv(x).view(batch, length, -1, self.head_dim)
            k, v = (t.repeat_interleave(self.repeats, dim=2) for t in (k, v))
            out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(batch, length, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, params["hidden"], bias=False, device=device)
            self.w2 = nn.Linear(params["hidden"], dim, bias=False, device=device)
            if params["ffn"] == "swiglu":
                self.w3 = nn.Linear(dim, params["hidden"], bias=False, device=device)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if params["ffn"] == "swiglu":
                return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
            return self.w2(nn.functional.gelu(self.w1(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.attention = norm(), Attention()
            self.ffn_norm, self.feed_forward = norm(), FeedForward()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.params = params
            self.tok_embeddings = nn.Embedding(params["vocab"], dim, device=device)
            self.layers = nn.ModuleList(Block() for _ in range(params["layers"]))
            self.norm = norm()
            self.output = nn.Linear(dim, params["vocab"], bias=False, device=device)
            if params["tied"]:
                self.output.weight = self.tok_embeddings.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(tokens)
            for block in self.layers:
                for _ in range(params.get("loops", 1)):
                    h = block(h)
            return self.output(self.norm(h))

    return Transformer()


def _chain_units(module: Any, tokens_at: Any) -> list[Any]:
    """[token embedding (of `tokens_at(positions)`: the tokens of the samples at those positions of the batch being
    fed), the blocks, final norm + output projection]."""
    import torch

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = module.tok_embeddings

        def forward(self, positions: torch.Tensor) -> torch.Tensor:
            return self.tok_embeddings(tokens_at(positions))

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.output = module.norm, module.output

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.output(self.norm(h))

    class Looped(torch.nn.Module):
        """A block applied `loops` times in a row, its weights shared by every application."""

        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            for _ in range(module.params["loops"]):
                h = self.block(h)
            return h

    blocks = [Looped(block) for block in module.layers] if module.params.get("loops", 1) > 1 else list(module.layers)
    return [Embed(), *blocks, Head()]


class LoopedTransformerGenerator(TransformerGenerator):
    """The same decoders with each block applied 2 or 3 times in a row: weights shared across depth (ALBERT,
    Universal Transformers, recurrent-depth models). One parameter then reaches the loss along several paths inside
    one module, one pipeline stage and one FSDP2 unit, which a wrapper called once per block per step never meets:
    FSDP2 gathers a unit's weights and registers its backward hooks once per call, and a pipeline's split backward
    (zero-bubble schedules, DualPipeV) computes a weight's gradient from the several places its stage's graph uses
    it (pytorch#180952: shared weights counted twice)."""

    kind = LOOPED_KIND
    traits = TransformerGenerator.traits | {"reused-weights"}

    def spec(self, seed: int, index: int) -> ModelSpec:
        spec = super().spec(seed, index)
        loops = int(_rng(seed, index, 3).integers(2, 4))
        return dataclasses.replace(spec, params={**spec.params, "loops": loops})

    def features(self, spec: ModelSpec) -> list[str]:
        return sorted([*super().features(spec), f"LoopedBlocks{spec.params['loops']}"])

    def size(self, spec: ModelSpec) -> dict[str, int]:
        return {"loops": spec.params["loops"], **super().size(spec)}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        p = spec.params
        fewer = [("each block applied once", {**p, "loops": 1})]
        if p["loops"] > 2:
            fewer.append(("each block applied twice", {**p, "loops": 2}))
        return fewer + super().reductions(spec)


register_generator(KIND, TransformerGenerator())
register_generator(LOOPED_KIND, LoopedTransformerGenerator())
