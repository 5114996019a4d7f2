"""msprobe's item and data names, built and parsed.

Module items (level L0): `{Prefix}.{path}.{Class}.{forward|backward}.{n}` with Prefix `Cell`
(MindSpore) or `Module` (PyTorch). API items (level mix/L1): `{Prefix}.{api}.{n}.{forward|backward}`:
the call index comes before the direction, unlike modules. Parameter gradients:
`{Prefix}.{path}.{Class}.parameters_grad.{n}`. A data item appends its key to the item name:
`.input.0`, `.input.hidden_states`, `.input.1.2` (nested), `.output.0`, `.parameters.weight`, or the
parameter name for gradients. Tensor files in `dump_tensor_data/` are `{data item}.npy`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MODULE_PREFIXES = ("Cell", "Module")
# Call indices of at most 15 digits: a longer run of digits (hand-written input) is no call index.
_MODULE_RE = re.compile(r"^(Cell|Module)\.(.+)\.([^.]+)\.(forward|backward)\.(\d{1,15})$")
_PGRAD_RE = re.compile(r"^(Cell|Module)\.(.+)\.([^.]+)\.parameters_grad(?:\.(\d{1,15}))?$")
_API_RE = re.compile(r"^([A-Za-z]+)\.(.+)\.(\d{1,15})\.(forward|backward)$")


@dataclass(frozen=True)
class ItemName:
    """A parsed item name."""

    kind: str
    """"module", "api" or "param_grad"."""
    prefix: str
    """Cell/Module for modules, Functional/Tensor/Torch/Mint/... for APIs."""
    path: str
    """Module path (`model.layers.0.mlp`) or API name (`matmul`)."""
    cls: str
    """Module class name ("" for APIs)."""
    direction: str
    """"forward" or "backward" (param grads are "backward")."""
    index: int
    """Call index within the step."""

    @property
    def text(self) -> str:
        """The name as written in dump.json."""
        if self.kind == "module":
            return f"{self.prefix}.{self.path}.{self.cls}.{self.direction}.{self.index}"
        if self.kind == "param_grad":
            return f"{self.prefix}.{self.path}.{self.cls}.parameters_grad.{self.index}"
        return f"{self.prefix}.{self.path}.{self.index}.{self.direction}"


def module_item(prefix: str, path: str, cls: str, direction: str, index: int) -> str:
    """`Cell.model.layers.0.mlp.MLP.forward.0`."""
    return f"{prefix}.{path}.{cls}.{direction}.{index}"


def param_grad_item(prefix: str, path: str, cls: str, index: int) -> str:
    """`Cell.model.norm.RMSNorm.parameters_grad.0`."""
    return f"{prefix}.{path}.{cls}.parameters_grad.{index}"


def api_item(prefix: str, api: str, index: int, direction: str = "forward") -> str:
    """`Functional.matmul.3.forward`."""
    return f"{prefix}.{api}.{index}.{direction}"


def parse_item(name: str) -> ItemName | None:
    """Parse an item name; None when it follows none of msprobe's forms."""
    m = _PGRAD_RE.match(name)
    if m:
        return ItemName("param_grad", m[1], m[2], m[3], "backward", int(m[4] or 0))
    m = _MODULE_RE.match(name)
    if m:
        return ItemName("module", m[1], m[2], m[3], m[4], int(m[5]))
    m = _API_RE.match(name)
    if m:
        return ItemName("api", m[1], m[2], "", m[4], int(m[3]))
    return None
