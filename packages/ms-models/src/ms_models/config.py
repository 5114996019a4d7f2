"""Hugging Face style configs: the same field names and defaults as the models' config.json.

One dataclass per family. `from_dict` reads an HF config.json (fields this package does not use are
kept in `extra` and written back unchanged), `to_dict` writes one that transformers and vLLM read.
RoPE is given as HF's classic `rope_theta` + `rope_scaling`; the newer `rope_parameters` dict
(transformers 5) is accepted on input and folded into those two fields.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from ms_layout.files import FileError, atomic_write_json, read_json
from ms_layout.limits import Limit

from .errors import ModelError
from .rope_scaling import llama3_inv_freq, yarn_inv_freq, yarn_mscale

MAX_SIZE = Limit("MS_MODELS_MAX_SIZE", 1 << 20, "entries of one config size (vocab, widths, heads, experts)")
"""Bound on each size field of a config (vocab_size, hidden_size, intermediate_size, heads, experts, ranks)."""
MAX_LAYERS = Limit("MS_MODELS_MAX_LAYERS", 1 << 12, "decoder layers")
"""Bound on num_hidden_layers and num_nextn_predict_layers."""
MAX_PARAMS = Limit("MS_MODELS_MAX_PARAMS", 1 << 40, "parameters of one model")
"""Bound on the parameter count a config builds (4 TiB of float32): checked before anything is allocated."""
MAX_CONFIG_BYTES = Limit("MS_MODELS_MAX_CONFIG_BYTES", 16 << 20, "bytes of config.json")
"""Bound on the size of a config.json (or an index / manifest JSON) read whole."""

# The type of every field a config reads from config.json, checked before any arithmetic on it.
_POSITIVE = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "max_position_embeddings head_dim kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
    "moe_intermediate_size n_routed_experts num_experts_per_tok n_group topk_group"
).split()
_NON_NEGATIVE = "n_shared_experts first_k_dense_replace num_nextn_predict_layers max_window_layers".split()
_OPTIONAL_INT = "q_lora_rank sliding_window bos_token_id pad_token_id".split()
_NUMBER = "rms_norm_eps rope_theta initializer_range routed_scaling_factor".split()
_BOOL = "tie_word_embeddings attention_bias mlp_bias use_sliding_window norm_topk_prob rope_interleave".split()
_STR = "hidden_act torch_dtype scoring_func topk_method".split()
_LAYER_COUNTS = ("num_hidden_layers", "num_nextn_predict_layers")
_NOT_SIZES = ("max_position_embeddings", "bos_token_id", "pad_token_id", "max_window_layers", "sliding_window")
_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ()}
_ROPE_NUMBERS = (
    "factor low_freq_factor high_freq_factor original_max_position_embeddings mscale mscale_all_dim "
    "beta_fast beta_slow attention_factor"
).split()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class DecoderConfig:
    """Fields common to the Llama/Qwen2 and DeepSeek-V3 families."""

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""

    vocab_size: int = 32000
    """Number of token ids."""
    hidden_size: int = 4096
    """Width of the residual stream."""
    intermediate_size: int = 11008
    """Width of the dense SwiGLU MLP."""
    num_hidden_layers: int = 32
    """Number of decoder layers (MTP layers are counted separately)."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (GQA); None means num_attention_heads."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE settings were trained for."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling: None, or {"rope_type": "linear" | "llama3" | "yarn", ...} as in HF."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    hidden_act: str = "silu"
    """MLP activation; only silu (SwiGLU) is implemented."""
    attention_bias: bool = False
    """Bias on the attention projections (Llama: q/k/v/o; DeepSeek: q_a/kv_a/o)."""
    initializer_range: float = 0.02
    """Std of the normal init used by make_tiny / random init."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = 2
    """End-of-sequence token id(s)."""
    pad_token_id: int | None = None
    """Padding token id."""
    torch_dtype: str = "float32"
    """Dtype the checkpoint is stored in."""
    extra: dict[str, Any] = field(default_factory=dict)
    """config.json fields this package does not interpret, kept for the round trip."""

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.validate()

    # ------------------------------------------------------------------ checks
    def check_types(self) -> None:
        """Raise ModelError naming the first field of the wrong type or over its limit (MAX_SIZE,
        MAX_LAYERS): what config.json gives is checked before any arithmetic on it."""
        present = {f.name for f in fields(self)}
        for name in present:
            value = getattr(self, name)
            if name in _POSITIVE and value is not None and (not _is_int(value) or value <= 0):
                raise ModelError(f"{name}={value!r}; expected a positive int")
            if name in _NON_NEGATIVE and (not _is_int(value) or value < 0):
                raise ModelError(f"{name}={value!r}; expected a non-negative int")
            if name in _OPTIONAL_INT and value is not None and (not _is_int(value) or value < 0):
                raise ModelError(f"{name}={value!r}; expected null or a non-negative int")
            if name in _NUMBER and (not _is_number(value) or value < 0):
                raise ModelError(f"{name}={value!r}; expected a non-negative finite number")
            if name in _BOOL and not isinstance(value, bool):
                raise ModelError(f"{name}={value!r}; expected true or false")
            if name in _STR and not isinstance(value, str):
                raise ModelError(f"{name}={value!r}; expected a string")
            if _is_int(value) and name not in _NOT_SIZES:
                limit = MAX_LAYERS if name in _LAYER_COUNTS else MAX_SIZE
                limit.check(value, name, error=ModelError)
        eos = self.eos_token_id
        if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(e) for e in eos))):
            raise ModelError(f"eos_token_id={eos!r}; expected null, an int or a list of ints")
        if not isinstance(self.extra, dict):
            raise ModelError(f"extra={self.extra!r}; expected a dict of fields")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ModelError(f"rope_scaling={scaling!r}; expected null or an object")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if not isinstance(kind, str) or kind not in ("default", "linear", "llama3", "yarn"):
            raise ModelError(f"rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")
        for key in _ROPE_KEYS.get(kind, ()):
            if key not in scaling:
                raise ModelError(f"rope_scaling of type {kind!r} needs {key!r}; got {sorted(scaling)}")
        for key in _ROPE_NUMBERS:
            value = scaling.get(key)
            if value is not None and (not _is_number(value) or value <= 0):
                raise ModelError(f"rope_scaling {key}={value!r}; expected a positive number")
        if kind == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
            raise ModelError("rope_scaling llama3: low_freq_factor equals high_freq_factor (the ramp divides by them)")

    def check_size(self) -> None:
        """Raise ModelError if the model would hold more than MAX_PARAMS parameters."""
        from .layouts import param_shapes

        total = sum(math.prod(s) for s in param_shapes(self).values())
        MAX_PARAMS.check(total, f"parameters of this {self.model_type} config", error=ModelError)

    def validate(self) -> None:
        """Raise ModelError on fields of the wrong type, sizes over their limits and sizes that
        cannot build a model."""
        self.check_types()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ModelError(f"hidden_act={self.hidden_act!r}; only 'silu' (SwiGLU) is implemented")
        self.check_size()

    @property
    def rope_type(self) -> str:
        """The RoPE variant named by rope_scaling ("default" without scaling)."""
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def rope_dim(self) -> int:
        """Number of head dims that RoPE rotates."""
        raise NotImplementedError

    # ------------------------------------------------------------------ RoPE
    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies (float32, rope_dim/2) and the cos/sin scale, as HF computes them."""
        dim, base = self.rope_dim, float(self.rope_theta)
        inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        params = self.rope_scaling or {}
        kind = self.rope_type
        if kind == "linear":
            return (inv / params["factor"]).astype(np.float32), 1.0
        if kind == "llama3":
            return llama3_inv_freq(inv, params, self.max_position_embeddings).astype(np.float32), 1.0
        if kind == "yarn":
            return yarn_inv_freq(dim, base, params, self.max_position_embeddings)
        return inv.astype(np.float32), 1.0

    # ------------------------------------------------------------------ dicts
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderConfig:
        """Build from a config.json dict; unknown fields go to `extra`."""
        if not isinstance(data, dict):
            raise ModelError(f"a config is a JSON object of fields, not a {type(data).__name__}")
        data = dict(data)
        model_type = data.pop("model_type", cls.model_type)
        data.pop("architectures", None)  # derived from the class
        if model_type != cls.model_type:
            raise ModelError(f"model_type {model_type!r} given to {cls.__name__} (expects {cls.model_type!r})")
        rope_parameters = data.pop("rope_parameters", None)
        if rope_parameters is not None and not isinstance(rope_parameters, dict):
            raise ModelError(f"rope_parameters={rope_parameters!r:.80}; expected an object")
        if rope_parameters and "rope_scaling" not in data:
            rope_parameters = dict(rope_parameters)
            data.setdefault("rope_theta", rope_parameters.pop("rope_theta", 10000.0))
            kind = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
            data["rope_scaling"] = None if kind == "default" else rope_parameters
        if data.get("torch_dtype") is None:
            data["torch_dtype"] = data.pop("dtype", None) or "float32"
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names and k != "extra"}
        try:
            return cls(**known, extra=extra)
        except TypeError as exc:
            raise ModelError(f"bad config for {cls.__name__}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict (model_type and architectures included)."""
        out = asdict(self)
        extra = out.pop("extra")
        out = {"architectures": [self.architecture], "model_type": self.model_type, **out}
        out.update({k: v for k, v in extra.items() if k not in out})
        return out

    def save(self, directory: str | os.PathLike) -> None:
        """Write config.json into `directory` (temp name, then rename)."""
        atomic_write_json(os.path.join(os.fspath(directory), "config.json"), self.to_dict(), indent=2, sort_keys=True)


@dataclass
class LlamaConfig(DecoderConfig):
    """Llama family (HF LlamaConfig field names)."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"

    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads."""
    mlp_bias: bool = False
    """Bias on gate/up/down projections."""

    def __post_init__(self) -> None:
        self.check_types()  # before the arithmetic below
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelError(
                    f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                    f"{self.num_attention_heads}; give head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__()

    @property
    def rope_dim(self) -> int:
        """RoPE rotates the whole head."""
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections have a bias."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias."""
        return self.attention_bias


@dataclass
class Qwen2Config(LlamaConfig):
    """Qwen2 family: Llama plus q/k/v biases (HF Qwen2Config field names)."""

    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"

    rope_theta: float = 1000000.0
    """RoPE base (Qwen2's default)."""
    use_sliding_window: bool = False
    """Sliding-window attention; not implemented (must be False)."""
    sliding_window: int | None = None
    """Window size when use_sliding_window is set."""
    max_window_layers: int = 28
    """Layers below this index use full attention when the window is on."""

    def validate(self) -> None:
        """Llama's checks, and no sliding window."""
        super().validate()
        if self.use_sliding_window:
            raise ModelError("use_sliding_window=True is not implemented; every layer uses full attention")

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases."""
        return True

    @property
    def o_bias(self) -> bool:
        """Qwen2's o_proj has no bias."""
        return False


@dataclass
class DeepseekV3Config(DecoderConfig):
    """DeepSeek-V3 (HF DeepseekV3Config field names): MLA, DeepSeekMoE, MTP."""

    model_type: ClassVar[str] = "deepseek_v3"
    architecture: ClassVar[str] = "DeepseekV3ForCausalLM"

    bos_token_id: int | None = 0
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = 1
    """End-of-sequence token id(s)."""
    q_lora_rank: int | None = 1536
    """Rank of the low-rank query (None: a full q_proj)."""
    kv_lora_rank: int = 512
    """Width of the compressed KV latent that is cached."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with RoPE; the rope key of this width is shared by all heads."""
    v_head_dim: int = 128
    """Per-head value width."""
    moe_intermediate_size: int = 2048
    """Width of each routed and shared expert."""
    n_routed_experts: int = 256
    """Routed experts per MoE layer."""
    n_shared_experts: int = 1
    """Shared experts (one SwiGLU of n_shared_experts * moe_intermediate_size)."""
    num_experts_per_tok: int = 8
    """Routed experts chosen per token (top-k)."""
    n_group: int = 8
    """Expert groups for group-limited routing."""
    topk_group: int = 4
    """Groups a token may route into."""
    first_k_dense_replace: int = 3
    """The first layers use a dense MLP instead of MoE."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1."""
    routed_scaling_factor: float = 2.5
    """Multiplier on the routing weights."""
    scoring_func: str = "sigmoid"
    """Gate score function; DeepSeek-V3 uses sigmoid."""
    topk_method: str = "noaux_tc"
    """Routing method; noaux_tc = bias for selection only, group-limited top-k."""
    num_nextn_predict_layers: int = 1
    """MTP modules, stored as layers num_hidden_layers, num_hidden_layers + 1, ..."""
    rope_interleave: bool = True
    """RoPE rotates interleaved pairs (x0, x1), (x2, x3)... as DeepSeek's checkpoints expect."""

    def validate(self) -> None:
        """Common checks plus the MoE/MLA ones."""
        super().validate()
        if self.n_routed_experts % self.n_group:
            raise ModelError(f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}")
        if not 0 < self.topk_group <= self.n_group:
            raise ModelError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            raise ModelError(f"{per_group} expert per group; group scores take the top-2 of each group")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.topk_group * per_group} "
                "experts in topk_group groups"
            )
        if self.scoring_func != "sigmoid":
            raise ModelError(f"scoring_func={self.scoring_func!r}; only 'sigmoid' (DeepSeek-V3) is implemented")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ModelError("MLA has one key per query head: num_key_value_heads must equal num_attention_heads")
        if self.qk_rope_head_dim % 2:
            raise ModelError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def rope_dim(self) -> int:
        """RoPE rotates the qk_rope_head_dim part only."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek and HF)."""
        scale = self.qk_head_dim**-0.5
        params = self.rope_scaling or {}
        if self.rope_type == "yarn" and params.get("mscale_all_dim"):
            m = yarn_mscale(params["factor"], params["mscale_all_dim"])
            scale *= m * m
        return scale

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` (MTP layers included) uses MoE rather than a dense MLP."""
        return index >= self.first_k_dense_replace


CONFIG_CLASSES: dict[str, type[DecoderConfig]] = {c.model_type: c for c in (LlamaConfig, Qwen2Config, DeepseekV3Config)}


def config_from_dict(data: dict[str, Any]) -> DecoderConfig:
    """Build the config class named by data['model_type']."""
    if not isinstance(data, dict):
        raise ModelError(f"a config is a JSON object of fields, not a {type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_CLASSES:
        raise ModelError(f"model_type {model_type!r} is not supported; expected one of {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[model_type].from_dict(data)


def load_config(path: str | os.PathLike) -> DecoderConfig:
    """Read config.json from a directory (or the file itself), at most MS_MODELS_MAX_CONFIG_BYTES;
    a missing, non-UTF-8 or invalid file, or a bad field, is a ModelError naming it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.lexists(path):
        raise ModelError(f"no config.json at {path!r}")
    return config_from_dict(read_config_json(path, "config"))


def read_config_json(path: str, what: str) -> Any:
    """A JSON file of a checkpoint (config, index, manifest) within MS_MODELS_MAX_CONFIG_BYTES;
    missing, too large, non-UTF-8 or invalid: a ModelError naming the file."""
    if not os.path.exists(path):
        raise ModelError(f"{what} {path!r} does not exist")
    if os.path.isfile(path):
        MAX_CONFIG_BYTES.check(os.path.getsize(path), f"size of {path}", error=ModelError)
    try:
        return read_json(path, what, max_bytes=MAX_CONFIG_BYTES.value)
    except FileError as exc:
        raise ModelError(str(exc)) from None
