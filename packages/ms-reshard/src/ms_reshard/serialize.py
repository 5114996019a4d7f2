"""Plans as plain data and msgpack bytes, in ms-layout's versioned envelope.

``ms_layout.dumps(plan)`` / ``ms_layout.loads(blob)`` work once ms_reshard is imported (the kinds
"ReshardPlan" and "ModelPlan" are registered with ms_layout.serialization). Arrays travel as
little-endian int64 bytes with their shape, so a 4096-rank plan is a few compact byte strings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ms_layout import Layout, LayoutError, dumps, loads
from ms_layout.serialization import register

from .errors import ReshardError
from .plan import Collective, OpKind, TensorPlan

PLAN_VERSION = 1


def _arr(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, dtype="<i8")
    return {"shape": list(a.shape), "data": a.tobytes()}


def _unarr(d: dict) -> np.ndarray:
    return np.frombuffer(d["data"], dtype="<i8").reshape(d["shape"]).astype(np.int64)


def plan_to_dict(plan: TensorPlan) -> dict:
    """Plain data (msgpack-able: ints, strings, lists, bytes) of a TensorPlan."""
    return {
        "version": PLAN_VERSION,
        "src": plan.src.to_dict(),
        "dst": plan.dst.to_dict(),
        "shape": list(plan.shape),
        "itemsize": plan.itemsize,
        "mem_cap": plan.mem_cap,
        "ranks": _arr(plan.ranks),
        "copy": {"id": _arr(plan.copy_id), "box": _arr(plan.copy_box)},
        "xfer": {
            "src": _arr(plan.xfer_src),
            "dst": _arr(plan.xfer_dst),
            "round": _arr(plan.xfer_round),
            "box": _arr(plan.xfer_box),
        },
        "collectives": [
            {
                "kind": c.kind.value,
                "members": list(c.members),
                "boxes": _arr(c.boxes),
                "elems": c.elems,
                "round": c.round,
            }
            for c in plan.collectives
        ],
        "bytes": {"sent": _arr(plan.sent), "received": _arr(plan.received), "lower_bound": _arr(plan.lower_bound)},
        "rounds": plan.rounds,
        "notes": list(plan.notes),
    }


def plan_from_dict(d: Any) -> TensorPlan:
    """Inverse of plan_to_dict; anything malformed is a ReshardError."""
    try:
        if d["version"] > PLAN_VERSION:
            raise ReshardError(f"plan version {d['version']} is newer than this reader ({PLAN_VERSION})")
        cols = tuple(
            Collective(OpKind(c["kind"]), tuple(c["members"]), _unarr(c["boxes"]), int(c["elems"]), int(c["round"]))
            for c in d["collectives"]
        )
        return TensorPlan(
            Layout.from_dict(d["src"]),
            Layout.from_dict(d["dst"]),
            tuple(d["shape"]),
            int(d["itemsize"]),
            d["mem_cap"],
            _unarr(d["ranks"]),
            _unarr(d["copy"]["id"]),
            _unarr(d["copy"]["box"]),
            _unarr(d["xfer"]["src"]),
            _unarr(d["xfer"]["dst"]),
            _unarr(d["xfer"]["round"]),
            _unarr(d["xfer"]["box"]),
            cols,
            _unarr(d["bytes"]["sent"]),
            _unarr(d["bytes"]["received"]),
            _unarr(d["bytes"]["lower_bound"]),
            int(d["rounds"]),
            tuple(d["notes"]),
        )
    except ReshardError:
        raise
    except (KeyError, TypeError, ValueError, LayoutError) as exc:
        raise ReshardError(f"not a reshard plan ({type(exc).__name__}: {exc})") from None


def plan_to_bytes(plan: TensorPlan) -> bytes:
    """msgpack bytes in ms-layout's envelope (kind "ReshardPlan")."""
    return dumps(plan)


def plan_from_bytes(blob: bytes) -> TensorPlan:
    """Read bytes written by plan_to_bytes."""
    try:
        return loads(blob, expect="ReshardPlan")
    except LayoutError as exc:
        raise ReshardError(str(exc)) from None


def _spec_to_dict(spec) -> dict:
    return {
        "layout": spec.layout.to_dict(),
        "shape": list(spec.shape),
        "dtype": spec.dtype,
        "parts": list(spec.parts),
        "part_dim": spec.part_dim,
    }


def model_plan_to_dict(mp) -> dict:
    """Plain data of a ModelPlan; a TensorPlan shared by several moves is stored once."""
    index: dict[int, int] = {}
    plans = []
    moves = []
    for m in mp.moves:
        if id(m.plan) not in index:
            index[id(m.plan)] = len(plans)
            plans.append(plan_to_dict(m.plan))
        moves.append([m.src_name, m.dst_name, m.dim, m.src_offset, m.dst_offset, index[id(m.plan)]])
    return {
        "version": PLAN_VERSION,
        "src": {n: _spec_to_dict(s) for n, s in mp.src.items()},
        "dst": {n: _spec_to_dict(s) for n, s in mp.dst.items()},
        "plans": plans,
        "moves": moves,
        "unused": list(mp.unused),
    }


def model_plan_from_dict(d: Any):
    """Inverse of model_plan_to_dict; anything malformed is a ReshardError."""
    from .model_plan import ModelPlan, ParamSpec, PartMove

    try:
        if d["version"] > PLAN_VERSION:
            raise ReshardError(f"model plan version {d['version']} is newer than this reader ({PLAN_VERSION})")

        def spec(x: dict) -> ParamSpec:
            layout = Layout.from_dict(x["layout"])
            return ParamSpec(layout, tuple(x["shape"]), x["dtype"], tuple(x["parts"]), int(x["part_dim"]))

        plans = [plan_from_dict(p) for p in d["plans"]]
        moves = tuple(PartMove(a, b, int(c), int(e), int(f), plans[i]) for a, b, c, e, f, i in d["moves"])
        src = {n: spec(x) for n, x in d["src"].items()}
        dst = {n: spec(x) for n, x in d["dst"].items()}
        return ModelPlan(src, dst, moves, tuple(d["unused"]))
    except ReshardError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, LayoutError) as exc:
        raise ReshardError(f"not a model plan ({type(exc).__name__}: {exc})") from None


def _register() -> None:
    from .model_plan import ModelPlan

    register("ReshardPlan", TensorPlan, plan_to_dict, plan_from_dict)
    register("ModelPlan", ModelPlan, model_plan_to_dict, model_plan_from_dict)


_register()
