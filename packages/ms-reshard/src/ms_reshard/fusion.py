"""Declared fusions: parameters one side stores as separate tensors and the other as one fused tensor.

A rule is data -- the fused module name, the part module names in order, and the dim they are
stacked along -- so a new model family needs a new rule, not new code. The fused tensor is what
fused tensor-parallel layers hold (vLLM's QKVParallelLinear and MergedColumnParallelLinear,
Megatron's fused linear_qkv): every rank's fused shard is the concatenation of that rank's shards
of the parts, so each part is resharded on its own with the fused tensor's layout and written at
its offset inside the fused shard. (A fused tensor split as one contiguous global tensor would put
all of q on the first ranks and none of v: not what any engine does.)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from .errors import ReshardError


@dataclass(frozen=True)
class FusionRule:
    """Module `fused` holds modules `parts`, in order, concatenated along `dim` on every rank."""

    fused: str
    """Module name of the fused tensor, e.g. "qkv_proj"."""
    parts: tuple[str, ...]
    """Module names of the parts, in the order they sit in the fused tensor."""
    dim: int = 0
    """Tensor dim the parts are concatenated along (0: output features of a linear)."""

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        object.__setattr__(self, "parts", parts)
        names = (self.fused, *parts)
        if len(parts) < 2 or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ReshardError(f"fusion rule {self.fused!r} <- {list(parts)} needs 2+ distinct non-empty part names")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ReshardError(f"fusion rule {self.fused!r}: dim={self.dim!r} must be a non-negative int")


DEFAULT_FUSIONS: tuple[FusionRule, ...] = (
    FusionRule("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusionRule("gate_up_proj", ("gate_proj", "up_proj")),
)
"""Llama/Qwen-style attention and MLP fusions, as vLLM names them."""

_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<module>[^.]+)\.(?P<leaf>[^.]+)$")


def rules_from_data(data: Iterable[Mapping]) -> tuple[FusionRule, ...]:
    """Rules from plain data: [{"fused": "qkv_proj", "parts": ["q_proj", "k_proj", "v_proj"], "dim": 0}]."""
    if not isinstance(data, (list, tuple)):
        raise ReshardError(f"fusion rules must be a list of rule objects, got {type(data).__name__}")
    out = []
    for item in data:
        if not isinstance(item, Mapping):
            raise ReshardError(f"bad fusion rule {item!r:.80}: expected an object {{fused, parts, dim}}")
        fused, parts = item.get("fused"), item.get("parts")
        if not isinstance(fused, str) or not isinstance(parts, (list, tuple)):
            raise ReshardError(f"bad fusion rule {item!r:.80}: needs 'fused' (a name) and 'parts' (a list of names)")
        out.append(FusionRule(fused, tuple(parts), item.get("dim", 0)))
    return tuple(out)


def load_rules(path: str) -> tuple[FusionRule, ...]:
    """Rules from a JSON file holding a list of rule objects."""
    from ms_layout.files import FileError, read_json

    from .limits import MAX_SPEC_FILE_BYTES

    try:
        data = read_json(path, "fusion rules file", max_bytes=MAX_SPEC_FILE_BYTES.value)
    except FileError as exc:
        raise ReshardError(str(exc)) from None
    return rules_from_data(data)


def rules_to_data(rules: Sequence[FusionRule]) -> list[dict]:
    """Inverse of rules_from_data."""
    return [{**asdict(r), "parts": list(r.parts)} for r in rules]


def split_name(name: str) -> tuple[str, str, str] | None:
    """("model.layers.0.self_attn.", "q_proj", "weight") for a dotted parameter name."""
    m = _NAME.match(name)
    return (m["prefix"], m["module"], m["leaf"]) if m else None


def fused_name(name: str, rules: Sequence[FusionRule]) -> tuple[str, FusionRule, int] | None:
    """If `name` is a part of a rule: (the fused parameter's name, the rule, the part's index)."""
    parsed = split_name(name)
    if parsed is None:
        return None
    prefix, module, leaf = parsed
    for rule in rules:
        if module in rule.parts:
            return f"{prefix}{rule.fused}.{leaf}", rule, rule.parts.index(module)
    return None


def part_names(name: str, rules: Sequence[FusionRule]) -> tuple[list[str], FusionRule] | None:
    """If `name` is a fused parameter of a rule: (its parts' names in order, the rule)."""
    parsed = split_name(name)
    if parsed is None:
        return None
    prefix, module, leaf = parsed
    for rule in rules:
        if module == rule.fused:
            return [f"{prefix}{p}.{leaf}" for p in rule.parts], rule
    return None


def fuse_shapes(
    shapes: Mapping[str, Sequence[int]], rules: Sequence[FusionRule]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """{name: (shape, part sizes, part dim)} after fusing every complete group of parts; names that
    are not fused (a lone part included) get part sizes ()."""
    if not rules:
        return {name: (tuple(shape), (), 0) for name, shape in shapes.items()}
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
    groups: dict[str, dict[int, str]] = {}
    # Parsed once per name, and only names whose module (the second-last dotted component, what
    # split_name gives when it parses) is some rule's part: a model of 45k names has few of those.
    modules = {part for rule in rules for part in rule.parts}
    hits = {}
    for name in shapes:
        pieces = name.rsplit(".", 2)
        if len(pieces) > 1 and pieces[-2] in modules:
            hit = hits[name] = fused_name(name, rules)
            if hit:
                groups.setdefault(hit[0], {})[hit[2]] = name
    for name, shape in shapes.items():
        hit = hits.get(name)
        if hit is None or len(groups[hit[0]]) < len(hit[1].parts):
            out[name] = (tuple(shape), (), 0)
        elif hit[2] == 0:
            rule = hit[1]
            parts = [tuple(shapes[groups[hit[0]][i]]) for i in range(len(rule.parts))]
            sizes = tuple(p[rule.dim] if rule.dim < len(p) else 0 for p in parts)
            out[hit[0]] = (concat_shape(parts, rule.dim, hit[0]), sizes, rule.dim)
    return out


def concat_shape(parts: Sequence[tuple[int, ...]], dim: int, name: str) -> tuple[int, ...]:
    """Shape of parts concatenated along `dim`; they must agree on every other dim."""
    first = parts[0]
    for p in parts:
        if len(p) != len(first) or dim >= len(p) or any(a != b for i, (a, b) in enumerate(zip(p, first)) if i != dim):
            raise ReshardError(f"parts of {name!r} have shapes {[list(s) for s in parts]}; they differ off dim {dim}")
    return tuple(sum(p[dim] for p in parts) if i == dim else n for i, n in enumerate(first))
