"""RoPE scaling variants of `rope_scaling` (Hugging Face's formulas): Llama 3.1's and YaRN's
inverse frequencies (DeepSeek-V3 uses YaRN). numpy only."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def llama3_inv_freq(inv: np.ndarray, p: dict[str, Any], max_pos: int) -> np.ndarray:
    """Llama 3.1's rope_scaling: low frequencies divided by `factor`, high ones kept, smoothed between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p.get("original_max_position_embeddings", max_pos)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, p: dict[str, Any], max_pos: int) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies and attention factor."""
    # YaRN (arXiv:2309.00071) as DeepSeek-V3 and HF compute it: interpolate low frequencies by
    # `factor`, keep high ones, ramp linearly between the correction dims; scale cos/sin by mscale.
    original = p.get("original_max_position_embeddings", max_pos)
    factor = p.get("factor") or max_pos / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)
