"""Tensor parallelism on this machine: a decode step with 1 and 2 workers,
split into compute and communication, and the bytes the workers exchange.

The same requests (greedy, `--batch` at a time, all decoding together) run on
`tensor_parallel_size` 1 and 2 (the multiprocessing executor: rank 1 in a
worker process, gloo over 127.0.0.1). For every decode step in which the
whole batch runs, the engine's execute phase (block moves, the model, the
sampler) is timed on the driver, and the driver's collectives are counted
(`GroupCoordinator.stats`): the broadcast of the step's input, two
all-reduces per layer (after the attention's output projection and after the
MLP's down projection), one for the embedding, and the gather of the logits.
Communication is the time the driver spends in them, waiting for the other
rank included; compute is the rest of the execute phase.

Per layer and step the all-reduces move 2 x num_tokens x hidden_size values,
a few KB at decode, against the megabytes of weights each rank reads: tensor
parallelism trades a little communication for half the weights and half
the KV cache per worker. On a 2-core CPU the two ranks share the cores, so
it cannot be faster; what it buys here is capacity (each rank holds half).

    python -m tools.bench.tp                  # batch 1 and 16, the 20M model
    python -m tools.bench.tp --quick          # the tiny model, fewer tokens
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict, dataclass

from minivllm import LLM, SamplingParams
from minivllm.distributed import get_tp_group
from tools.bench.common import make_bench_model, print_table, write_result


@dataclass
class TPStep:
    tensor_parallel_size: int
    batch: int
    steps: int  # decode steps with the whole batch running
    execute_ms: float  # median over those steps
    comm_ms: float  # the driver's time in collectives, median
    compute_ms: float  # execute - comm, median
    collectives_per_step: float  # median
    kb_per_step_per_layer: float  # tensor bytes the driver put into collectives
    weights_mb_per_rank: float


class _DecodeSteps:
    """A step observer: per full decode step, the execute phase and the
    driver's collectives (their counters' change over the step)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.rows: list[tuple[float, float, int, int]] = []
        self._last = None

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        stats = get_tp_group().stats
        now = (stats.seconds, stats.calls, stats.bytes)
        last, self._last = self._last, now
        decodes = [m for m in record.seq_group_metadata_list if not m.is_prompt]
        if last is None or len(decodes) != self.batch:
            return
        self.rows.append(
            (record.execute_ms, (now[0] - last[0]) * 1e3, now[1] - last[1], now[2] - last[2])
        )


def run_tp(model_dir: str, tp: int, batch: int, prompt_len: int, output_len: int) -> TPStep:
    llm = LLM(model_dir, tensor_parallel_size=tp, max_num_seqs=batch, disable_log_stats=True)
    try:
        observer = _DecodeSteps(batch)
        llm.llm_engine.add_step_observer(observer)
        prompts = [{"prompt_token_ids": [5 + (7 * i + 3 * j) % 300 for j in range(prompt_len)]}
                   for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        model = llm.llm_engine.worker.model_runner.model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        layers = llm.llm_engine.model_config.get_num_layers()
    finally:
        llm.llm_engine.model_executor.shutdown()
    execute, comm, calls, sent = zip(*observer.rows, strict=True)
    return TPStep(
        tensor_parallel_size=tp,
        batch=batch,
        steps=len(observer.rows),
        execute_ms=statistics.median(execute),
        comm_ms=statistics.median(comm),
        compute_ms=statistics.median(e - c for e, c in zip(execute, comm, strict=True)),
        collectives_per_step=statistics.median(calls),
        kb_per_step_per_layer=statistics.mean(sent) / layers / 1e3,
        weights_mb_per_rank=weights / 1e6,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-size", default="20m")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 16 tokens")
    parser.add_argument("--json", help="result path (default: tools/bench/results/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size, args.output_len = "tiny", 16
    results: list[TPStep] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bench_model(args.model_size, tmp)
        for batch in args.batch:
            for tp in (1, 2):
                results.append(run_tp(model_dir, tp, batch, args.prompt_len, args.output_len))
    rows = []
    for r in results:
        one = next(o for o in results if o.batch == r.batch and o.tensor_parallel_size == 1)
        rows.append({
            "tp": r.tensor_parallel_size, "batch": r.batch, "execute ms": r.execute_ms,
            "compute ms": r.compute_ms, "comm ms": r.comm_ms,
            "tp / tp1 time": r.execute_ms / one.execute_ms,
            "collectives": r.collectives_per_step, "KB/layer/step": r.kb_per_step_per_layer,
            "weights MB/rank": r.weights_mb_per_rank,
        })
    print_table(rows, f"Decode steps, {args.model_size} model, median per step")
    path = write_result("tp", {"model_size": args.model_size, "prompt_len": args.prompt_len,
                               "output_len": args.output_len,
                               "results": [asdict(r) for r in results]}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
