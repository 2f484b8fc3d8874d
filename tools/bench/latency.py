"""Online latency: time to first token and time per output token under Poisson arrivals.

Requests from the throughput workload's distribution (prompts and outputs
of 16-256 tokens, `ignore_eos`) arrive at seeded Poisson times at `--rate`
requests/s, in real time: the driver adds each request to the engine
(`LLMEngine.add_request(..., arrival_time=...)`) once its arrival time has
passed, and steps the engine while anything is unfinished. Per request:

- TTFT, time to first token: first token time - arrival time (queueing and
  the prefill included);
- TPOT, time per output token: (finish time - first token time) /
  (output tokens - 1), the mean gap between its later tokens.

Twice, with the same arrivals: chunked prefill off (a step computes every
admitted prompt whole, up to 2048 tokens, so decodes wait behind long
prefills) and on (`enable_chunked_prefill`, at most `--chunk-size` tokens a
step: prompts are split, decodes go first); then a third time on the V1
engine (`use_v1=True`: one budget of `--chunk-size` tokens, chunking by
default, prefix caching on). Reported as p50 and p99 over the requests
(with few requests, p99 is close to the maximum).

    python -m tools.bench.latency                 # 40 requests at 1 req/s, 20M model
    python -m tools.bench.latency --quick         # 12 requests, tiny model
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass

from minivllm import LLM, SamplingParams
from minivllm.outputs import RequestOutput
from tools.bench.common import (
    BenchRequest,
    WorkloadSpec,
    add_model_args,
    add_workload_args,
    make_bench_model,
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
class RequestLatency:
    arrival: float  # seconds after the run began
    ttft: float
    tpot: float | None  # None with a single output token
    output_len: int


@dataclass
class LatencyRun:
    engine: str  # "classic" or "V1"
    chunked_prefill: bool
    max_num_batched_tokens: int
    requests: list[RequestLatency]
    seconds: float

    def label(self) -> str:
        if self.engine == "V1":
            return "V1"
        return "chunked prefill" if self.chunked_prefill else "no chunking"

    def key(self) -> str:
        """Its name in the JSON result."""
        if self.engine == "V1":
            return "v1"
        return "chunked" if self.chunked_prefill else "unchunked"

    def summary(self) -> dict:
        ttft = [r.ttft for r in self.requests]
        tpot = [r.tpot for r in self.requests if r.tpot is not None]
        return {
            "engine": self.engine,
            "chunked_prefill": self.chunked_prefill,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "tpot_p50_ms": percentile(tpot, 50) * 1e3,
            "tpot_p99_ms": percentile(tpot, 99) * 1e3,
            "seconds": self.seconds,
        }


def serve_outputs(
    llm: LLM, requests: list[BenchRequest], arrivals: list[float]
) -> list[RequestOutput]:
    """Feed the requests at their arrival times (seconds from now) and step
    the engine until all are done; each request's final output, whose
    metrics are the engine's wall-clock times."""
    engine = llm.llm_engine
    start = time.time()
    finished: dict[int, RequestOutput] = {}
    next_request = 0
    while next_request < len(requests) or engine.has_unfinished_requests():
        now = time.time() - start
        while next_request < len(requests) and arrivals[next_request] <= now:
            r = requests[next_request]
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(
                str(next_request),
                {"prompt_token_ids": r.prompt_token_ids},
                params,
                arrival_time=start + arrivals[next_request],
            )
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - (time.time() - start)))
            continue
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
    return [finished[i] for i in range(len(requests))]


def serve(llm: LLM, requests: list[BenchRequest], arrivals: list[float]) -> LatencyRun:
    """`serve_outputs`, then each request's latencies."""
    start = time.time()
    outputs = serve_outputs(llm, requests, arrivals)
    results = []
    for i, out in enumerate(outputs):
        m, n = out.metrics, len(out.outputs[0].token_ids)
        tpot = (m.finished_time - m.first_token_time) / (n - 1) if n > 1 else None
        results.append(RequestLatency(arrivals[i], m.first_token_time - m.arrival_time, tpot, n))
    config = llm.llm_engine.engine_config
    sched = config.scheduler_config
    return LatencyRun(
        "V1" if config.use_v1 else "classic",
        sched.enable_chunked_prefill,
        sched.max_num_batched_tokens,
        results,
        time.time() - start,
    )


def run_latency(
    model_dir: str,
    spec: WorkloadSpec,
    rate: float,
    chunk_size: int,
    max_num_seqs: int,
    device: str = "cpu",
) -> list[LatencyRun]:
    """The same arrivals with chunked prefill off, then on, then on V1."""
    runs = []
    for use_v1, chunked in ((False, False), (False, True), (True, True)):
        llm = LLM(
            model_dir,
            max_model_len=spec.max_model_len,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=chunk_size if chunked else None,
            device=device,
            use_v1=use_v1,
            **({} if use_v1 else {"swap_space": 0}),
        )
        vocab = llm.llm_engine.model_config.hf_config.vocab_size
        requests = sample_requests(spec, vocab)
        arrivals = poisson_arrival_times(len(requests), rate, spec.seed)
        # Warm up (the Numba kernel compiles on its first call) on a few requests.
        warm = [BenchRequest(r.prompt_token_ids, 4) for r in requests[:4]]
        serve(llm, warm, [0.0] * len(warm))
        runs.append(serve(llm, requests, arrivals))
        del llm
    return runs


def plot(runs: list[LatencyRun], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        label = run.label()
        arrivals = [r.arrival for r in run.requests]
        ax_ttft.plot(arrivals, [r.ttft * 1e3 for r in run.requests], "o", ms=4, label=label)
        tpot = sorted(r.tpot * 1e3 for r in run.requests if r.tpot is not None)
        ax_tpot.plot(tpot, [(i + 1) / len(tpot) for i in range(len(tpot))], label=label)
    ax_ttft.set(xlabel="arrival (s)", ylabel="time to first token (ms)", title="TTFT per request")
    ax_tpot.set(
        xlabel="time per output token (ms)", ylabel="fraction of requests", title="TPOT, cumulative"
    )
    for ax in (ax_ttft, ax_tpot):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, num_requests=40)
    add_model_args(parser)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument(
        "--chunk-size", type=int, default=256, help="max_num_batched_tokens with chunked prefill"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="12 requests, tiny model, 8 req/s")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.model_size, args.num_requests, args.rate = "tiny", 12, 8.0
    spec = workload_spec(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_bench_model(args.model_size, tmp)
        runs = run_latency(
            model_dir, spec, args.rate, args.chunk_size, args.max_num_seqs, args.device
        )
    summaries = [run.summary() for run in runs]
    print_table(
        [
            {
                "engine": s["engine"],
                "chunked prefill": "on" if s["chunked_prefill"] else "off",
                "tokens/step": s["max_num_batched_tokens"],
                "TTFT p50 ms": s["ttft_p50_ms"],
                "TTFT p99 ms": s["ttft_p99_ms"],
                "TPOT p50 ms": s["tpot_p50_ms"],
                "TPOT p99 ms": s["tpot_p99_ms"],
                "run s": s["seconds"],
            }
            for s in summaries
        ],
        title=f"Latency, {spec.num_requests} requests at {args.rate} req/s (Poisson, seed "
        f"{spec.seed}), model {args.model or args.model_size}",
    )
    payload = {
        "workload": {
            **asdict(spec),
            "rate": args.rate,
            "max_num_seqs": args.max_num_seqs,
            "model": args.model or args.model_size,
        },
        "summary": summaries,
        "per_request": {
            run.key(): {
                f: [getattr(r, f) for r in run.requests]
                for f in ("arrival", "ttft", "tpot", "output_len")
            }
            for run in runs
        },
    }
    out = write_result("latency", payload, args.json)
    if not args.no_plot:
        plot(runs, plot_path("latency", args.json))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
