"""A compare exported for MindStudio's graph visualizer: the SQLite `.vis.db` of msprobe's `graph_visualize`.

msprobe (since 8.2.1) writes a compare of two dumps as one SQLite file that its TensorBoard plugin
reads (`tensorboard --logdir DIR`, tab GRAPH_ASCEND: it scans DIR for `*.vis.db`). This module
writes the same tables from an ms-probe compare, so that what ms-probe matched (through a name
mapping, data-layout rules, merged pipeline ranks) is what the visualizer shows:

- `tb_nodes`: one row per module call, API call and parameter-gradient item of each side, in a
  tree under the root `DefaultModel` (the dump's construct.json parents). The target is the
  `NPU` graph, the golden the `Bench` graph, ids `{side}_{step}_{rank}_{name}`. `input_data` and
  `output_data` hold each tensor's statistics as strings and, on the target side, the compare's
  metrics, `Result` and `Err_message` (msprobe's CSV columns). `matched_node_link` is the path
  from the root to the counterpart in the other graph. `precision_index` colours a target node by
  ms-probe's verdict: 0 pass, 0.45 warning, 1 error (msprobe's buckets [0, 0.3), [0.3, 0.6),
  [0.6, 1]); unmatched and skipped items have none (grey). `micro_step_id` is the microbatch of a
  pipelined dump's item (on the golden side, that of its counterpart).
- `tb_stack`: the call stacks, shared by id (a backward item shows its forward's stack).
- `tb_config`: one row: compare, the dump mode, the colour legend, the ranks and steps.

The columns, their types and the indexes are those of msprobe 26.2.0's output (`msprobe
graph_visualize` on two ms-probe dumps writes the same tree: docs/ms-probe.md, Graph visualizer).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from .compare import CompareRun, RankCompare
from .reader import DumpItem, RankDump

ROOT = "DefaultModel"
NODE_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "graph_id": "TEXT NOT NULL", "node_order": "INTEGER NOT NULL",
    "node_name": "TEXT NOT NULL", "node_type": "TEXT NOT NULL", "up_node": "TEXT", "sub_nodes": "TEXT",
    "precision_index": "INTEGER", "overflow_level": "TEXT", "micro_step_id": "INTEGER NOT NULL",
    "matched_node_link": "TEXT", "stack_id": "TEXT", "parallel_merge_info": "TEXT", "matched_distributed": "TEXT",
    "modified": "INTEGER NOT NULL", "input_data": "TEXT", "output_data": "TEXT", "data_source": "TEXT",
    "dump_data_dir": "TEXT", "step": "INTEGER NOT NULL", "rank": "INTEGER NOT NULL", "is_distributed": "INTEGER",
}  # fmt: skip
CONFIG_COLUMNS = {
    "id": "TEXT PRIMARY KEY", "graph_type": "TEXT NOT NULL", "task": "TEXT", "tool_tip": "TEXT",
    "micro_steps": "INTEGER", "overflow_check": "INTEGER", "node_colors": "TEXT NOT NULL",
    "rank_list": "TEXT NOT NULL", "step_list": "TEXT NOT NULL",
}  # fmt: skip
STACK_COLUMNS = {"id": "TEXT PRIMARY KEY", "stack_info": "TEXT"}
INDEXES = {
    "index1": ["step", "rank", "data_source", "up_node", "node_order"],
    "index2": ["step", "rank", "data_source", "node_name"],
    "index3": ["step", "rank", "data_source", "node_order"],
    "index4": ["step", "rank", "node_order"],
    "index5": ["step", "rank", "micro_step_id", "node_order"],
    "index6": ["step", "rank", "modified", "matched_node_link"],
    "index7": ["is_distributed"],
}
PRECISION = {"pass": 0.0, "warning": 0.45, "error": 1.0}
"""ms-probe's verdict of a target node -> its precision_index (msprobe's colour buckets)."""
_DESCRIPTION = "deviation of this node's inputs and outputs from the golden; darker is larger"
NODE_COLORS = {
    "#FFFCF3": {"value": [0, 0.3], "description": _DESCRIPTION, "accuracy_level": "pass"},
    "#FFDC7F": {"value": [0.3, 0.6], "description": _DESCRIPTION, "accuracy_level": "warning"},
    "#FF704D": {"value": [0.6, 1], "description": _DESCRIPTION, "accuracy_level": "error"},
    "#C7C7C7": {"value": [], "description": "no counterpart in the other dump", "accuracy_level": "unmatched node"},
}
TOOL_TIP = {
    "Max diff": "target max - golden max", "Min diff": "target min - golden min",
    "Mean diff": "target mean - golden mean", "L2norm diff": "target L2 norm - golden L2 norm",
    "Cosine": "cosine similarity of the two tensors", "MaxAbsErr": "largest absolute elementwise difference",
    "One Thousandth Err Ratio": "share of elements within 0.1 % relative error",
}  # fmt: skip
_MODE_TASK = {"statistics": "summary", "tensor": "all", "md5": "md5"}
_METRIC_KEYS = (
    "Max diff", "Min diff", "Mean diff", "L2norm diff", "MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr",
    "NormRelativeErr", "Cosine", "EucDist", "MaxAbsErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio",
    "Requires_grad Consistent", "Result", "Err_message",
)  # fmt: skip


def _text(value: Any) -> str:
    """msprobe's node data are strings ("null" for None)."""
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


class _Graph:
    """One side's tree: names, parents, children in completion order, post-order numbering."""

    def __init__(self, dump: RankDump):
        self.items: dict[str, DumpItem] = dump.items
        self.parent: dict[str, str] = {}
        self.children: dict[str, list[str]] = {ROOT: []}
        for name in sorted(self.items, key=lambda n: self.items[n].order):
            parent = self.items[name].parent
            parent = parent if parent and parent != name else ROOT
            if parent != ROOT and parent not in self.items and parent not in self.parent:
                # a parent without a record of its own (filtered out): an empty node under the root
                self.parent[parent] = ROOT
                self.children[ROOT].append(parent)
            self.parent[name] = parent
            self.children.setdefault(parent, []).append(name)
        self.order: dict[str, int] = {}
        self._number(ROOT)

    def _number(self, root: str) -> None:
        stack = [(root, False)]
        while stack:  # iterative post-order: deep models exceed Python's recursion limit
            name, done = stack.pop()
            if done:
                self.order[name] = len(self.order)
                continue
            stack.append((name, True))
            stack.extend((child, False) for child in reversed(self.children.get(name, [])) if child not in self.order)

    def link(self, name: str | None) -> list[str]:
        """The path from the root to `name`."""
        if name is None or (name not in self.parent and name != ROOT):
            return []
        path = [name]
        while path[-1] != ROOT and len(path) <= len(self.parent):  # bounded: a damaged dump may loop
            path.append(self.parent[path[-1]])
        return path[::-1]


def _node_data(item: DumpItem | None, metrics: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    """(input_data, output_data) of a node: each tensor's record, and its compare row's metrics."""
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for entry in item.entries if item else []:
        full = f"{item.name}.{entry.key}"
        record = {k: _text(v) for k, v in entry.info.items()}
        record.setdefault("data_name", "-1")
        record.setdefault("requires_grad", "null")
        record.update({k: _text(v) for k, v in metrics.get(full, {}).items()})
        (outputs if entry.role == "output" else inputs)[full] = record
    return inputs, outputs


def _stack_of(graph: _Graph, name: str) -> list[str]:
    item = graph.items.get(name)
    if item is not None and item.stack:
        return list(item.stack)
    forward = name.replace(".backward.", ".forward.").replace(".parameters_grad.", ".forward.")
    other = graph.items.get(forward)
    return list(other.stack) if other is not None and other.stack else []


def _rows(
    rc: RankCompare, side: str, graph: _Graph, other: _Graph, matches: dict[str, str], stacks: dict[str, str]
) -> list[tuple]:
    step, rank = rc.step or 0, rc.rank or 0
    source = "NPU" if side == "target" else "Bench"
    graph_id = f"{source}_{step}_{rank}"
    verdicts = {m.name: m.result for m in rc.modules} if side == "target" else {}
    metrics: dict[str, dict[str, Any]] = {}
    if side == "target":
        from .output import row_record

        module_of = {m.name: m for m in rc.modules}
        for row in rc.rows:
            if row.target:
                rec = row_record(rc, row, module_of)
                metrics[row.target] = {k: rec[k] for k in _METRIC_KEYS if k in rec}
    out = []
    for name, order in sorted(graph.order.items(), key=lambda kv: kv[1]):
        item = graph.items.get(name)
        inputs, outputs = _node_data(item, metrics)
        stack = json.dumps(_stack_of(graph, name))
        stack_id = stacks.setdefault(f"{graph_id}\0{stack}", f"{graph_id}_{len(stacks)}")
        children = graph.children.get(name, [])
        # the microbatch: the item's own pass, or (golden side) its matched target item's
        where = item.where if item is not None else None
        if where is None and matches.get(name) in other.items:
            where = other.items[matches[name]].where
        node = {
            "id": f"{graph_id}_{name}",
            "graph_id": graph_id,
            "node_order": order,
            "node_name": name,
            "node_type": "1" if item and item.parsed and item.parsed.kind == "api" else "0",
            "up_node": "" if name == ROOT else graph.parent[name],
            "sub_nodes": json.dumps(children) if children else "",
            "precision_index": PRECISION.get(verdicts.get(name, "")),
            "overflow_level": None,
            "micro_step_id": int(where["microbatch"]) if where else 0,
            "matched_node_link": json.dumps(other.link(matches.get(name)) if name != ROOT else [ROOT]),
            "stack_id": stack_id,
            "parallel_merge_info": "",
            "matched_distributed": "{}",
            "modified": 0,
            "input_data": json.dumps(inputs),
            "output_data": json.dumps(outputs),
            "data_source": source,
            "dump_data_dir": str(rc.target_dir if side == "target" else rc.golden_dir),
            "step": step,
            "rank": rank,
            "is_distributed": 0,
        }
        out.append(tuple(node[k] for k in NODE_COLUMNS))
    return out


def _create(cur: sqlite3.Cursor, table: str, columns: dict[str, str]) -> str:
    cur.execute(f"CREATE TABLE {table} ({', '.join(f'{k} {v}' for k, v in columns.items())})")
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def write_vis_db(run: CompareRun, path: str | os.PathLike) -> Path:
    """Write the compare `run` as a `.vis.db` at `path` (a new file, or replaced whole)."""
    path = Path(path)
    if not path.name.endswith(".vis.db"):
        raise ValueError(f"path {str(path)!r}: the visualizer reads files named *.vis.db")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    stacks: dict[str, str] = {}
    micro_steps = 0
    with sqlite3.connect(tmp) as db:
        cur = db.cursor()
        insert_node = _create(cur, "tb_nodes", NODE_COLUMNS)
        for rc in run.ranks:
            if not rc.dumps:
                raise ValueError(f"step {rc.step} rank {rc.rank}: this compare holds no dumps to draw")
            target, golden = _Graph(rc.dumps["target"]), _Graph(rc.dumps["golden"])
            matches = {m.name: m.golden for m in rc.modules if m.golden}
            back = {g: t for t, g in matches.items()}
            cur.executemany(insert_node, _rows(rc, "target", target, golden, matches, stacks))
            cur.executemany(insert_node, _rows(rc, "golden", golden, target, back, stacks))
            wheres = [i.where for i in target.items.values() if i.where]
            micro_steps = max([micro_steps, *(int(w["microbatch"]) + 1 for w in wheres)])
        insert_stack = _create(cur, "tb_stack", STACK_COLUMNS)
        cur.executemany(insert_stack, [(sid, key.split("\0", 1)[1]) for key, sid in stacks.items()])
        insert_config = _create(cur, "tb_config", CONFIG_COLUMNS)
        modes = {rc.mode for rc in run.ranks}
        cur.execute(
            insert_config,
            (
                "1", "compare", _MODE_TASK.get(modes.pop() if len(modes) == 1 else "statistics", "summary"),
                json.dumps(TOOL_TIP), micro_steps, 0, json.dumps(NODE_COLORS),
                json.dumps(sorted({rc.rank or 0 for rc in run.ranks})),
                json.dumps(sorted({rc.step or 0 for rc in run.ranks})),
            ),
        )  # fmt: skip
        for index, columns in INDEXES.items():
            cur.execute(f"CREATE INDEX {index} ON tb_nodes ({', '.join(columns)})")
    db.close()
    os.replace(tmp, path)
    return path


__all__ = ["write_vis_db"]
