"""Stage 3: reshard the pipeline-stage shards into one inference checkpoint (ms-reshard).

The pretrain stage saved the weights as they were trained: one safetensors file per pipeline
rank, each parameter whole on the rank of its V stage, with a manifest of sizes and checksums.
The inference layout here is a single serving process (ms-vllm runs one worker; its tensor
parallelism is being built elsewhere): every parameter whole on rank 0. ms-reshard plans the
move per parameter (``model_plan``) and writes the target checkpoint (``reshard_checkpoint``:
verified source, slices read lazily, written to a temporary directory renamed into place). The
result must equal a plain numpy gather of the shards, and the HF directory built from it --
config, tokenizer, model.safetensors with HF names (experts split per expert) -- must load back
into ms-models with the same numbers.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import StageResult, setup_mindspore, timed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "ms_models_manifest.json")


@dataclass(frozen=True)
class ReshardConfig:
    """Where the inference checkpoint goes."""

    serve_rank: int = 0
    """The rank that serves (the target layout holds every parameter there)."""


def serve_specs(src: dict, rank: int) -> dict:
    """Every parameter whole on `rank` (a one-rank tensor-parallel mesh)."""
    from ms_layout import Layout
    from ms_reshard import ParamSpec

    return {
        name: ParamSpec(Layout((1,), ("tp",), rank_list=(rank,))(*["None"] * len(s.shape)), s.shape, s.dtype)
        for name, s in src.items()
    }


def run(config: ReshardConfig, work: Path) -> StageResult:
    import mindspore as ms

    import ms_models
    from ms_reshard import load_checkpoint, load_manifest, model_plan, reshard_checkpoint

    result = StageResult("reshard")
    with timed(result):
        src_dir, shard_dir, serve_dir = work / "train_ckpt", work / "serve_ckpt", work / "serve"
        src_specs, src_shards = load_checkpoint(src_dir)  # verifies the checksums
        plan = model_plan(src_specs, serve_specs(src_specs, config.serve_rank))
        reshard_checkpoint(src_dir, shard_dir, plan, load_manifest(src_dir), overwrite=True, progress=False)
        _, out = load_checkpoint(shard_dir)

        # the independent reference: a numpy gather (each parameter lives whole on one rank)
        gathered = {name: next(iter(by_rank.values())) for name, by_rank in src_shards.items()}
        exact = set(out) == set(gathered) and all(
            np.array_equal(out[n][config.serve_rank], gathered[n]) for n in gathered
        )
        per_rank = plan.per_rank()
        moved = sum(v.get("recv_bytes", v.get("received", 0)) for v in per_rank.values())
        result.check("resharded checkpoint == numpy gather of the stage shards", exact, f"{len(gathered)} parameters")

        # the HF directory ms-vllm serves: config + tokenizer from the initial checkpoint, weights
        # written by ms-models (HF names; stacked experts split per expert)
        setup_mindspore(1)
        init_dir = work / "init"
        if serve_dir.exists():
            shutil.rmtree(serve_dir)
        tmp = serve_dir.with_name(serve_dir.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            shutil.copy2(init_dir / name, tmp / name)
        model = ms_models.from_config(ms_models.load_config(init_dir))
        params = {p.name: p for p in model.get_parameters()}
        for name, by_rank in out.items():
            params[name].set_data(ms.Tensor(by_rank[config.serve_rank]))
        ms_models.save_safetensors(model, tmp)
        tmp.rename(serve_dir)

        back = {p.name: p.asnumpy() for p in ms_models.from_pretrained(serve_dir).get_parameters()}
        result.check(
            "the served HF directory loads back to the same weights",
            set(back) == set(gathered) and all(np.array_equal(back[n], gathered[n]) for n in gathered),
            f"{serve_dir}",
        )
        result.numbers = {
            "parameters": len(gathered),
            "bytes": int(sum(a.nbytes for a in gathered.values())),
            "moves": len(plan.moves),
            "per_rank": {str(k): v for k, v in per_rank.items()},
            "moved_bytes": moved,
            "serve_dir": str(serve_dir),
            "plan": str(plan)[:2000],
        }
    return result
