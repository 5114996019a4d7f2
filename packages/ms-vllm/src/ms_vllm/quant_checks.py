"""What `ms-vllm quantize` checks before it loads anything (no MindSpore import, so bad input is
answered at once): the source checkpoint, the output folder, the group size and the calibration file.
"""

from __future__ import annotations

import glob
import os

from ms_layout.files import FileError, read_capped, read_json
from ms_layout.limits import Limit

METHODS = ("ms_w8a8", "ms_w4a16")

MAX_CALIB_BYTES = Limit("MS_VLLM_MAX_CALIB_BYTES", 1 << 20, "bytes")
"""Size of a calibration prompt file: every prompt is run through the float model."""
MAX_GROUP_SIZE = Limit("MS_VLLM_MAX_GROUP_SIZE", 1 << 16, "input columns")
"""W4A16 group size (one scale per group; it must divide every layer's in_features)."""


class QuantError(ValueError):
    """A checkpoint or request that cannot be quantized or loaded as quantized."""


def check_method(method: str) -> None:
    if method not in METHODS:
        raise QuantError(f"method {method!r:.50}; expected one of {METHODS}")


def check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise QuantError(f"group_size={group_size!r:.50}; expected a positive int (a divisor of in_features)")
    MAX_GROUP_SIZE.check(group_size, "group_size", QuantError)


def check_source(src: str) -> dict:
    """The float HF folder: a folder, with config.json (an object) and *.safetensors. Returns the config."""
    if not os.path.exists(src):
        raise QuantError(f"checkpoint folder {src!r} does not exist")
    if not os.path.isdir(src):
        raise QuantError(f"checkpoint {src!r} is not a folder; give the HF folder holding config.json")
    try:
        config = read_json(os.path.join(src, "config.json"), "checkpoint config")
    except FileError as exc:
        raise QuantError(str(exc)) from None
    if not isinstance(config, dict):
        raise QuantError(f"{os.path.join(src, 'config.json')!r} holds a {type(config).__name__}, not an object")
    if not glob.glob(os.path.join(glob.escape(src), "*.safetensors")):
        raise QuantError(f"checkpoint folder {src!r} holds no *.safetensors weights")
    return config


def check_target(src: str, dst: str) -> None:
    """The output folder: not the source (or inside it), not a file; an existing folder is replaced
    only if it is an earlier quantized checkpoint, never an arbitrary folder given by mistake."""
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_dst == real_src or real_dst.startswith(real_src + os.sep) or real_src.startswith(real_dst + os.sep):
        raise QuantError(f"output {dst!r} overlaps the source checkpoint {src!r}; write to another folder")
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise QuantError(f"output {dst!r} exists and is not a folder")
    if os.path.isdir(dst) and os.listdir(dst):
        try:
            config = read_json(os.path.join(dst, "config.json"), "output config")
        except FileError:
            config = None
        if not (isinstance(config, dict) and isinstance(config.get("quantization_config"), dict)):
            raise QuantError(
                f"output {dst!r} is a non-empty folder that is not a quantized checkpoint; remove it or pick another"
            )
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise QuantError(f"output {dst!r}: folder {parent!r} does not exist")


def read_calib(path: str) -> list[str]:
    """Calibration prompts, one per non-empty line of a UTF-8 text file."""
    try:
        data = read_capped(path, MAX_CALIB_BYTES.value, "calibration file")
        text = data.decode("utf-8")
    except FileError as exc:
        raise QuantError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise QuantError(f"calibration file {path!r} is not UTF-8 text (byte {exc.start})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise QuantError(f"calibration file {path!r} holds no prompts (one per line)")
    return prompts
