"""This process's rank, without any parallel-layout package: launcher variables first, then an
initialised MindSpore or torch.distributed communicator, else 0."""

from __future__ import annotations

import os
import sys

# msrun and MindSpore's own launchers set RANK_ID; torchrun sets RANK; then MPI and Slurm.
RANK_VARIABLES = ("RANK_ID", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def detect_rank() -> int:
    """The global rank of this process (0 when nothing says otherwise)."""
    for var in RANK_VARIABLES:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    if "torch.distributed" in sys.modules:
        dist = sys.modules["torch.distributed"]
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:
            pass
    if "mindspore.communication" in sys.modules:
        try:
            from mindspore.communication import GlobalComm, get_rank

            if GlobalComm.INITED:
                return int(get_rank())
        except Exception:
            pass
    return 0
