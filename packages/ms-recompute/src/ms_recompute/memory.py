"""Activation memory of a decoder layer, from its config alone, per sub-module: the planner's input.

Megatron's formula (Korthikanti et al., arXiv 2205.05198, sec. 4.1) counts the tensors each op keeps
for its backward -- 34·sbh + 5·as²b bytes per layer for their fp16 GPT with dropout. This module does
the same count for what runs here: ms-models' Llama/Qwen2 and DeepSeek-V3 layers executed by
MindSpore 2.10 in PyNative. The list of saved tensors was read off ``mindspore.saved_tensors_hooks``
(unique storages, parameters excluded) and the tests check the formula against that measurement,
byte for byte. With T = b·s tokens, h hidden, a heads, g kv heads, d head dim, r RoPE dim, I MLP
width, all float32 unless noted (x4 bytes), one Llama/Qwen2 layer keeps

    6·T·h + 2·T + 4·T·r + 2·T·a·d + 2·T·g·d + 2·b·a·s² + 4·T·I      elements

    input_layernorm           x, x·rsqrt(mean x²)  [T, h] each;  rsqrt  [T]
    self_attn                 its input [T, h]; RoPE cos/sin, one copy per multiply 8·[T, r/2];
                              q [T, a·d]; k, v [T, g·d] each; softmax and its reshaped copy [b, a, s, s]
                              each; the o_proj input [T, a·d]
    post_attention_layernorm  as input_layernorm
    mlp (SwiGLU)              its input [T, h]; gate, silu(gate), up, silu·up  [T, I] each

(Megatron's 34 = 2 bytes x 17 tensor-widths: it keeps fp16, a dropout mask per dropout, and no RoPE
copies; the structure is the same.) Batch-independent extras are reported apart: the dense MoE
path keeps a transposed copy of each routed-expert stack, and each attention a bool copy of the
mask [s, s] (``ModuleMemory.constant_bytes``, freed by recomputing the module); ms-models' linear
layers keep no weight copy (``ops.dense``, ``MatMul(transpose_b=True)``); the mask and RoPE's
cos/sin themselves are inputs of every layer, held once for the model by recompute checkpoints
(``shared_bytes``).

Tensor parallelism divides the head and MLP-width terms by tp (Megatron's column/row split without
sequence parallelism: norms and layer inputs stay replicated).

A sub-module's *activation* bytes exclude its inputs: recomputing it frees exactly those, while its
inputs stay (the recompute checkpoint holds them). Recomputing a whole layer keeps only the layer
input, so ``LayerMemory.total_bytes - LayerMemory.input_bytes`` is what full recompute frees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import RecomputeError
from .limits import MAX_LAYERS

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

#: top-level sub-modules of every ms-models decoder layer, in execution order (HF names)
LAYER_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@dataclass(frozen=True)
class Term:
    """One saved tensor (or a group of equal ones) of the formula."""

    what: str
    """What the tensor is, with its shape."""
    bytes: int
    """Its size in bytes."""


@dataclass(frozen=True)
class ModuleMemory:
    """Activation memory and recompute cost of one sub-module of a layer."""

    name: str
    """Path of the sub-module inside the layer (HF name), e.g. ``mlp``."""
    input_bytes: int
    """Bytes of its input; its own ops save it, and a recompute checkpoint keeps it."""
    terms: tuple[Term, ...]
    """The tensors its ops save besides the input: what recomputing it frees."""
    flops: float
    """Forward FLOPs: what recomputing it costs."""
    constant_bytes: int = 0
    """Batch-independent bytes its ops keep: the dense MoE path a transposed copy of each expert
    stack; the attention's ``where`` its own bool copy of the causal mask [s, s]."""

    @property
    def activation_bytes(self) -> int:
        """Bytes freed by recomputing this module (its saved tensors, input excluded)."""
        return sum(t.bytes for t in self.terms)


@dataclass(frozen=True)
class LayerMemory:
    """Activation memory of one decoder layer under one batch shape."""

    index: int
    """Layer index."""
    kind: str
    """``dense`` (attention + SwiGLU MLP) or ``moe`` (attention + DeepSeekMoE)."""
    modules: tuple[ModuleMemory, ...]
    """Per sub-module, in execution order."""
    comm_bytes: int
    """Bytes all-reduced per tensor-parallel collective of this layer (0 without TP)."""

    @property
    def input_bytes(self) -> int:
        """The layer input: all a fully recomputed layer keeps."""
        return self.modules[0].input_bytes

    @property
    def total_bytes(self) -> int:
        """Everything the layer keeps without recompute (batch-dependent part)."""
        return sum(m.input_bytes + m.activation_bytes for m in self.modules)

    @property
    def constant_bytes(self) -> int:
        """Batch-independent bytes kept for backward (mask and expert-stack copies)."""
        return sum(m.constant_bytes for m in self.modules)

    @property
    def flops(self) -> float:
        """Forward FLOPs of the layer: the cost of recomputing it whole."""
        return sum(m.flops for m in self.modules)

    def module(self, name: str) -> ModuleMemory:
        for m in self.modules:
            if m.name == name:
                return m
        raise RecomputeError(f"layer {self.index} has no sub-module {name!r}; it has {[m.name for m in self.modules]}")


# ---------------------------------------------------------------------------------------- configs


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of an HF config dict or of a config object (ms_models' dataclasses)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RecomputeError(f"{name}={value!r:.50}; expected a positive int")
    return value


def _optional(config: Any, name: str) -> int | None:
    """An optional int field (HF configs leave it out or write null or 0 for "not used"): None when
    absent, null or 0; otherwise it must be a positive int (a string would fail deep in a formula)."""
    value = _get(config, name)
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    return _positive(value, name)


@dataclass(frozen=True)
class Shape:
    """The batch shape and precision activations are counted for."""

    batch: int
    """Sequences per microbatch (b)."""
    seq: int
    """Tokens per sequence (s)."""
    dtype: str = "float32"
    """Activation dtype: float32, float16 or bfloat16."""
    tp: int = 1
    """Tensor-parallel size (heads and MLP width are split over it)."""

    def __post_init__(self) -> None:
        _positive(self.batch, "batch")
        _positive(self.seq, "seq")
        _positive(self.tp, "tp")
        if self.dtype not in DTYPE_BYTES:
            raise RecomputeError(f"dtype={self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


def arch_of(config: Any) -> str:
    """``llama``, ``qwen2`` or ``deepseek_v3`` from the config's model_type."""
    model_type = _get(config, "model_type")
    if model_type not in ("llama", "qwen2", "deepseek_v3"):
        raise RecomputeError(f"model_type {model_type!r:.50} is not supported; expected llama, qwen2 or deepseek_v3")
    return model_type


def _split(value: int, tp: int, name: str) -> int:
    if value % tp:
        raise RecomputeError(f"tp={tp} does not divide {name}={value}")
    return value // tp


# ---------------------------------------------------------------------------------------- formulas


def _norm(name: str, width: int, sh: Shape, tokens: int) -> tuple[ModuleMemory, int]:
    """RMSNorm: keeps x, rsqrt(mean x²) [T, 1] and x·rsqrt [T, w]; returns the module and its output size."""
    e = sh.elem
    terms = (Term("rsqrt [T, 1]", tokens * e), Term(f"x*rsqrt [T, {width}]", tokens * width * e))
    return ModuleMemory(name, tokens * width * e, terms, 4.0 * tokens * width), tokens * width * e


def _attention_core(sh: Shape, heads: int, dqk: int, dv: int, kv_heads: int) -> list[Term]:
    """The manual softmax attention of ms_models.attention.attend."""
    e, t, b, s = sh.elem, sh.tokens, sh.batch, sh.seq
    return [
        Term(f"q [T, {heads}x{dqk}]", t * heads * dqk * e),
        Term(f"k^T [T, {kv_heads}x{dqk}]", t * kv_heads * dqk * e),
        Term(f"softmax [b, {heads}, s, s]", b * heads * s * s * e),
        Term(f"probs copy [b, {heads}, s, s]", b * heads * s * s * e),
        Term(f"v [T, {kv_heads}x{dv}]", t * kv_heads * dv * e),
        Term(f"o_proj input [T, {heads}x{dv}]", t * heads * dv * e),
    ]


def _rope(sh: Shape, rope_dim: int) -> Term:
    # apply_rope multiplies both halves by cos and sin for q and k: 8 multiplies, each keeps its own
    # broadcast copy of cos or sin [T, 1, r/2] (measured: 8 distinct storages).
    return Term(f"RoPE cos/sin copies 8x[T, {rope_dim // 2}]", 8 * sh.tokens * (rope_dim // 2) * sh.elem)


def _swiglu(name: str, h: int, width: int, sh: Shape, rows: int | None = None) -> ModuleMemory:
    e, t = sh.elem, sh.tokens
    n = t if rows is None else rows
    terms = (Term(f"gate, silu, up, silu*up 4x[T, {width}]", 4 * n * width * e),)
    return ModuleMemory(name, t * h * e, terms, 6.0 * n * h * width)


def _dense_attention(config: Any, sh: Shape) -> ModuleMemory:
    h = config_int(config, "hidden_size")
    heads = _split(config_int(config, "num_attention_heads"), sh.tp, "num_attention_heads")
    kv = _optional(config, "num_key_value_heads") or config_int(config, "num_attention_heads")
    kv = _split(kv, sh.tp, "num_key_value_heads")
    d = _optional(config, "head_dim") or h // config_int(config, "num_attention_heads")
    t, b, s = sh.tokens, sh.batch, sh.seq
    terms = (_rope(sh, d), *_attention_core(sh, heads, d, d, kv))
    flops = 2.0 * t * h * (heads + 2 * kv) * d + 2.0 * t * heads * d * h + 4.0 * b * heads * s * s * d
    return ModuleMemory("self_attn", t * h * sh.elem, terms, flops, s * s)


def _mla(config: Any, sh: Shape) -> ModuleMemory:
    """DeepSeek-V3's multi-head latent attention, training path (latent expanded per head)."""
    e, t, b, s = sh.elem, sh.tokens, sh.batch, sh.seq
    h = config_int(config, "hidden_size")
    heads = _split(config_int(config, "num_attention_heads"), sh.tp, "num_attention_heads")
    nope, rope, dv = (config_int(config, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kv_rank, q_rank = config_int(config, "kv_lora_rank"), _optional(config, "q_lora_rank")
    dqk = nope + rope
    terms = []
    flops = 0.0
    if q_rank:
        # q_a_proj output, then q_a_layernorm keeps x, rsqrt and x*rsqrt, and q_b_proj its input
        terms += [Term(f"q latent, normed, x*rsqrt 3x[T, {q_rank}]", 3 * t * q_rank * e), Term("q rsqrt [T, 1]", t * e)]
        flops += 2.0 * t * h * q_rank + 2.0 * t * q_rank * heads * dqk
    else:
        flops += 2.0 * t * h * heads * dqk
    terms += [
        Term(f"kv latent, normed, x*rsqrt 3x[T, {kv_rank}]", 3 * t * kv_rank * e),
        Term("kv rsqrt [T, 1]", t * e),
        _rope(sh, rope),
        *_attention_core(sh, heads, dqk, dv, heads),
    ]
    flops += 2.0 * t * h * (kv_rank + rope) + 2.0 * t * kv_rank * heads * (nope + dv)
    flops += 2.0 * t * heads * dv * h + 2.0 * b * heads * s * s * (dqk + dv)
    return ModuleMemory("self_attn", t * h * e, tuple(terms), flops, s * s)


def _moe(config: Any, sh: Shape, impl: str) -> ModuleMemory:
    """DeepSeekMoE as ms_models runs it. ``dense`` (ms_models' default) runs every expert on every
    token, as measured; ``dispatch`` estimates a sparse run with the same per-row tensors on the
    k·T routed rows only (not measured: the sparse path's saved tensors depend on the routing)."""
    e, t = sh.elem, sh.tokens
    h = config_int(config, "hidden_size")
    experts, k = config_int(config, "n_routed_experts"), config_int(config, "num_experts_per_tok")
    groups, topk_group = config_int(config, "n_group"), config_int(config, "topk_group")
    width = _split(config_int(config, "moe_intermediate_size"), sh.tp, "moe_intermediate_size")
    shared = (_optional(config, "n_shared_experts") or 0) * width
    rows = experts * t if impl == "dense" else k * t
    terms = [
        Term(
            f"router: scores [T, {experts}], group top-2 [T, {groups}x2], top-k weights x2 and indices "
            f"[T, {k}], group indices [T, {topk_group}], norm [T, 1], one-hot [T, {k}, {experts}]",
            (t * experts + 2 * t * groups + 3 * t * k + t * topk_group + t + t * k * experts) * e,
        ),
        Term(f"router: eligible-expert mask [T, {experts}] (bool)", t * experts),
        Term(f"router input and two expert-input copies 3x[T, {h}]", 3 * t * h * e),
        Term(f"experts: gate, silu, up, silu*up 4x[rows, {width}]", 4 * rows * width * e),
        Term(f"experts: outputs [rows, {h}] and combine weights [rows]", rows * (h + 1) * e),
    ]
    flops = 6.0 * rows * h * width + 2.0 * t * h * experts
    weights = 3 * experts * width * h  # the stacked experts, each copied by .transpose per call
    if shared:
        terms.append(Term(f"shared experts: gate, silu, up, silu*up 4x[T, {shared}]", 4 * t * shared * e))
        flops += 6.0 * t * h * shared
    return ModuleMemory("mlp", t * h * e, tuple(terms), flops, weights * e)


def config_int(config: Any, name: str) -> int:
    """A required positive int field of the config."""
    return _positive(_get(config, name), name)


def shared_bytes(config: Any, shape: Shape) -> int:
    """Bytes every layer reads as inputs, which recompute checkpoints hold (once for the whole model)
    when a recomputed Cell takes them: the RoPE cos and sin [b, s, r/2] and the bool mask [s, s]."""
    arch = arch_of(config)
    if arch == "deepseek_v3":
        rope = config_int(config, "qk_rope_head_dim")
    else:
        heads = config_int(config, "num_attention_heads")
        rope = _optional(config, "head_dim") or config_int(config, "hidden_size") // heads
    return 2 * shape.tokens * (rope // 2) * 4 + shape.seq * shape.seq


def layer_memory(config: Any, index: int, shape: Shape, *, moe_impl: str = "dense") -> LayerMemory:
    """Activation memory of layer ``index`` of the model ``config`` (an HF config.json dict or an
    ms_models config) for one microbatch of ``shape``."""
    arch = arch_of(config)
    if moe_impl not in ("dense", "dispatch"):
        raise RecomputeError(f"moe_impl={moe_impl!r}; expected 'dense' or 'dispatch'")
    layers = config_int(config, "num_hidden_layers")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < layers:
        raise RecomputeError(f"layer index {index!r} is out of range for num_hidden_layers={layers}")
    h, t = config_int(config, "hidden_size"), shape.tokens
    norm1, _ = _norm("input_layernorm", h, shape, t)
    norm2, _ = _norm("post_attention_layernorm", h, shape, t)
    moe = arch == "deepseek_v3" and index >= (_optional(config, "first_k_dense_replace") or 0)
    attention = _mla(config, shape) if arch == "deepseek_v3" else _dense_attention(config, shape)
    if moe:
        mlp = _moe(config, shape, moe_impl)
    else:
        width = _split(config_int(config, "intermediate_size"), shape.tp, "intermediate_size")
        mlp = _swiglu("mlp", h, width, shape)
    comm = t * h * shape.elem if shape.tp > 1 else 0
    return LayerMemory(index, "moe" if moe else "dense", (norm1, attention, norm2, mlp), comm)


def model_memory(config: Any, shape: Shape, *, moe_impl: str = "dense") -> list[LayerMemory]:
    """``layer_memory`` of every decoder layer."""
    layers = MAX_LAYERS.check(config_int(config, "num_hidden_layers"), "num_hidden_layers", RecomputeError)
    return [layer_memory(config, i, shape, moe_impl=moe_impl) for i in range(layers)]


def megatron_bytes(config: Any, shape: Shape) -> int:
    """Megatron's per-layer formula, sbh(34 + 5as/h) bytes (fp16, with dropout, no recompute), for
    comparison in reports: same structure, different implementation."""
    h, a = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    s, b, tp = shape.seq, shape.batch, shape.tp
    return int(s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)))
