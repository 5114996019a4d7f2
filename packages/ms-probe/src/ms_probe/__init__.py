"""ms-probe: module-level precision dumps in msprobe's format, cross-framework compare, HTML report.

Dump (MindSpore Cells or PyTorch modules; the framework is imported only for its own models)
    PrecisionDebugger(dump_path=..., task="statistics"|"tensor", level="L0"|"L1"|"mix", step=..., rank=...,
                      scope=..., list=..., data_mode=..., summary_mode=..., jit="boundary"|"graph"|"pynative")
    .start(model) / .stop() / .step(), or `with debugger.dump_step(model): ...`
    .jit(step) (jit="graph": compile the step with its probes), .pipeline_pass(stage, microbatch, kind)
    DumpConfig, load_config(config.json) (msprobe's config fields).
Read and compare (numpy only)
    load_dumps(path), load_rank(folder), compare_dirs(target, golden, mapping), compare_rank(...),
    write_results(run, out_dir) (CSV, JSON, report.html), render_html(run), Thresholds.
    merge_ranks(dumps): a pipelined step's rank dumps as one (compare_dirs(..., merge_target_ranks=True)).
Names
    load_mapping(name_or_file), shipped_mappings(), NameMapping, auto_align(target, golden).
Errors
    ProbeError (a ValueError).
"""

from .align import Alignment, auto_align
from .compare import CompareRun, ModuleResult, RankCompare, Row, compare_dirs, compare_rank
from .config import DumpConfig, config_from_dict, load_config
from .debugger import PrecisionDebugger
from .errors import ProbeError
from .mapping import NameMapping, load_mapping, mapping_from_dict, shipped_mappings
from .merge import MergedDump, merge_ranks
from .metrics import stat_metrics, tensor_metrics
from .output import write_results
from .reader import RankDump, find_rank_dirs, load_dumps, load_rank
from .report import render_html
from .rules import Thresholds

__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "CompareRun",
    "DumpConfig",
    "MergedDump",
    "ModuleResult",
    "NameMapping",
    "PrecisionDebugger",
    "ProbeError",
    "RankCompare",
    "RankDump",
    "Row",
    "Thresholds",
    "auto_align",
    "compare_dirs",
    "compare_rank",
    "config_from_dict",
    "find_rank_dirs",
    "load_config",
    "load_dumps",
    "load_mapping",
    "load_rank",
    "mapping_from_dict",
    "merge_ranks",
    "render_html",
    "shipped_mappings",
    "stat_metrics",
    "tensor_metrics",
    "write_results",
]
