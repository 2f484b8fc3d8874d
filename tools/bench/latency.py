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

Then one request alone (`--single-prompt-len` 32 prompt tokens,
`--single-output-len` 128 outputs, greedy, `ignore_eos`): its TPOT on the
classic engine and with Hugging Face `generate` on the same weights,
`--single-repeats` times each, interleaved (engine, HF, engine, HF, ...),
reported as the median and the spread, (max - min) / median. TPOT is vLLM's
(`benchmark_serving`): the time from the first output token to the last
over the gaps between them, output tokens - 1, so the prefill is left out.
Against the machine: a decode step at batch 1 reads every weight once, so
weight bytes / the read bandwidth measured here (tools/bench/machine.py) is
a floor on the time per token; each TPOT is given as a multiple of it
(a floor only for weights far larger than the CPU's caches: the 20M
model's 83 MB, not the tiny model's 0.5 MB, which are read from cache).

    python -m tools.bench.latency                 # 40 requests at 1 req/s, 20M model
    python -m tools.bench.latency --quick         # 12 requests, tiny model
    python -m tools.bench.latency --single-only   # the lone request only (20M model, ~20 s)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from minivllm import LLM, SamplingParams
from minivllm.outputs import RequestOutput
from tools.bench import machine
from tools.bench.common import (
    BenchRequest,
    Repeated,
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
from tools.bench.throughput import agreement


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


def time_per_output_token(first_token: float, last_token: float, num_tokens: int) -> float | None:
    """vLLM's TPOT: (last token's time - first token's) / (tokens - 1), the
    mean gap between consecutive output tokens; the prefill, which made the
    first token, is TTFT's. None for a single token (no gap)."""
    return (last_token - first_token) / (num_tokens - 1) if num_tokens > 1 else None


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
        tpot = time_per_output_token(m.first_token_time, m.finished_time, n)
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


class TokenTimes(BaseStreamer):
    """A `generate` streamer that notes when each output token reaches the
    host: `generate` puts the prompt first, then every new token as soon as
    it is sampled (batch 1: one token per put)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.tokens: list[int] = []
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens += value.reshape(-1).tolist()
        self.times.append(now)

    def end(self) -> None:
        pass


@dataclass
class Decoded:
    """One request decoded alone: its tokens and its TPOT (seconds)."""

    tokens: list[int]
    tpot: float


def engine_decode(llm: LLM, request: BenchRequest) -> Decoded:
    """The classic engine's TPOT from the request's own metrics (the
    wall-clock times of its first and last tokens), as `serve` measures it."""
    params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
    prompt = {"prompt_token_ids": request.prompt_token_ids}
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens, m = list(out.outputs[0].token_ids), out.metrics
    return Decoded(tokens, time_per_output_token(m.first_token_time, m.finished_time, len(tokens)))


def hf_decode(hf, request: BenchRequest) -> Decoded:
    """Hugging Face greedy `generate` on the request alone (no padding, no
    EOS), its TPOT from the times its tokens were streamed."""
    streamer = TokenTimes()
    ids = torch.tensor([request.prompt_token_ids], device=hf.device)
    with torch.inference_mode():
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=request.output_len,
            min_new_tokens=request.output_len,
            eos_token_id=None,
            pad_token_id=0,
            streamer=streamer,
        )
    times = streamer.times
    return Decoded(streamer.tokens, time_per_output_token(times[0], times[-1], len(times)))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight, tied ones once: what a decode step at batch 1
    reads (the embedding is read one row per token, but it is a small share
    of a Llama's weights and counting it whole keeps the floor simple)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class SingleRequest:
    """One request alone, the engine against HF `generate`, per output token."""

    prompt_len: int
    output_len: int
    engine_tpot: Repeated  # seconds, one per repetition
    hf_tpot: Repeated
    weight_bytes: int
    read_bandwidth: float  # bytes/s, the best measured in this process
    agreement: dict  # the engine's greedy tokens against HF's
    # The engine ran steps of at most this many tokens on one CPU thread
    # (worker/cpu_threads.py, timed when it loaded; 0: never).
    one_thread_max_tokens: int

    @property
    def weight_floor(self) -> float:
        """Seconds per token to read every weight once at the measured bandwidth."""
        return self.weight_bytes / self.read_bandwidth

    @property
    def hf_over_engine(self) -> float:
        return self.hf_tpot.median / self.engine_tpot.median

    def summary(self) -> dict:
        floor = self.weight_floor
        return {
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "engine_tpot_ms": _in_ms(self.engine_tpot).summary(),
            "hf_tpot_ms": _in_ms(self.hf_tpot).summary(),
            "hf_over_engine": self.hf_over_engine,
            "weight_bytes": self.weight_bytes,
            "read_bandwidth_bytes_per_s": self.read_bandwidth,
            "weight_floor_ms": floor * 1e3,
            "engine_over_floor": self.engine_tpot.median / floor,
            "hf_over_floor": self.hf_tpot.median / floor,
            "greedy_agreement": self.agreement,
            "one_thread_max_tokens": self.one_thread_max_tokens,
        }


def _in_ms(seconds: Repeated) -> Repeated:
    return Repeated(tuple(v * 1e3 for v in seconds.values))


def run_single_request(
    model_dir: str,
    prompt_len: int = 32,
    output_len: int = 128,
    repeats: int = 5,
    device: str = "cpu",
    seed: int = 0,
    compilation_level: int = 0,
    enforce_eager: bool = False,
) -> SingleRequest:
    """The engine and HF `generate` on one seeded request, after one warm-up
    each, `repeats` times each, interleaved. The read bandwidth is measured
    after each pair too and the best figure kept (machine.py's rule: the
    least disturbed run is the closest to the hardware), so that a busy
    spell of a shared machine does not lower the floor."""
    llm = LLM(
        model_dir, max_model_len=prompt_len + output_len, device=device, seed=0, swap_space=0,
        compilation_level=compilation_level, enforce_eager=enforce_eager,
    )
    hf_dtype = llm.llm_engine.model_config.dtype
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype).to(device).eval()
    spec = WorkloadSpec(1, prompt_len, prompt_len, output_len, output_len, seed)
    request = sample_requests(spec, hf.config.vocab_size)[0]
    engine_decode(llm, request)  # warm-up: the Numba kernel compiles
    hf_decode(hf, request)
    engine_runs, hf_runs, bandwidths = [], [], []
    for _ in range(repeats):
        engine_runs.append(engine_decode(llm, request))
        hf_runs.append(hf_decode(hf, request))
        bandwidths.append(machine.read_bandwidth(device=device, repeats=3).per_second)
    return SingleRequest(
        prompt_len,
        output_len,
        Repeated(tuple(r.tpot for r in engine_runs)),
        Repeated(tuple(r.tpot for r in hf_runs)),
        weight_bytes(hf),
        max(bandwidths),
        agreement([r.tokens for r in engine_runs], [r.tokens for r in hf_runs]).summary(),
        llm.llm_engine.worker.one_thread_max_tokens,
    )


def print_single_request(single: SingleRequest) -> None:
    s = single.summary()
    rows = []
    for name, key, over in (("engine", "engine_tpot_ms", "engine_over_floor"),
                            ("HF generate", "hf_tpot_ms", "hf_over_floor")):
        t = s[key]
        rows.append(
            {
                "peer": name,
                "TPOT median ms": t["median"],
                "min ms": t["min"],
                "max ms": t["max"],
                "spread": f"{t['spread']:.1%}",
                "x weight floor": s[over],
            }
        )
    print_table(
        rows,
        title=f"One request alone, {single.prompt_len} prompt + {single.output_len} output "
        f"tokens, {len(single.engine_tpot.values)} runs each, interleaved",
    )
    a = s["greedy_agreement"]
    print(
        f"HF / engine per output token: {single.hf_over_engine:.2f}x; weight floor "
        f"{s['weight_floor_ms']:.2f} ms/token ({single.weight_bytes / 1e6:.1f} MB of weights at "
        f"{machine.format_rate(single.read_bandwidth, 'B')} read): engine within "
        f"{s['engine_over_floor']:.1f}x of it; greedy tokens identical in "
        f"{a['identical']}/{a['compared']} runs"
    )
    if single.one_thread_max_tokens:
        print(f"the engine ran steps of at most {single.one_thread_max_tokens} tokens on one "
              "CPU thread (worker/cpu_threads.py)")


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


def print_runs(summaries: list[dict], spec: WorkloadSpec, args: argparse.Namespace) -> None:
    """The Poisson runs' table."""
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, num_requests=40)
    add_model_args(parser)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument(
        "--chunk-size", type=int, default=256, help="max_num_batched_tokens with chunked prefill"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--single-prompt-len", type=int, default=32)
    parser.add_argument("--single-output-len", type=int, default=128)
    parser.add_argument(
        "--single-repeats", type=int, default=5, help="runs of the lone request, each peer"
    )
    parser.add_argument(
        "--single-only", action="store_true", help="only the lone request, no Poisson runs"
    )
    parser.add_argument(
        "--compilation-level", type=int, default=0, help="the engine's, lone request (0: eager)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="the engine's, lone request: no CUDA graphs"
    )
    parser.add_argument("--quick", action="store_true", help="12 requests, tiny model, 8 req/s")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.model_size, args.num_requests, args.rate = "tiny", 12, 8.0
    spec = workload_spec(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_bench_model(args.model_size, tmp)
        runs = [] if args.single_only else run_latency(
            model_dir, spec, args.rate, args.chunk_size, args.max_num_seqs, args.device
        )
        single = run_single_request(
            model_dir,
            args.single_prompt_len,
            args.single_output_len,
            args.single_repeats,
            args.device,
            args.seed,
            args.compilation_level,
            args.enforce_eager,
        )
    summaries = [run.summary() for run in runs]
    if runs:
        print_runs(summaries, spec, args)
    print_single_request(single)
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
        "single_request": single.summary(),
    }
    out = write_result("latency", payload, args.json)
    if runs and not args.no_plot:
        plot(runs, plot_path("latency", args.json))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
