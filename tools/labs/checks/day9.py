"""Checkers for Day 9, sampling (labs/day9_sampling.ipynb).

Each exercise is one stage of the sampler, checked twice:

1. on fixed logits against an independent oracle: Hugging Face's logits
   processors (`RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`,
   `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`), a plain
   one-token-at-a-time loop for OpenAI's presence and frequency penalties,
   and the engine's own draw for the random numbers;
2. inside the real engine: `LabSampler`, the engine's `Sampler` with that one
   stage replaced by the learner's function, is put in the place the model
   runner samples with (`llm.llm_engine.model_executor.driver_worker.
   model_runner.sampler`), real requests run, and the sampler is put back.
   The tokens must equal those of the engine's own sampler on the same
   batch, with the same seeds.

When an answer is wrong, the checker tries the common mistakes and names the
one it matches. An unfinished exercise's NotImplementedError propagates; any
other exception from the learner's code becomes an AssertionError saying
where it was raised.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.sampler import (
    Sampler,
    apply_min_p,
    apply_min_tokens_penalty,
    apply_penalties,
    apply_request_logits_processors,
    apply_top_k_top_p,
    penalizes,
)
from minivllm.sampling_params import SamplingType
from minivllm.sequence import num_samples_to_draw
from tools.labs.checks._common import needs, passed  # noqa: F401 - needs: for the notebook
from tools.labs.checks._engine_runs import learner_code, quiet_engine

__all__ = ["LabSampler", "exercise_1", "exercise_2", "exercise_3", "installed", "lab_llm",
           "model_runner", "needs", "reference_warp", "run_requests"]

DAY = 9

# The lab's engine: the shipped model, PyTorch attention (no kernel to compile), small.
ENGINE = dict(attention_backend="torch", max_model_len=64, block_size=8,
              num_gpu_blocks_override=48, max_num_seqs=8)


# -- the engine, and a sampler with one stage replaced --------------------------------------


_llm: LLM | None = None


def lab_llm() -> LLM:
    """The lab's engine, the shipped model, quiet: built once per process, and
    again after an exception inside a step left it dead (`errored`)."""
    global _llm
    if _llm is None or _llm.llm_engine.errored:
        with quiet_engine():
            _llm = LLM(disable_log_stats=True, **ENGINE)
    return _llm


def model_runner(llm: LLM):
    """Where the classic engine keeps the sampler it calls every step."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def reference_warp(logits, temperature, top_k, top_p, min_p):
    """The engine's step 3 (temperature, top-k, top-p, min-p), by its own
    functions, skipping what no row asks for as the engine does."""
    logits = logits / temperature.unsqueeze(-1)
    if bool((top_k < logits.shape[-1]).any() or (top_p < 1).any()):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if bool((min_p > 0).any()):
        logits = apply_min_p(logits, min_p)
    return logits


class LabSampler(Sampler):
    """The engine's `Sampler` with one stage yours.

    penalties: a function with `apply_penalties`'s signature (exercise 1);
    warp: `warp(logits, temperature, top_k, top_p, min_p)`, step 3 of the
        chain in one (exercise 2);
    sample: `sample_tokens(probs, is_greedy, generators, shared_generator)`,
        the draw of every row's token (exercise 3).
    Everything else is the engine's: min_tokens, the order of the stages,
    the logprobs, the output. A replaced stage runs at every step, on every
    row (rows that do not use it pass its neutral values).
    """

    def __init__(self, seed: int = 0, *, penalties: Callable | None = None,
                 warp: Callable | None = None, sample: Callable | None = None) -> None:
        super().__init__(seed)
        self.penalties, self.warp, self.sample = penalties, warp, sample
        self.calls = 0  # how many steps ran the replaced stage

    def _process_logits(self, logits, rows):  # an instance method here, a staticmethod there
        if self.penalties is None and self.warp is None:
            processed = Sampler._process_logits(logits, rows)
        else:
            processed = self._chain(logits, rows)
        return processed

    def _chain(self, logits, rows):
        """The engine's `_process_logits`, in its order, with one stage yours."""
        params = [sg.sampling_params for sg, _ in rows]
        seq_data = [sg.seq_data[seq_id] for sg, seq_id in rows]
        device, vocab_size = logits.device, logits.shape[-1]

        def per_row(values, dtype=torch.float):
            return torch.tensor(values, dtype=dtype, device=device)

        logits = apply_request_logits_processors(
            logits, params, [d.output_token_ids for d in seq_data]
        )
        banned = [sorted(p.all_stop_token_ids) if len(d.output_token_ids) < p.min_tokens else []
                  for p, d in zip(params, seq_data, strict=True)]
        logits = apply_min_tokens_penalty(logits, banned)
        if self.penalties is not None or any(penalizes(p) for p in params):
            args = (
                logits,
                [list(d.prompt_token_ids) for d in seq_data],
                [list(d.output_token_ids) for d in seq_data],
                per_row([p.presence_penalty for p in params]),
                per_row([p.frequency_penalty for p in params]),
                per_row([p.repetition_penalty for p in params]),
            )
            if self.penalties is None:
                logits = apply_penalties(*args)
            else:
                self.calls += 1
                logits = _stage_output("apply_penalties", self.penalties(*args), logits)
        warp_args = (
            logits,
            per_row([1.0 if p.sampling_type == SamplingType.GREEDY else p.temperature
                     for p in params]),
            per_row([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params],
                    torch.long),
            per_row([p.top_p for p in params]),
            per_row([p.min_p for p in params]),
        )
        if self.warp is None:
            return reference_warp(*warp_args)
        self.calls += 1
        return _stage_output("warp", self.warp(*warp_args), logits)

    def _sample(self, processed, probs, rows) -> list[list[int]]:
        if self.sample is None:
            return super()._sample(processed, probs, rows)
        for sg, seq_id in rows:
            assert num_samples_to_draw(sg.sampling_params, sg.seq_data[seq_id]) == 1, (
                "LabSampler draws one token per sequence: use n=1 and best_of=1 with it"
            )
        is_greedy = [sg.sampling_params.sampling_type == SamplingType.GREEDY for sg, _ in rows]
        generators = [sg.generator for sg, _ in rows]
        self.calls += 1
        tokens = self.sample(probs, is_greedy, generators, self.generator)
        return [[t] for t in _token_list(tokens, len(rows), probs.shape[-1], "inside the engine")]


def _stage_output(name: str, out, logits: torch.Tensor) -> torch.Tensor:
    """What the engine needs back from a logits stage, checked before it uses it."""
    if not isinstance(out, torch.Tensor):
        raise AssertionError(
            f"your {name} returned {type(out).__name__}, not a tensor: return the new logits, "
            f"[num_rows, vocab_size] = {list(logits.shape)}."
        )
    if out.shape != logits.shape:
        raise AssertionError(
            f"your {name} returned shape {list(out.shape)} for logits of shape "
            f"{list(logits.shape)}: one row per sequence, one column per token."
        )
    if torch.isnan(out).any():
        raise AssertionError(
            f"your {name} put NaN in the logits (rows "
            f"{torch.isnan(out).any(-1).nonzero().flatten().tolist()}): the draw cannot sample "
            "from them. Dropped tokens are -inf; every row keeps at least one finite logit."
        )
    return out.float()


def _token_list(tokens, num_rows: int, vocab_size: int, where: str) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten().tolist()
    if tokens is None or not hasattr(tokens, "__len__"):
        raise AssertionError(
            f"your sample_tokens returned {tokens!r} {where}: return a list with one token id "
            "per row."
        )
    if len(tokens) != num_rows:
        raise AssertionError(
            f"your sample_tokens returned {len(tokens)} tokens for {num_rows} rows {where}: one "
            "token per row, in row order."
        )
    out = [int(t) for t in tokens]
    bad = [t for t in out if not 0 <= t < vocab_size]
    assert not bad, f"your sample_tokens returned token ids {bad} outside the vocabulary {where}"
    return out


@contextlib.contextmanager
def installed(llm: LLM, sampler: Sampler | None = None, **stages: Callable) -> Iterator[Sampler]:
    """Put `sampler` (or a `LabSampler(seed, **stages)`) where the model
    runner samples, and put the engine's own back afterwards."""
    runner = model_runner(llm)
    saved = runner.sampler
    seed = llm.llm_engine.model_config.seed
    runner.sampler = sampler if sampler is not None else LabSampler(seed, **stages)
    try:
        yield runner.sampler
    finally:
        runner.sampler = saved


Requests = list[tuple[str, SamplingParams]]


def run_requests(requests: Requests, sampler: Sampler | None = None,
                 **stages: Callable) -> list[tuple[int, ...]]:
    """Generate `requests` in one batch on the lab's engine with `sampler`
    (by default a fresh engine `Sampler`, so the shared stream restarts from
    the engine's seed) or a LabSampler with `stages`; each request's token ids."""
    llm = lab_llm()
    if sampler is None and not stages:
        sampler = Sampler(llm.llm_engine.model_config.seed)
    with installed(llm, sampler, **stages), quiet_engine():
        outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@functools.cache
def _reference(workload: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The engine's own tokens for each batch of a workload (computed once)."""
    return tuple(tuple(run_requests(batch)) for batch in WORKLOADS[workload])


def _texts(tokens: tuple[int, ...]) -> str:
    return repr(lab_llm().get_tokenizer().decode(list(tokens)))


def _first_difference(ref: tuple[int, ...], got: tuple[int, ...]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
                min(len(ref), len(got)))


def _describe(params: SamplingParams) -> str:
    fields = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
              "presence_penalty", "frequency_penalty")
    default = SamplingParams()
    shown = [f"{f}={getattr(params, f):g}" for f in fields
             if getattr(params, f) != getattr(default, f) or f == "temperature"]
    return ", ".join(shown)


def _compare_in_engine(what: str, stage: str, fn: Callable, workload: str, hint: str) -> None:
    """Run every batch of `workload` with the learner's stage; each request's
    tokens must equal the engine's own."""
    for batch, ref_tokens in zip(WORKLOADS[workload], _reference(workload), strict=True):
        sampler = LabSampler(lab_llm().llm_engine.model_config.seed, **{stage: fn})
        with learner_code(f"your {what}, inside the engine,"):
            got_tokens = run_requests(batch, sampler)
        assert sampler.calls > 0, f"the engine never called your {what}"
        for (prompt, params), ref, got in zip(batch, ref_tokens, got_tokens, strict=True):
            if ref != got:
                i = _first_difference(ref, got)
                raise AssertionError(
                    f"Day {DAY}: inside the engine, {prompt!r} ({_describe(params)}) differs from "
                    f"the engine's own sampler at output token {i}:\n"
                    f"  engine's: {list(ref)}  {_texts(ref)}\n"
                    f"  yours:    {list(got)}  {_texts(got)}\n{hint}"
                )


# -- exercise 1: penalties ---------------------------------------------------------------

VOCAB = 12


def _penalty_case():
    """Logits of 5 rows with both signs, histories with repeats, per-row
    penalties; each row makes some mistakes visible (see the tests)."""
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(5, VOCAB, generator=g) * 2).round(decimals=2)
    # Signs that matter: a seen token with a positive and one with a negative logit per row.
    for row, col, value in [(0, 3, 1.6), (0, 5, -1.2), (1, 7, 2.0), (1, 4, -0.8), (2, 1, 1.1),
                            (2, 9, -1.5), (2, 6, 0.9), (3, 8, 0.4), (3, 0, -0.6), (3, 11, 1.3),
                            (4, 2, 1.0)]:
        logits[row, col] = value
    prompts = [[3, 5, 5], [2], [1, 9], [0, 8], [2, 2]]
    outputs = [[], [7, 7, 7, 4], [9, 6, 6], [8, 11, 11], [2, 10]]
    presence = torch.tensor([0.8, 0.5, 0.0, -0.5, 0.0])
    frequency = torch.tensor([0.5, 0.25, 0.0, 1.0, 0.0])
    repetition = torch.tensor([1.5, 1.0, 2.0, 1.25, 1.0])
    return logits, prompts, outputs, presence, frequency, repetition


def _presence_frequency(logits, outputs, presence, frequency):
    """OpenAI's definition, one token at a time: logit -= frequency * count
    + presence * (count > 0), over the generated tokens only."""
    out = logits.clone()
    for row, ids in enumerate(outputs):
        for token in set(ids):
            out[row, token] -= float(frequency[row]) * ids.count(token) + float(presence[row])
    return out


def hf_penalties(logits, prompts, outputs, presence, frequency, repetition):
    """The oracle: Hugging Face's repetition penalty over prompt + output,
    then OpenAI's presence and frequency over the output (vLLM's order)."""
    rows = []
    for row in range(logits.shape[0]):
        ids = torch.tensor([prompts[row] + outputs[row]], dtype=torch.long)
        scores = logits[row:row + 1].clone()
        if ids.shape[1] and float(repetition[row]) != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(float(repetition[row]))(ids, scores)
        rows.append(scores[0])
    return _presence_frequency(torch.stack(rows), outputs, presence, frequency)


def _penalties_variant(logits, prompts, outputs, presence, frequency, repetition, *,
                       divide_all=False, inverted=False, output_only=False, per_occurrence=False,
                       presence_prompt=False, frequency_prompt=False, frequency_once=False,
                       presence_count=False, added=False, first_row=False, order=False):
    """A plain loop with one mistake switched on (the checker's catalogue)."""
    if first_row:
        n = logits.shape[0]
        presence, frequency, repetition = (t[:1].expand(n) for t in (presence, frequency,
                                                                        repetition))
    out = logits.clone()
    sign = -1.0 if added else 1.0

    def repetition_stage(out):
        for row in range(out.shape[0]):
            r = float(repetition[row])
            seen = outputs[row] if output_only else prompts[row] + outputs[row]
            for token in (seen if per_occurrence else set(seen)):
                value = float(out[row, token])
                if divide_all:
                    value = value / r
                elif inverted:
                    value = value * r if value > 0 else value / r
                else:
                    value = value / r if value > 0 else value * r
                out[row, token] = value
        return out

    def openai_stage(out):
        for row in range(out.shape[0]):
            p, f = float(presence[row]), float(frequency[row])
            counted_p = prompts[row] + outputs[row] if presence_prompt else outputs[row]
            counted_f = prompts[row] + outputs[row] if frequency_prompt else outputs[row]
            for token in set(counted_f):
                times = 1 if frequency_once else counted_f.count(token)
                out[row, token] -= sign * f * times
            for token in set(counted_p):
                out[row, token] -= sign * p * (counted_p.count(token) if presence_count else 1)
        return out

    if order:
        return repetition_stage(openai_stage(out))
    return openai_stage(repetition_stage(out))


_PENALTY_MISTAKES = [
    ("divide_all", "you divided every seen token's logit by the repetition penalty. A negative "
     "logit divided by 1.5 moves towards 0: the token becomes MORE likely. Divide positive "
     "logits, multiply negative ones (HF's RepetitionPenaltyLogitsProcessor, the CTRL paper)."),
    ("inverted", "you multiplied the positive logits and divided the negative ones: every seen "
     "token became more likely. Positive logits are divided by the penalty, negative ones "
     "multiplied, so both move down."),
    ("output_only", "your repetition penalty looked at the output tokens only. vLLM (like HF, "
     "whose input_ids are the prompt and the output) applies it to every token seen in the "
     "prompt or the output."),
    ("per_occurrence", "you applied the repetition penalty once per occurrence (a token seen "
     "twice was divided by the penalty squared). It is applied once per seen token, whatever "
     "its count: only the frequency penalty grows with the count."),
    ("presence_prompt", "your presence penalty counted prompt tokens. OpenAI's presence and "
     "frequency penalties (and vLLM's) look at the generated tokens only; only the repetition "
     "penalty covers the prompt."),
    ("frequency_prompt", "your frequency penalty counted prompt tokens. It counts the generated "
     "tokens only (output_token_ids)."),
    ("frequency_once", "your frequency penalty ignores the count: it must be subtracted once per "
     "time the token was generated (frequency * count); the flat, once-per-token one is the "
     "presence penalty."),
    ("presence_count", "your presence penalty grows with the count. It is subtracted once for "
     "any token generated at least once (presence * (count > 0)); the one that grows with the "
     "count is the frequency penalty."),
    ("added", "you added the presence and frequency penalties. A positive penalty is "
     "subtracted from the logit, so it discourages the token; a negative one encourages it."),
    ("first_row", "every row got the first row's penalties. Each row of the batch is a "
     "different request with its own SamplingParams: use presence_penalties[i], "
     "frequency_penalties[i], repetition_penalties[i] for row i (or broadcast the tensors "
     "with .unsqueeze(-1))."),
    ("order", "you applied presence and frequency before the repetition penalty. vLLM applies "
     "the repetition penalty first (it depends on the logit's sign), then subtracts frequency "
     "and presence."),
]


def _penalty_mistake(args, got: torch.Tensor, row: int) -> str:
    """The catalogued mistake whose whole output is `got`, else the first
    whose row `row` is."""
    for flag, said in _PENALTY_MISTAKES:
        if torch.allclose(got, _penalties_variant(*args, **{flag: True}), atol=1e-4):
            return said
    for flag, said in _PENALTY_MISTAKES:
        want = _penalties_variant(*args, **{flag: True})
        if torch.allclose(got[row], want[row], atol=1e-4):
            return said
    return ""


def exercise_1(apply_penalties_fn) -> None:
    case = _penalty_case()
    logits, prompts, outputs, presence, frequency, repetition = case
    expected = hf_penalties(*case)
    args = (logits.clone(), [list(p) for p in prompts], [list(o) for o in outputs],
            presence.clone(), frequency.clone(), repetition.clone())
    with learner_code("your apply_penalties"):
        got = apply_penalties_fn(*args)
    got = _stage_output("apply_penalties", got, logits)
    for row in range(logits.shape[0]):
        if torch.allclose(got[row], expected[row], atol=1e-4):
            continue
        cols = ((got[row] - expected[row]).abs() > 1e-4).nonzero().flatten().tolist()
        closer = _penalty_mistake(case, got, row)
        shown = ", ".join(f"token {c}: {float(logits[row, c]):.2f} -> expected "
                          f"{float(expected[row, c]):.3f}, yours {float(got[row, c]):.3f}"
                          for c in cols[:4])
        raise AssertionError(
            f"Day {DAY}, exercise 1: row {row} (prompt {prompts[row]}, output {outputs[row]}, "
            f"repetition {float(repetition[row]):g}, presence {float(presence[row]):g}, frequency "
            f"{float(frequency[row]):g}) differs from Hugging Face's "
            f"RepetitionPenaltyLogitsProcessor followed by OpenAI's presence/frequency "
            f"penalties:\n  {shown}\n"
            + (f"It looks like {closer}\n" if closer else "")
            + "Repetition: every token of prompt + output, once; logit / r if > 0, else logit * "
            "r. Then, over the output only: logit -= frequency * count + presence * (count > 0)."
        )
    _compare_in_engine(
        "apply_penalties", "penalties", apply_penalties_fn, "penalties",
        "The fixed logits passed, so look at what differs inside the engine: the token lists "
        "grow every step (output_token_ids), rows come from different requests, and a row "
        "without penalties (repetition 1, presence 0, frequency 0) must come back unchanged.",
    )
    passed(DAY, 1)


# -- exercise 2: temperature, top-k, top-p, min-p in one stage ---------------------------

WV = 8  # the warp fixture's vocabulary


def _warp_case():
    """Rows that each make one rule observable; per-row parameters."""
    log = lambda ps: [math.log(p) for p in ps]  # noqa: E731
    rows = [
        # (logits, temperature, top_k, top_p, min_p, what the row is about)
        (log([0.4, 0.3, 0.15, 0.1, 0.025, 0.015, 0.006, 0.004]), 0.5, WV, 0.9, 0.0,
         "temperature 0.5 before top-p 0.9"),
        ([2.0, 1.0, 1.0, 1.0, 0.5, 0.0, -1.0, -2.0], 1.0, 3, 1.0, 0.0,
         "top-k 3 with ties at the 3rd logit"),
        (log([0.5, 0.3, 0.1, 0.05, 0.025, 0.015, 0.006, 0.004]), 1.0, WV, 0.6, 0.0,
         "top-p 0.6: the token that crosses 0.6"),
        ([-1.0, -1.2, -2.0, -3.0, -3.5, -4.0, -5.0, -6.0], 1.0, WV, 1.0, 0.3,
         "min-p 0.3 with negative logits"),
        (log([0.4, 0.25, 0.2, 0.1, 0.025, 0.015, 0.006, 0.004]), 1.0, WV, 0.7, 0.5,
         "top-p 0.7 then min-p 0.5"),
        ([30.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 1.0, WV, 1e-9, 0.0,
         "top-p 1e-9 with one dominant token"),
        ([20.0, 0.3, -0.2, 1.1, 0.0, -1.4, 0.7, 0.2], 1.0, WV, 1.0, 0.0,
         "nothing asked (temperature 1, top-k = vocab, top-p 1, min-p 0), one dominant token"),
        ([0.3, -0.2, 1.1, 0.0, -1.4, 0.7, 0.2, -0.5], 2.0, 2, 1.0, 0.0,
         "temperature 2, top-k 2"),
    ]
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float)
    temperature = torch.tensor([r[1] for r in rows], dtype=torch.float)
    top_k = torch.tensor([r[2] for r in rows], dtype=torch.long)
    top_p = torch.tensor([r[3] for r in rows], dtype=torch.float)
    min_p = torch.tensor([r[4] for r in rows], dtype=torch.float)
    return (logits, temperature, top_k, top_p, min_p), [r[5] for r in rows]


def hf_warp(logits, temperature, top_k, top_p, min_p):
    """The oracle: Hugging Face's warpers, row by row, in generate()'s order
    (temperature, top-k, top-p, min-p), each with its own parameters."""
    rows = []
    for row in range(logits.shape[0]):
        scores = logits[row:row + 1].clone()
        if float(temperature[row]) != 1.0:
            scores = TemperatureLogitsWarper(float(temperature[row]))(None, scores)
        if int(top_k[row]) < logits.shape[-1]:
            scores = TopKLogitsWarper(int(top_k[row]))(None, scores)
        if float(top_p[row]) < 1.0:
            scores = TopPLogitsWarper(float(top_p[row]))(None, scores)
        if float(min_p[row]) > 0:
            scores = MinPLogitsWarper(float(min_p[row]))(None, scores)
        rows.append(scores[0])
    return torch.stack(rows)


def _top_p_keep(x, keep, p: float, *, drops_crossing=False, no_keep_one=False,
                p_one_drops_tail=False):
    """`keep` narrowed by top-p on the logits `x` (a plain version, or a mistake)."""
    if p >= 1 and not p_one_drops_tail:
        return keep
    probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
    if no_keep_one:  # the ascending rule of HF and vLLM, without its "keep one"
        ascending, index = probs.sort()
        drop = ascending.cumsum(-1) <= 1 - torch.tensor(p, dtype=torch.float32)
        new = torch.ones_like(keep)
        new[index[drop]] = False
        return keep & new
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(-1)
    kept_sorted = cum <= p if drops_crossing else (cum - probs[order]) < p
    new = torch.zeros_like(keep)
    new[order] = kept_sorted
    return keep & new


def _min_p_keep(x, keep, m: float, *, min_p_logit=False):
    """`keep` narrowed by min-p on the logits `x` (a plain version, or a mistake)."""
    if min_p_logit:  # vectorized, so rows with min_p 0 get it too
        return keep & ~(x < m * x.max())
    if m <= 0:
        return keep
    probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
    return keep & (probs >= m * probs.max())


def _warp_variant(logits, temperature, top_k, top_p, min_p, *, temperature_after=False,
                  multiply=False, drops_crossing=False, no_keep_one=False, min_p_logit=False,
                  min_p_first=False, exact_k=False, first_row=False, p_one_drops_tail=False):
    """A plain loop with one mistake switched on (the checker's catalogue)."""
    n, vocab = logits.shape
    top_p_flags = dict(drops_crossing=drops_crossing, no_keep_one=no_keep_one,
                       p_one_drops_tail=p_one_drops_tail)
    if first_row:
        temperature, top_k, top_p, min_p = (t[:1].expand(n) for t in
                                            (temperature, top_k, top_p, min_p))
    out = []
    for row in range(n):
        x = logits[row].clone()
        t = float(temperature[row])
        if not temperature_after:
            x = x * t if multiply else x / t
        keep = torch.ones(vocab, dtype=torch.bool)
        k = int(top_k[row])
        if k < vocab:
            if exact_k:
                keep = torch.zeros(vocab, dtype=torch.bool)
                keep[x.topk(k).indices] = True
            else:
                keep &= x >= x.topk(k).values[-1]
        p, m = float(top_p[row]), float(min_p[row])
        if min_p_first:
            keep = _min_p_keep(x, keep, m, min_p_logit=min_p_logit)
            keep = _top_p_keep(x, keep, p, **top_p_flags)
        else:
            keep = _top_p_keep(x, keep, p, **top_p_flags)
            keep = _min_p_keep(x, keep, m, min_p_logit=min_p_logit)
        x = x.masked_fill(~keep, float("-inf"))
        if temperature_after:
            x = x / t
        out.append(x)
    return torch.stack(out)


_WARP_MISTAKES = [
    ("temperature_after", "you truncated before dividing by the temperature. Temperature comes "
     "first (vLLM and HF): it reshapes the distribution, and top-k/top-p/min-p cut the "
     "reshaped one. At temperature 0.5 the top tokens hold more of the mass, so top-p keeps "
     "fewer of them."),
    ("multiply", "you multiplied the logits by the temperature; divide them: a temperature "
     "below 1 sharpens the distribution, above 1 flattens it."),
    ("drops_crossing", "your top-p dropped the token that crosses top_p. Top-p keeps the "
     "SMALLEST set whose probability REACHES top_p, so the token that takes the running sum "
     "past top_p stays: keep a token when the mass of the tokens before it (more likely ones) "
     "is < top_p."),
    ("no_keep_one", "a row lost every token. With top_p tiny, 1 - top_p rounds to 1.0 in "
     "float32, and the ascending rule `cumsum <= 1 - top_p` drops even the most likely token. "
     "Always keep the most likely token (vLLM: `top_p_mask[:, -1] = False`; HF: "
     "min_tokens_to_keep=1)."),
    ("p_one_drops_tail", "with top_p = 1 (off) you dropped the unlikely tokens. Summed from the "
     "most likely token down, float32's running sum reaches 1.0 before the tail (here the top "
     "token alone rounds to probability 1.0), so `mass before >= top_p` drops every token "
     "after it. Sum from the tail instead, as vLLM and HF do (drop a token when the mass of "
     "it and the less likely ones is <= 1 - top_p): small numbers added first keep their "
     "precision, and top_p = 1 drops nothing."),
    ("min_p_logit", "your min-p compared logits with min_p * the largest LOGIT. Min-p is about "
     "probabilities: drop a token whose probability is below min_p times the top token's "
     "probability (in logits: logit < max_logit + log(min_p)). Logits can be negative, which "
     "turns a scaled-logit threshold upside down."),
    ("min_p_first", "you applied min-p before top-p. The classic engine follows vLLM v0 and "
     "HF: top-k, then top-p, then min-p, each on what the previous one left (V1's sampler "
     "does min-p first; the results differ because top-p's running sum depends on which "
     "tokens are still there)."),
    ("exact_k", "your top-k kept exactly k tokens and broke a tie. vLLM and HF keep every "
     "token whose logit equals the k-th largest (mask `logits < kth_value`), so ties with "
     "the k-th are kept."),
    ("first_row", "every row got the first row's parameters. Each row is a different request: "
     "temperature[i], top_k[i], top_p[i], min_p[i] are row i's (broadcast with .unsqueeze(-1) "
     "or loop over rows)."),
]


def _warp_mistake(args, got: torch.Tensor, row: int) -> str:
    got_mask = torch.isfinite(got[row])
    if not got_mask.any():
        want = _warp_variant(*args, no_keep_one=True)
        if not torch.isfinite(want[row]).any():
            return dict(_WARP_MISTAKES)["no_keep_one"]
    for whole in (True, False):  # a mistake whose every row matches, then one whose row does
        for flag, said in _WARP_MISTAKES:
            want = _warp_variant(*args, **{flag: True})
            rows = range(got.shape[0]) if whole else [row]
            if all(_same_row(got[r], want[r]) for r in rows):
                return said
    return ""


def _same_row(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same tokens kept, with the same values."""
    mask = torch.isfinite(got)
    return torch.equal(mask, torch.isfinite(want)) and torch.allclose(got[mask], want[mask],
                                                                       atol=1e-4)


def _fmt(values: torch.Tensor) -> str:
    return "[" + ", ".join("-inf" if v == float("-inf") else f"{v:.3g}"
                           for v in values.tolist()) + "]"


def exercise_2(warp) -> None:
    args, about = _warp_case()
    logits, temperature, top_k, top_p, min_p = args
    expected = hf_warp(*args)
    with learner_code("your warp"):
        got = warp(*(a.clone() for a in args))
    if not isinstance(got, torch.Tensor):
        raise AssertionError(
            f"Day {DAY}, exercise 2: your warp returned {type(got).__name__}, not a tensor: "
            "return the logits, with the tokens you drop set to -inf."
        )
    if got.shape != logits.shape:
        raise AssertionError(
            f"Day {DAY}, exercise 2: your warp returned shape {list(got.shape)} for logits of "
            f"shape {list(logits.shape)}."
        )
    for row in range(logits.shape[0]):
        want_mask = torch.isfinite(expected[row])
        got_mask = torch.isfinite(got[row])  # NaN counts as dropped here
        if _same_row(got[row], expected[row]):
            continue
        params = (f"temperature {float(temperature[row]):g}, top_k {int(top_k[row])}, top_p "
                  f"{float(top_p[row]):g}, min_p {float(min_p[row]):g}")
        closer = _warp_mistake(args, got, row)
        if not closer and torch.equal(want_mask, got_mask):
            probs = expected[row].softmax(-1)[want_mask]
            if torch.allclose(got[row][got_mask], probs, atol=1e-4):
                closer = ("you returned probabilities. Return logits (divided by the "
                          "temperature) with the dropped tokens at -inf: the engine takes the "
                          "softmax itself, and also reports log-probabilities from them.")
            else:
                closer = ("you kept the right tokens but changed their values. The kept "
                          "logits must be exactly logits / temperature: masking is all that "
                          "top-k, top-p and min-p do.")
        raise AssertionError(
            f"Day {DAY}, exercise 2: row {row} ({about[row]}; {params}) differs from Hugging "
            "Face's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and "
            "MinPLogitsWarper applied in that order.\n"
            f"  logits:   {_fmt(logits[row])}\n"
            f"  expected: {_fmt(expected[row])}\n"
            f"  yours:    {_fmt(got[row])}\n"
            + (f"It looks like {closer}\n" if closer else "")
            + "Divide by the temperature; then keep the top k (ties with the k-th included); "
            "then the smallest set of most likely tokens whose probability reaches top_p "
            "(always at least one); then drop tokens with probability < min_p * the top "
            "probability. Dropped tokens are -inf, kept ones unchanged."
        )
    _compare_in_engine(
        "warp", "warp", warp, "warp",
        "The fixed logits passed, so look at what the engine hands you: real vocabularies "
        f"({lab_llm().llm_engine.model_config.hf_config.vocab_size} tokens), top_k = "
        "vocab_size for rows without top-k, greedy rows with temperature 1 and nothing to "
        "truncate, and rows whose parameters all differ.",
    )
    passed(DAY, 2)


# -- exercise 3: the draw, with per-request generators -----------------------------------

DV = 6  # the draw fixture's vocabulary


def reference_sample(probs, is_greedy, generators, shared_generator) -> list[int]:
    """The engine's draw (`Sampler._sample` and `Sampler._draw`), row by row."""
    tokens = []
    for row in range(probs.shape[0]):
        if is_greedy[row]:
            tokens.append(int(probs[row].argmax()))
            continue
        generator = generators[row] or shared_generator
        noise = torch.empty(probs.shape[-1]).exponential_(generator=generator)
        tokens.append(int((probs[row] / noise).argmax()))
    return tokens


def _draw_case():
    """Rows: seeded, unseeded, greedy with a seed, seeded, unseeded, greedy,
    seeded. Three seeded, two unseeded, two greedy rows, so that each wrong
    use of the shared generator moves it by its own amount."""
    probs = torch.tensor([
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
        [0.10, 0.15, 0.40, 0.15, 0.10, 0.10],
        [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
        [0.25, 0.05, 0.25, 0.05, 0.20, 0.20],
    ])
    is_greedy = [False, False, True, False, False, True, False]
    seeds = [101, None, 103, 104, None, None, 106]
    return probs, is_greedy, seeds


def _amount(k: int | None) -> str:
    if k is None:
        return "an amount that is not a whole number of vocab_size draws"
    return "nothing" if k == 0 else f"{k} x vocab_size numbers"


def _generators(seeds):
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def _draws(generator: torch.Generator, start: torch.Tensor, vocab: int, most: int = 12):
    """How many draws of `vocab` exponentials took `generator` from state
    `start` to its state now (None if no whole number does)."""
    now = generator.get_state()
    probe = torch.Generator()
    probe.set_state(start)
    for k in range(most + 1):
        if torch.equal(probe.get_state(), now):
            return k
        torch.empty(vocab).exponential_(generator=probe)
    return None


def _check_draw_fixture(sample_tokens) -> None:
    probs, is_greedy, seeds = _draw_case()
    gens, shared = _generators(seeds), torch.Generator().manual_seed(7)
    expected = reference_sample(probs, is_greedy, _generators(seeds),
                                torch.Generator().manual_seed(7))
    starts = [None if g is None else g.get_state() for g in gens]
    shared_start, global_start = shared.get_state(), torch.random.get_rng_state()
    with learner_code("your sample_tokens"):
        got = sample_tokens(probs.clone(), list(is_greedy), list(gens), shared)
    global_moved = not torch.equal(torch.random.get_rng_state(), global_start)
    got = _token_list(got, len(is_greedy), DV, "on the fixed rows")

    head = f"Day {DAY}, exercise 3: on {len(seeds)} rows (seeds {seeds}, greedy {is_greedy}), "
    for row in (2, 5):
        if got[row] != expected[row]:
            raise AssertionError(
                head + f"greedy row {row} got token {got[row]}, but its most likely token is "
                f"{expected[row]}. A greedy row (temperature 0) takes the argmax and draws "
                "nothing."
            )
    if starts[2] is not None and _draws(gens[2], starts[2], DV) != 0:
        raise AssertionError(
            head + "greedy row 2 (a greedy request with a seed) advanced its generator: greedy "
            "rows consume no random numbers, seeded or not."
        )
    shared_draws = _draws(shared, shared_start, DV)
    seeded = [row for row in range(len(seeds)) if seeds[row] is not None and not is_greedy[row]]
    unseeded = [row for row in range(len(seeds)) if seeds[row] is None and not is_greedy[row]]
    counts = {row: _draws(gens[row], starts[row], DV) for row in seeded}
    if any(k is None for k in counts.values()):
        raise AssertionError(
            head + "the seeded rows drew from their own generators, but not vocab_size "
            "exponentials each: their streams moved by "
            + "; ".join(f"row {row}: {_amount(k)}" for row, k in counts.items())
            + ". The engine (and vLLM's _multinomial) draws noise = torch.empty(vocab_size)"
            ".exponential_(generator=g) and takes argmax(probs / noise): exponential noise is "
            "what makes that argmax land on token i with probability probs[i]; uniform_ or "
            "torch.rand gives another distribution, and moves the stream differently."
        )
    if any(k != 1 for k in counts.values()):
        said = "; ".join(f"row {row}'s gave {_amount(k)}" for row, k in counts.items())
        if all(k == 0 for k in counts.values()):
            where = ("torch's global random generator" if global_moved else
                     "the shared generator" if shared_draws and shared_draws > len(unseeded)
                     else "another generator (a new one made from the seed each call draws "
                     "the same numbers every step)")
            problem = (f"the seeded rows {seeded} did not draw from their own generators "
                       f"({said}), so the draw came from {where}.")
        elif any(k == 0 for k in counts.values()):
            problem = (f"one seeded request's generator served other rows too ({said}): a "
                       "request's stream then moves with whatever else is in the batch.")
        else:
            problem = (f"the seeded rows drew too much from their own generators ({said}). "
                       "Each sampled row draws exactly one noise vector of vocab_size numbers "
                       "per step; a draw whose size depends on the batch (e.g. "
                       "torch.empty_like(probs).exponential_(generator=g) for every row) moves "
                       "the stream by an amount that depends on the batch.")
        raise AssertionError(
            head + problem + " Each seeded request draws from generators[row], and only "
            "it does, one noise vector per step: that is what makes its tokens the same "
            "whatever else is in the batch (a batch-wide generator gives a seeded request "
            "different tokens in every batch)."
        )
    if global_moved:
        raise AssertionError(
            head + "your code drew from torch's global random generator (torch.rand, or "
            "exponential_() or torch.multinomial without generator=). Every draw must come "
            "from the row's generator: generators[row], or shared_generator for rows without "
            "a seed."
        )
    if shared_draws != len(unseeded):
        extra = None if shared_draws is None else shared_draws - len(unseeded)
        why = {
            1: "the greedy row without a seed drew noise from it too",
            2: "the greedy rows drew noise too",
            len(seeded): "the seeded rows drew from it too",
        }.get(extra, "")
        if shared_draws == 0:
            why = "the unseeded rows did not draw from it"
        raise AssertionError(
            head + f"the shared generator gave {_amount(shared_draws)}, but only the "
            f"{len(unseeded)} unseeded sampled rows ({unseeded}) draw from it, one vocab_size "
            "noise vector each" + (f": {why}" if why else "") + ". Greedy rows draw nothing "
            "and seeded rows draw from their own generator: otherwise every unseeded "
            "request's tokens depend on how many greedy or seeded requests share its batch."
        )
    if got != expected:
        raise AssertionError(
            head + f"the rows drew from the right generators, but the tokens are {got}; the "
            f"engine's draw gives {expected}. Use the exponential race, as vLLM's "
            "_multinomial does: noise = torch.empty(vocab_size).exponential_(generator=g), "
            "then token = argmax(probs[row] / noise) (dividing, not multiplying), one row at a "
            "time in row order."
        )


def exercise_3(sample_tokens) -> None:
    _check_draw_fixture(sample_tokens)
    _check_draw_in_engine(sample_tokens)
    passed(DAY, 3)


def _check_draw_in_engine(sample_tokens) -> None:
    """The same seeded request alone and in two other batches, the learner's
    draw inside the engine: its tokens must be the same in all three, and
    every request's must equal the engine's own on the same batch."""
    batches = WORKLOADS["draw"]
    refs = _reference("draw")
    mine = []
    for batch in batches:
        sampler = LabSampler(lab_llm().llm_engine.model_config.seed, sample=sample_tokens)
        with learner_code("your sample_tokens, inside the engine,"):
            mine.append(run_requests(batch, sampler))
    where = [[p for p, _ in batch].index(SEEDED_PROMPT) for batch in batches]
    alone = mine[0][where[0]]
    for b in (1, 2):
        theirs = mine[b][where[b]]
        assert refs[b][where[b]] == refs[0][where[0]], "the engine itself is not batch-invariant"
        if theirs != alone:
            names = [f"{p!r} ({_describe(s)})" for p, s in batches[b]]
            raise AssertionError(
                f"Day {DAY}, exercise 3: the seeded request {SEEDED_PROMPT!r} "
                f"({_describe(SEEDED)}) is not batch-invariant with your sampler inside the "
                f"engine:\n  alone:            {list(alone)}  {_texts(alone)}\n"
                f"  in batch {b}:       {list(theirs)}  {_texts(theirs)}\n"
                f"  (batch {b}: {', '.join(names)})\n"
                f"The engine's own sampler gives {list(refs[0][where[0]])} in both. Its logits "
                "are the same in every batch, so the difference is the random numbers: a "
                "seeded request must draw from its own generator only (one noise vector per "
                "step), never from a generator the whole batch shares."
            )
    for b, batch in enumerate(batches):
        for (prompt, params), ref, got in zip(batch, refs[b], mine[b], strict=True):
            if ref != got:
                i = _first_difference(ref, got)
                kind = ("greedy" if params.temperature == 0 else
                        "seeded" if params.seed is not None else "unseeded")
                hint = {
                    "greedy": "a greedy request takes the argmax of probs at every step.",
                    "unseeded": "unseeded requests share the engine's generator, and draw from "
                    "it in row order, one noise vector each; a greedy or seeded row that also "
                    "draws from it shifts every unseeded row after it.",
                    "seeded": "the seeded request is the same in every batch but not the "
                    "engine's: draw noise = torch.empty(vocab_size).exponential_(generator=g) "
                    "and take argmax(probs / noise).",
                }[kind]
                raise AssertionError(
                    f"Day {DAY}, exercise 3: inside the engine, batch {b}'s {kind} request "
                    f"{prompt!r} ({_describe(params)}) differs from the engine's own sampler "
                    f"at output token {i}:\n  engine's: {list(ref)}  {_texts(ref)}\n"
                    f"  yours:    {list(got)}  {_texts(got)}\nHint: {hint}"
                )


# -- the workloads the engine runs ---------------------------------------------------------

SEEDED_PROMPT = "Once upon a time"
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)

WORKLOADS: dict[str, list[Requests]] = {
    "penalties": [[
        ("Once upon a time", SamplingParams(temperature=0, repetition_penalty=1.3,
                                            max_tokens=14, ignore_eos=True)),
        ("The little dog", SamplingParams(temperature=0, repetition_penalty=1.2,
                                          presence_penalty=0.5, frequency_penalty=0.4,
                                          max_tokens=14, ignore_eos=True)),
        ("Mia and Ben", SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.6,
                                       presence_penalty=-0.3, max_tokens=10, ignore_eos=True)),
        ("One day", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    ]],
    "warp": [[
        ("Once upon a time", SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=8,
                                            ignore_eos=True)),
        ("The little dog", SamplingParams(temperature=1.5, top_p=0.6, seed=12, max_tokens=8,
                                          ignore_eos=True)),
        ("Mia and Ben", SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, seed=13,
                                       max_tokens=8, ignore_eos=True)),
        ("One day", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        ("Once upon a time, there", SamplingParams(temperature=1.3, min_p=0.2, seed=14,
                                                   max_tokens=8, ignore_eos=True)),
    ]],
    "draw": [
        [(SEEDED_PROMPT, SEEDED)],
        [("The little dog", SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)),
         (SEEDED_PROMPT, SEEDED),
         ("One day, a girl named Mia", SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))],
        [("Mia and Ben", SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=8,
                                        ignore_eos=True)),
         ("Once upon a time, there", SamplingParams(temperature=0, max_tokens=5,
                                                    ignore_eos=True)),
         ("The little dog", SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)),
         (SEEDED_PROMPT, SEEDED)],
    ],
}

