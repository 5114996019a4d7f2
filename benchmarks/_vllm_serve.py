"""Online serving: `vllm serve` with the ms-vllm plugin, driven by vLLM's own `vllm bench serve`.

Used by `bench_vllm.py --serve tiny|mid`. The server is started three times on the same checkpoint
(the models of _vllm_offline.py): compiled with MindSpore's compile cache empty (the cold start,
compiling every bucket) and then filled (the warm start), each followed by the same `vllm bench
serve` runs, and, on the tiny model, eagerly (`--enforce-eager`) under the same loads. The requests
are vLLM's random dataset with mixed prompt and output lengths (the offline run's spread: prompts of
10-94 tokens, outputs of 6-50) under a concurrency cap, sent twice: all at once (request rate inf:
the server's throughput) and then as a Poisson stream at half the request throughput the server
just reached (latency at half load). `vllm bench serve` reports throughput and TTFT / TPOT / ITL /
end-to-end latency at p50 and p99; its own JSON is kept whole in the result. Start times are from
the server's launch to its first healthy /health.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from _vllm_offline import MAX_MODEL_LEN, MODELS

LOAD = dict(input_len=52, output_len=28, range_ratio=0.8)
"""vLLM's random dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
METRICS = ("ttft", "tpot", "itl", "e2el")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm() -> str:
    return os.path.join(os.path.dirname(sys.executable), "vllm")


class Server:
    """One `vllm serve` process on 127.0.0.1, killed with its process group on exit."""

    def __init__(self, path: str, log: str, cache_dir: str, eager: bool, max_num_seqs: int, timeout: float = 1800,
                 extra: tuple[str, ...] = (), env: dict | None = None):  # fmt: skip
        self.path, self.log, self.port = path, log, _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            _vllm(), "serve", path, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--max-num-seqs", str(max_num_seqs),
            "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0", "--no-enable-prefix-caching",
        ]  # fmt: skip
        if eager:
            cmd.append("--enforce-eager")
        cmd += list(extra)
        env = dict(os.environ, MS_VLLM_COMPILE_CACHE=cache_dir, VLLM_LOGGING_LEVEL="INFO", **(env or {}))
        start = time.perf_counter()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_healthy(timeout)
        self.start_s = time.perf_counter() - start

    def _wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.5)

    def _tail(self) -> str:
        with open(self.log) as f:
            return f.read()[-4000:]

    def bench(self, out_dir: str, name: str, num_prompts: int, rate: float, concurrency: int) -> dict:
        """One `vllm bench serve` run against this server; its result JSON."""
        cmd = [
            _vllm(), "bench", "serve", "--backend", "vllm", "--base-url", self.base, "--model", self.path,
            "--dataset-name", "random", "--random-input-len", str(LOAD["input_len"]),
            "--random-output-len", str(LOAD["output_len"]), "--random-range-ratio", str(LOAD["range_ratio"]),
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--seed", "0", "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json", "--disable-tqdm",
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if run.returncode:
            raise RuntimeError(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
        with open(os.path.join(out_dir, f"{name}.json")) as f:
            return json.load(f)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _figures(raw: dict, start_s: float) -> dict:
    """The figures a row reports, from `vllm bench serve`'s JSON."""
    out = {
        "start_s": round(start_s, 2),
        "completed": raw["completed"],
        "duration_s": round(raw["duration"], 2),
        "request_throughput": round(raw["request_throughput"], 3),
        "output_tok_s": round(raw["output_throughput"], 2),
        "total_tok_s": round(raw["total_token_throughput"], 2),
    }
    for metric in METRICS:
        for q in ("p50", "p99"):
            out[f"{metric}_{q}_ms"] = round(raw[f"{q}_{metric}_ms"], 2)
    return out


def serve(name: str, root: str, num_prompts: int = 64, concurrency: int = 16) -> dict:
    """The serving figures of one model: compiled cold and warm starts and, on the tiny model, an
    eager server; each under the throughput load and then the half-load stream."""
    import ms_models

    path = ms_models.make_tiny("llama", os.path.join(root, f"serve-{name}"), seed=0, **MODELS[name])
    cache = tempfile.mkdtemp(prefix="ms-vllm-serve-cc-", dir=root)
    out_dir = tempfile.mkdtemp(prefix="ms-vllm-serve-", dir=root)
    variants = [("compiled, cold start", False), ("compiled, warm start", False)]
    if name == "tiny":  # the eager mid model would take ~10 minutes for the same load
        variants.append(("eager", True))
    result: dict = {
        "model": name,
        "load": dict(LOAD, num_prompts=num_prompts, max_concurrency=concurrency),
        "runs": {},
        "raw": {},
    }
    for label, eager in variants:
        tag = label.replace(", ", "-").replace(" ", "-")
        server = Server(path, os.path.join(out_dir, f"{tag}.log"), cache, eager, concurrency)
        try:
            top = server.bench(out_dir, f"{tag}-inf", num_prompts, float("inf"), concurrency)
            rate = round(top["request_throughput"] / 2, 2)
            half = server.bench(out_dir, f"{tag}-half", num_prompts, rate, concurrency)
        finally:
            server.close()
        result["runs"][label] = {
            "throughput": _figures(top, server.start_s),
            "half_load": dict(_figures(half, server.start_s), request_rate=rate),
        }
        result["raw"][label] = {"throughput": top, "half_load": half}
    runs = result["runs"]
    cold, warm = runs["compiled, cold start"], runs["compiled, warm start"]
    top = max((cold, warm), key=lambda r: r["throughput"]["output_tok_s"])
    summary = {
        "serve_output_tok_s": top["throughput"]["output_tok_s"],
        "serve_request_throughput": top["throughput"]["request_throughput"],
        "serve_half_load_rate": top["half_load"]["request_rate"],
        **{f"serve_half_load_{k}": v for k, v in top["half_load"].items() if k.split("_")[0] in ("ttft", "tpot")},
        "serve_start_cold_s": cold["throughput"]["start_s"],
        "serve_start_warm_s": warm["throughput"]["start_s"],
    }
    if "eager" in runs:
        eager = runs["eager"]["throughput"]["output_tok_s"]
        summary["serve_over_eager"] = round(top["throughput"]["output_tok_s"] / eager, 2)
    result["summary"] = summary
    return result


def serve_rows(result: dict) -> list[dict]:
    """Table rows of one serving result: one per (server, load)."""
    m, load = result["model"], result["load"]
    rows = []
    for label, loads in result["runs"].items():
        for kind, r in loads.items():
            rate = "all at once" if kind == "throughput" else f"Poisson {r['request_rate']}/s (half load)"
            rows.append(
                dict(
                    case=f"{m}: vllm serve ({label}), {load['num_prompts']} requests {rate}, "
                    f"concurrency {load['max_concurrency']}",
                    ours=f"{r['output_tok_s']:.1f} out tok/s, TTFT p50/p99 {r['ttft_p50_ms']:.0f}/"
                    f"{r['ttft_p99_ms']:.0f} ms, TPOT p50/p99 {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms",
                    baseline=f"server start {r['start_s']:.1f} s",
                    variant=label,
                    load=kind,
                    **r,
                )
            )
    return rows


__all__ = ["METRICS", "Server", "serve", "serve_rows"]
