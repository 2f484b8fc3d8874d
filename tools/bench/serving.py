"""Online serving: an open-loop client against a running API server.

The measures of vLLM's serving benchmark (benchmarks/benchmark_serving.py),
on our seeded workload: requests of random token ids (prompt and output
lengths uniform in the given ranges, `ignore_eos`, so every run does the
same work) are sent to /v1/completions with `stream` at seeded Poisson
times of `--rate` requests/s, whether or not earlier ones have finished
(open loop: a server that falls behind builds a queue, as in production).
Per request, from the client's side:

- TTFT: first streamed token - send time (queueing and prefill included);
- TPOT: (last token - first token) / (output tokens - 1);
- ITL: every gap between two streamed tokens;
- E2E: last token - send time.

Reported per rate: request and output-token throughput, and mean, median
and p99 of each, plus goodput (requests/s that met `--goodput` limits).
Several rates (`--rates 2 4 8 inf`) show where latency turns; `inf` sends
everything at once. `--compare-offline` also runs the same requests through
`LLM.generate` in this process, on the served checkpoint with default
engine options: the serving overhead per output token is the difference of
the two wall times (at rate inf) over the tokens.

    OMP_NUM_THREADS=1 minivllm serve --disable-log-requests &       # the story model
    python -m tools.bench.serving --rates 4 8 16 32 inf --compare-offline --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

import httpx

from tools.bench.common import (
    BenchRequest,
    add_workload_args,
    percentile,
    plot_path,
    poisson_arrival_times,
    print_table,
    sample_requests,
    set_threads,
    workload_spec,
    write_result,
)


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds)."""

    success: bool
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, request: BenchRequest
) -> RequestResult:
    """Stream one completion; time every token's chunk."""
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    token_times, output_len = [], 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=(await response.aread()).decode()[:200])
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                if chunk["choices"]:
                    token_times.append(time.perf_counter())
                if chunk.get("usage"):
                    output_len = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return RequestResult(False, error=repr(e))
    if not token_times:
        return RequestResult(False, error="no token came back")
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return RequestResult(True, output_len, token_times[0] - start, token_times[-1] - start, itl)


async def run_rate(
    base_url: str, model: str, requests: list[BenchRequest], rate: float, seed: int
) -> tuple[list[RequestResult], float]:
    """All requests at seeded Poisson times of `rate` (inf: at once);
    returns their results and the wall time of the whole run."""
    arrivals = (
        [0.0] * len(requests)
        if math.isinf(rate)
        else poisson_arrival_times(len(requests), rate, seed)
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        url = f"{base_url}/v1/completions"
        start = time.perf_counter()

        async def at(arrival: float, request: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            return await send_request(client, url, model, request)

        results = await asyncio.gather(*(at(a, r) for a, r in zip(arrivals, requests, strict=True)))
        return list(results), time.perf_counter() - start


def summarize(
    rate: float, results: list[RequestResult], duration: float, goodput: dict[str, float]
) -> dict:
    """vLLM's serving metrics (ms for latencies)."""
    done = [r for r in results if r.success]
    tpots = [r.tpot for r in done if r.tpot is not None]
    itls = [gap for r in done for gap in r.itl]
    output_tokens = sum(r.output_len for r in done)
    good = [
        r
        for r in done
        if r.ttft * 1e3 <= goodput.get("ttft", math.inf)
        and (r.tpot or 0) * 1e3 <= goodput.get("tpot", math.inf)
    ]
    row = {
        "rate": rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "req_per_s": len(done) / duration,
        "output_tok_per_s": output_tokens / duration,
        "goodput_req_per_s": len(good) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in done]),
        ("tpot", tpots),
        ("itl", itls),
        ("e2e", [r.e2e for r in done]),
    ):
        ms = [v * 1e3 for v in values]
        row[f"{name}_mean_ms"] = sum(ms) / len(ms) if ms else math.nan
        row[f"{name}_median_ms"] = percentile(ms, 50)
        row[f"{name}_p99_ms"] = percentile(ms, 99)
    return row


def served_model(base_url: str) -> tuple[str, str]:
    """(name, checkpoint directory) of the server's model, from /v1/models."""
    card = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]
    return card["id"], card["root"]


def offline_seconds(root: str, requests: list[BenchRequest]) -> float:
    """Wall time of the same requests through `LLM.generate`, all at once."""
    from minivllm import LLM, SamplingParams

    llm = LLM(root)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in rows if not math.isinf(r["rate"])]
    if not finite:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rates = [r["rate"] for r in finite]
    for ax, name in zip(axes, ("ttft", "tpot"), strict=True):
        for stat in ("median", "p99"):
            ax.plot(rates, [r[f"{name}_{stat}_ms"] for r in finite], marker="o", label=stat)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("minivllm serving: latency against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 16.0, math.inf])
    parser.add_argument("--vocab-size", type=int, help="default: the served checkpoint's")
    parser.add_argument(
        "--goodput",
        nargs="*",
        default=["ttft:500", "tpot:100"],
        metavar="NAME:MS",
        help="latency limits a request must meet to count in goodput (default: ttft:500 tpot:100)",
    )
    parser.add_argument("--compare-offline", action="store_true")
    parser.add_argument("--threads", type=int, help="CPU threads of the offline run")
    add_workload_args(parser, num_requests=100)
    parser.set_defaults(prompt_len=[8, 128], output_len=[8, 128])
    args = parser.parse_args(argv)

    set_threads(args.threads)
    model, root = served_model(args.base_url)
    vocab = args.vocab_size
    if vocab is None:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(root).vocab_size
    requests = sample_requests(workload_spec(args), vocab)
    goodput = {k: float(v) for k, v in (item.split(":") for item in args.goodput)}
    rows = []
    for rate in args.rates:
        results, duration = asyncio.run(run_rate(args.base_url, model, requests, rate, args.seed))
        rows.append(summarize(rate, results, duration, goodput))
        print(f"rate {rate:g}: {rows[-1]['completed']} done in {duration:.1f} s")
    # One row per measure, one column per rate: the table stays readable.
    print_table(
        [
            {"measure": k, **{f"rate {r['rate']:g}": r[k] for r in rows}}
            for k in rows[0]
            if k != "rate"
        ],
        title=f"serving {model}: {len(requests)} requests per rate",
    )
    payload = {
        "model": model,
        "workload": asdict(workload_spec(args)),
        "goodput": goodput,
        "runs": rows,
    }
    burst = [r for r in rows if math.isinf(r["rate"])]
    if args.compare_offline and burst:
        offline = offline_seconds(root, requests)
        tokens = sum(r.output_len for r in requests)
        payload["offline"] = {
            "duration_s": offline,
            "output_tok_per_s": tokens / offline,
            "serving_overhead_ms_per_token": (burst[0]["duration_s"] - offline) / tokens * 1e3,
        }
        print_table([payload["offline"]], title="offline LLM.generate, same requests")
    out = write_result("serving", payload, args.json)
    print(f"wrote {out}")
    if not args.no_plot:
        plot(rows, plot_path("serving", args.json))


if __name__ == "__main__":
    main()
