"""Plans as plain data and msgpack bytes, in ms-layout's versioned envelope.

``ms_layout.dumps(plan)`` / ``ms_layout.loads(blob)`` work once ms_reshard is imported (the kinds
"ReshardPlan" and "ModelPlan" are registered with ms_layout.serialization). Arrays travel as
little-endian int64 bytes with their shape, so a 4096-rank plan is a few compact byte strings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ms_layout import LayoutError, dumps, loads
from ms_layout.serialization import register

from .errors import ReshardError
from .limits import check_shape, is_int, short_repr
from .manifest import parse_layout_data
from .multicast import Multicast
from .plan import Collective, OpKind, TensorPlan

PLAN_VERSION = 2
"""2 added the multicast section (version 1 plans read as plans without multicasts)."""
_MULTICAST_ROWS = ("src", "target_chunk", "source_chunk", "lo", "hi")


def _arr(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a, dtype="<i8")
    return {"shape": list(a.shape), "data": a.tobytes()}


def _unarr(d: Any, what: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """An int64 array from {shape, data}; `shape` is what it must be (None: any length)."""
    if not isinstance(d, dict) or not isinstance(d.get("data"), bytes):
        raise ReshardError(f"plan field {what} = {short_repr(d)}; expected {{shape, data: bytes}}")
    dims = d.get("shape")
    if not isinstance(dims, list) or not all(is_int(n) and n >= 0 for n in dims) or len(dims) > 8:
        raise ReshardError(f"plan field {what}.shape = {short_repr(dims)}; expected a list of non-negative ints")
    if math.prod(dims) * 8 != len(d["data"]):
        need, have = math.prod(dims) * 8, len(d["data"])
        raise ReshardError(f"plan field {what}: shape {dims} needs {need} bytes, its data has {have}")
    if len(dims) != len(shape) or any(w is not None and w != n for n, w in zip(dims, shape)):
        want = ["*" if w is None else w for w in shape]
        raise ReshardError(f"plan field {what} has shape {dims}; expected {want}")
    return np.frombuffer(d["data"], dtype="<i8").reshape(dims).astype(np.int64)


def _int(value: Any, what: str, lo: int = 0) -> int:
    if not is_int(value) or value < lo or value >= 1 << 62:
        raise ReshardError(f"plan field {what} = {short_repr(value)}; expected an int >= {lo}")
    return value


def _ids(a: np.ndarray, n: int, what: str, lo: int = 0) -> np.ndarray:
    if a.size and (a.min() < lo or a.max() >= n):
        raise ReshardError(f"plan field {what} holds ids outside {lo}..{n - 1}")
    return a


def _version(d: Any, what: str) -> None:
    if not isinstance(d, dict):
        raise ReshardError(f"not a {what}: a {type(d).__name__}, expected a map")
    version = d.get("version")
    if not is_int(version) or not 1 <= version <= PLAN_VERSION:
        raise ReshardError(f"{what} version {short_repr(version)}; this reader knows 1..{PLAN_VERSION}")


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
        "multicast": None if plan.multicast is None else _multicast_to_dict(plan.multicast),
    }


def _multicast_to_dict(mc: Multicast) -> dict:
    out = {k: _arr(getattr(mc, k)) for k in _MULTICAST_ROWS}
    out |= {"box": _arr(mc.box), "dst_chunk": _arr(mc.dst_chunk), "src_chunk": _arr(mc.src_chunk)}
    return out


def _multicast(d: Any, n: int, nd: int, dst_chunks: int, src_chunks: int) -> Multicast | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ReshardError(f"plan field multicast = {short_repr(d)}; expected a map or nil")
    src = _ids(_unarr(d.get("src"), "multicast.src", (None,)), n, "multicast.src")
    m = len(src)
    rows = {k: _unarr(d.get(k), f"multicast.{k}", (m,)) for k in _MULTICAST_ROWS[1:]}
    box = _unarr(d.get("box"), "multicast.box", (m, nd, 2))
    dst_chunk = _ids(_unarr(d.get("dst_chunk"), "multicast.dst_chunk", (n,)), dst_chunks, "multicast.dst_chunk", -1)
    src_chunk = _ids(_unarr(d.get("src_chunk"), "multicast.src_chunk", (n,)), src_chunks, "multicast.src_chunk", -1)
    _ids(rows["target_chunk"], dst_chunks, "multicast.target_chunk")
    _ids(rows["source_chunk"], src_chunks, "multicast.source_chunk")
    replicas = np.bincount(dst_chunk[dst_chunk >= 0], minlength=dst_chunks)
    lo, hi = rows["lo"], rows["hi"]
    if m and ((lo < 0).any() or (hi <= lo).any() or (hi > replicas[rows["target_chunk"]]).any()):
        raise ReshardError("plan field multicast holds receiver ranges outside their target chunk's replicas")
    return Multicast(src, box, rows["target_chunk"], rows["source_chunk"], lo, hi, dst_chunk, src_chunk)


def plan_from_dict(d: Any) -> TensorPlan:
    """Inverse of plan_to_dict; anything malformed is a ReshardError naming the field.

    Every field is checked for its type, every array for its shape and every id for its range, so
    a plan read from bytes can be printed and validated (validate.py) without other errors."""
    _version(d, "reshard plan")
    src = parse_layout_data(d.get("src"), "plan field src")
    dst = parse_layout_data(d.get("dst"), "plan field dst")
    itemsize = _int(d.get("itemsize"), "itemsize", 1)
    shape = check_shape(d.get("shape"), itemsize, "plan field shape")
    for side, layout in (("src", src), ("dst", dst)):
        try:
            layout.shard_shape(shape)
        except LayoutError as exc:
            raise ReshardError(f"plan field {side} cannot hold shape {list(shape)}: {exc}") from None
    mem_cap = d.get("mem_cap")
    if mem_cap is not None:
        _int(mem_cap, "mem_cap", 1)
    ranks = _unarr(d.get("ranks"), "ranks", (None,))
    if ranks.size and (ranks.min() < 0 or (np.diff(ranks) <= 0).any()):
        raise ReshardError("plan field ranks must be ascending distinct non-negative ranks")
    n, nd = len(ranks), len(shape)
    copy, xfer, nbytes = (_section(d, k) for k in ("copy", "xfer", "bytes"))
    copy_id = _ids(_unarr(copy.get("id"), "copy.id", (None,)), n, "copy.id")
    copy_box = _unarr(copy.get("box"), "copy.box", (len(copy_id), nd, 2))
    xfer_src = _ids(_unarr(xfer.get("src"), "xfer.src", (None,)), n, "xfer.src")
    m = len(xfer_src)
    xfer_dst = _ids(_unarr(xfer.get("dst"), "xfer.dst", (m,)), n, "xfer.dst")
    xfer_round = _unarr(xfer.get("round"), "xfer.round", (m,))
    xfer_box = _unarr(xfer.get("box"), "xfer.box", (m, nd, 2))
    counts = [_unarr(nbytes.get(k), f"bytes.{k}", (n,)) for k in ("sent", "received", "lower_bound")]
    if not isinstance(d.get("collectives"), list):
        raise ReshardError(f"plan field collectives = {short_repr(d.get('collectives'))}; expected a list")
    cols = tuple(_collective(c, i, n, nd) for i, c in enumerate(d["collectives"]))
    notes = d.get("notes")
    if not isinstance(notes, list) or not all(isinstance(s, str) for s in notes):
        raise ReshardError(f"plan field notes = {short_repr(notes)}; expected a list of strings")
    rounds = _int(d.get("rounds"), "rounds", 1)
    mc = _multicast(d.get("multicast"), n, nd, math.prod(dst.splits), math.prod(src.splits))
    if (xfer_round.size and (xfer_round.min() < 0 or xfer_round.max() >= rounds)) or any(
        c.round >= rounds for c in cols
    ):
        raise ReshardError(f"plan holds rounds outside 0..{rounds - 1}")
    return TensorPlan(
        src, dst, shape, itemsize, mem_cap, ranks, copy_id, copy_box, xfer_src, xfer_dst, xfer_round, xfer_box,
        cols, *counts, rounds, tuple(notes), mc,
    )  # fmt: skip


def _section(d: dict, key: str) -> dict:
    if not isinstance(d.get(key), dict):
        raise ReshardError(f"plan field {key} = {short_repr(d.get(key))}; expected a map")
    return d[key]


def _collective(c: Any, i: int, n: int, nd: int) -> Collective:
    what = f"collectives[{i}]"
    if not isinstance(c, dict):
        raise ReshardError(f"plan field {what} = {short_repr(c)}; expected a map")
    try:
        kind = OpKind(c.get("kind"))
    except ValueError:
        kind_text = short_repr(c.get("kind"))
        raise ReshardError(f"plan field {what}.kind = {kind_text}; expected all_gather or all_to_all") from None
    members = c.get("members")
    if kind not in (OpKind.ALL_GATHER, OpKind.ALL_TO_ALL) or not isinstance(members, list) or len(members) < 2:
        raise ReshardError(f"plan field {what}: kind {kind.value!r} with members {short_repr(members)}")
    if not all(is_int(m) and 0 <= m < n for m in members) or sorted(set(members)) != members:
        raise ReshardError(f"plan field {what}.members = {short_repr(members)}; expected ascending ids in 0..{n - 1}")
    k = len(members)
    box_shape = (k, nd, 2) if kind is OpKind.ALL_GATHER else (k, k, nd, 2)
    boxes = _unarr(c.get("boxes"), f"{what}.boxes", box_shape)
    elems, rnd = _int(c.get("elems"), f"{what}.elems"), _int(c.get("round"), f"{what}.round")
    return Collective(kind, tuple(members), boxes, elems, rnd)


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
    """Inverse of model_plan_to_dict; anything malformed is a ReshardError naming the field."""
    from .model_plan import ModelPlan, PartMove

    _version(d, "model plan")
    plans_data, moves_data, unused = d.get("plans"), d.get("moves"), d.get("unused")
    if not isinstance(plans_data, list) or not isinstance(moves_data, list):
        raise ReshardError("model plan needs lists 'plans' and 'moves'")
    if not isinstance(unused, list) or not all(isinstance(u, str) for u in unused):
        raise ReshardError(f"model plan field unused = {short_repr(unused)}; expected a list of names")
    plans = [plan_from_dict(p) for p in plans_data]
    src, dst = _specs(d.get("src"), "src"), _specs(d.get("dst"), "dst")
    moves = []
    for k, m in enumerate(moves_data):
        if (
            not isinstance(m, list)
            or len(m) != 6
            or not all(isinstance(x, str) for x in m[:2])
            or not all(is_int(x) and x >= 0 for x in m[2:])
        ):
            expected = "[src name, dst name, dim, src offset, dst offset, plan index]"
            raise ReshardError(f"model plan field moves[{k}] = {short_repr(m)}; expected {expected}")
        a, b, dim, src_off, dst_off, i = m
        if a not in src or b not in dst or i >= len(plans):
            raise ReshardError(f"model plan field moves[{k}] = {short_repr(m)} names an unknown parameter or plan")
        moves.append(PartMove(a, b, dim, src_off, dst_off, plans[i]))
    return ModelPlan(src, dst, tuple(moves), tuple(unused))


def _specs(data: Any, side: str) -> dict:
    from .model_plan import ITEMSIZE, ParamSpec

    if not isinstance(data, dict):
        raise ReshardError(f"model plan field {side} = {short_repr(data)}; expected a map of parameter specs")
    out = {}
    for name, x in data.items():
        what = f"model plan field {side}[{name!r}]"
        if not isinstance(name, str) or not isinstance(x, dict):
            raise ReshardError(f"{what} = {short_repr(x)}; expected a parameter spec")
        if not isinstance(x.get("dtype"), str) or x["dtype"] not in ITEMSIZE:
            raise ReshardError(f"{what}.dtype = {short_repr(x.get('dtype'))}; expected one of {sorted(ITEMSIZE)}")
        shape = check_shape(x.get("shape"), ITEMSIZE[x["dtype"]], f"{what}.shape")
        layout = parse_layout_data(x.get("layout"), f"{what}.layout")
        parts, part_dim = x.get("parts"), x.get("part_dim")
        if not isinstance(parts, list) or not all(is_int(p) and p >= 0 for p in parts) or not is_int(part_dim):
            raise ReshardError(f"{what}: parts = {short_repr(parts)}, part_dim = {short_repr(part_dim)}")
        out[name] = ParamSpec(layout, shape, x["dtype"], tuple(parts), part_dim)
    return out


def _register() -> None:
    from .model_plan import ModelPlan

    register("ReshardPlan", TensorPlan, plan_to_dict, plan_from_dict)
    register("ModelPlan", ModelPlan, model_plan_to_dict, model_plan_from_dict)


_register()
