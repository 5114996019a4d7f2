"""PackPlan and Assignment in ms-layout's versioned msgpack envelope, when ms-layout is installed.

``ms_layout.dumps(plan)`` / ``ms_layout.loads(blob)`` then work for the kinds "PackPlan" and
"Assignment" (their to_dict carries its own version field too). ``from_dict`` checks every field's
type, so a damaged or hostile blob is a LayoutError (carrying the RLHFError that names the field).
Without ms-layout nothing is registered and ``to_dict``/``from_dict`` remain available.
"""

from __future__ import annotations

from .packing import PackPlan
from .sampling import Assignment


def register() -> bool:
    """Register the kinds with ms_layout.serialization; False when ms-layout is not installed."""
    try:
        from ms_layout.serialization import register as _register
    except ImportError:
        return False
    _register("PackPlan", PackPlan, PackPlan.to_dict, PackPlan.from_dict)
    _register("Assignment", Assignment, Assignment.to_dict, Assignment.from_dict)
    return True
