"""Day 9's checkers (tools/labs/checks/day9.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

The answers are written here as plain functions (tests never import
notebooks); each mistake is the solution with one thing changed. The
engine is built once per process (`day9.lab_llm`), and the engine's own
tokens for each workload are computed once.
"""

from __future__ import annotations

import re

import pytest
import torch

from tools.labs.checks import day9

INF = float("-inf")


def _re(text: str) -> str:
    return re.escape(text)


# -- exercise 1: penalties -----------------------------------------------------------------


def _penalties(*, divide_all=False, inverted=False, output_only=False, per_occurrence=False,
               presence_prompt=False, frequency_prompt=False, frequency_once=False,
               presence_count=False, added=False, first_row=False, order=False, none=False):
    def apply_penalties(logits, prompt_token_ids, output_token_ids, presence_penalties,
                        frequency_penalties, repetition_penalties):
        num_rows, vocab_size = logits.shape

        def counts_of(lists):
            return torch.stack([torch.bincount(torch.tensor(ids, dtype=torch.long),
                                               minlength=vocab_size) for ids in lists]).float()

        out_counts = counts_of(output_token_ids)
        all_counts = counts_of([p + o for p, o in zip(prompt_token_ids, output_token_ids,
                                                      strict=True)])
        p, f, r = (t.unsqueeze(-1) for t in (presence_penalties, frequency_penalties,
                                             repetition_penalties))
        if first_row:
            p, f, r = p[:1], f[:1], r[:1]
        seen = (out_counts if output_only else all_counts) > 0

        def repetition(x):
            rr = r ** all_counts if per_occurrence else r
            if divide_all:
                penalized = x / rr
            elif inverted:
                penalized = torch.where(x > 0, x * rr, x / rr)
            else:
                penalized = torch.where(x > 0, x / rr, x * rr)
            return torch.where(seen, penalized, x)

        def openai(x):
            fc = all_counts if frequency_prompt else out_counts
            pc = all_counts if presence_prompt else out_counts
            freq = f * ((fc > 0).float() if frequency_once else fc)
            pres = p * (pc if presence_count else (pc > 0).float())
            return x + freq + pres if added else x - freq - pres

        out = repetition(openai(logits)) if order else openai(repetition(logits))
        return None if none else out

    return apply_penalties


def _penalties_other(logits, prompt_token_ids, output_token_ids, presence_penalties,
                     frequency_penalties, repetition_penalties):
    """Correct, written otherwise: token by token, on a copy."""
    out = logits.clone()
    for row in range(out.shape[0]):
        r = float(repetition_penalties[row])
        for token in set(prompt_token_ids[row]) | set(output_token_ids[row]):
            value = out[row, token]
            out[row, token] = value * r if value < 0 else value / r
        for token in set(output_token_ids[row]):
            count = output_token_ids[row].count(token)
            out[row, token] -= float(frequency_penalties[row]) * count
            out[row, token] -= float(presence_penalties[row])
    return out


@pytest.mark.parametrize("mistake, message", [
    ("divide_all", "the token becomes MORE likely"),
    ("inverted", "you multiplied the positive logits and divided the negative ones"),
    ("output_only", "your repetition penalty looked at the output tokens only"),
    ("per_occurrence", "once per occurrence"),
    ("presence_prompt", "your presence penalty counted prompt tokens"),
    ("frequency_prompt", "your frequency penalty counted prompt tokens"),
    ("frequency_once", "your frequency penalty ignores the count"),
    ("presence_count", "your presence penalty grows with the count"),
    ("added", "you added the presence and frequency penalties"),
    ("first_row", "every row got the first row's penalties"),
    ("order", "you applied presence and frequency before the repetition penalty"),
    ("none", "your apply_penalties returned NoneType, not a tensor"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day9.exercise_1(_penalties(**{mistake: True}))


@pytest.mark.parametrize("answer", [_penalties(), _penalties_other], ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day9.exercise_1(answer)
    assert capsys.readouterr().out == "Day 9, exercise 1: passed\n"


def test_exercise_1_in_the_engine_alone_catches_a_wrong_penalty():
    """The engine half is no formality: a wrong penalty changes real tokens."""
    with pytest.raises(AssertionError, match=r"inside the engine, 'Once upon a time' "
                       r"\(temperature=0, repetition_penalty=1.3\) differs"):
        day9._compare_in_engine("apply_penalties", "penalties", _penalties(output_only=True),
                                "penalties", "")


def test_exercise_1_turns_an_exception_into_a_message():
    def crashes(logits, prompt_token_ids, *rest):
        return logits.gather(1, prompt_token_ids)

    with pytest.raises(AssertionError, match=r"your apply_penalties raised TypeError(.|\n)*"
                       r"at the line `return logits.gather\(1, prompt_token_ids\)`"):
        day9.exercise_1(crashes)


# -- exercise 2: temperature, top-k, top-p, min-p --------------------------------------------


def _warp(*, temperature_after=False, multiply=False, drops_crossing=False, no_keep_one=False,
          p_one_drops_tail=False, min_p_logit=False, min_p_first=False, exact_k=False,
          first_row=False, probs=False, log_probs=False):
    def warp(logits, temperature, top_k, top_p, min_p):
        if first_row:
            temperature, top_k, top_p, min_p = (t[:1] for t in (temperature, top_k, top_p,
                                                                min_p))
        t = temperature.unsqueeze(-1)
        if not temperature_after:
            logits = logits * t if multiply else logits / t
        if exact_k:
            kept = torch.zeros_like(logits, dtype=torch.bool)
            for row in range(logits.shape[0]):
                k = int(top_k[min(row, top_k.numel() - 1)])
                kept[row, logits[row].topk(k).indices] = True
            logits = logits.masked_fill(~kept, INF)
        else:
            kth = logits.sort(dim=-1, descending=True).values.gather(
                -1, (top_k - 1).unsqueeze(-1).expand(logits.shape[0], 1))
            logits = logits.masked_fill(logits < kth, INF)

        def top_p_stage(logits):
            if drops_crossing or p_one_drops_tail:  # from the most likely token down
                descending, index = logits.sort(dim=-1, descending=True)
                sorted_probs = descending.softmax(-1)
                cum = sorted_probs.cumsum(-1)
                if drops_crossing:
                    drop_sorted = cum > top_p.unsqueeze(-1)
                else:
                    drop_sorted = cum - sorted_probs >= top_p.unsqueeze(-1)
            else:  # from the tail up, as vLLM and HF
                ascending, index = logits.sort(dim=-1)
                cum = ascending.softmax(-1).cumsum(-1)
                drop_sorted = cum <= 1 - top_p.unsqueeze(-1)
                if not no_keep_one:
                    drop_sorted[:, -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, index, drop_sorted)
            return logits.masked_fill(drop, INF)

        def min_p_stage(logits):
            if min_p_logit:
                return logits.masked_fill(
                    logits < min_p.unsqueeze(-1) * logits.amax(-1, keepdim=True), INF)
            p = logits.softmax(-1)
            return logits.masked_fill(p < min_p.unsqueeze(-1) * p.amax(-1, keepdim=True), INF)

        if min_p_first:
            logits = top_p_stage(min_p_stage(logits))
        else:
            logits = min_p_stage(top_p_stage(logits))
        if temperature_after:
            logits = logits / t
        if probs:
            return logits.softmax(-1).masked_fill(torch.isinf(logits), INF)
        if log_probs:
            return logits.log_softmax(-1)
        return logits

    return warp


def _warp_other(logits, temperature, top_k, top_p, min_p):
    """Correct, written otherwise: row by row; top-p from the most likely token
    down, skipped when off; min-p in log space."""
    out = []
    for row in range(logits.shape[0]):
        x = logits[row] / temperature[row]
        k = int(top_k[row])
        x = torch.where(x >= torch.topk(x, k).values[-1], x, torch.tensor(INF))
        if float(top_p[row]) < 1:
            probs = x.softmax(-1)
            order = probs.argsort(descending=True)
            mass_before = 0.0
            for token in order.tolist():
                if mass_before >= float(top_p[row]):
                    x[token] = INF
                mass_before += float(probs[token])
        if float(min_p[row]) > 0:
            x = torch.where(x - x.max() >= torch.log(min_p[row]), x, torch.tensor(INF))
        out.append(x)
    return torch.stack(out)


@pytest.mark.parametrize("mistake, message", [
    ("temperature_after", "you truncated before dividing by the temperature"),
    ("multiply", "you multiplied the logits by the temperature"),
    ("drops_crossing", "your top-p dropped the token that crosses top_p"),
    ("no_keep_one", "a row lost every token"),
    ("p_one_drops_tail", "with top_p = 1 (off) you dropped the unlikely tokens"),
    ("min_p_logit", "your min-p compared logits with min_p * the largest LOGIT"),
    ("min_p_first", "you applied min-p before top-p"),
    ("exact_k", "your top-k kept exactly k tokens and broke a tie"),
    ("first_row", "every row got the first row's parameters"),
    ("probs", "you returned probabilities"),
    ("log_probs", "you kept the right tokens but changed their values"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day9.exercise_2(_warp(**{mistake: True}))


@pytest.mark.parametrize("answer", [_warp(), _warp_other], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day9.exercise_2(answer)
    assert capsys.readouterr().out == "Day 9, exercise 2: passed\n"


def test_exercise_2_in_the_engine_alone_catches_temperature_after_top_p():
    with pytest.raises(AssertionError, match=r"inside the engine, .* differs from the "
                       r"engine's own sampler"):
        day9._compare_in_engine("warp", "warp", _warp(temperature_after=True), "warp", "")


def test_exercise_2_the_fixture_rows_are_what_they_say():
    """Each rule the fixture claims to test changes its row's mask."""
    args, _ = day9._warp_case()
    ref = day9.hf_warp(*args)
    kept = torch.isfinite(ref).sum(-1).tolist()
    assert kept == [3, 4, 2, 3, 3, 1, 8, 2]
    for flag, row in [("temperature_after", 0), ("exact_k", 1), ("drops_crossing", 2),
                      ("min_p_logit", 3), ("min_p_first", 4), ("no_keep_one", 5),
                      ("p_one_drops_tail", 6)]:
        wrong = day9._warp_variant(*args, **{flag: True})
        assert not torch.equal(torch.isfinite(wrong[row]), torch.isfinite(ref[row])), flag


# -- exercise 3: the draw ---------------------------------------------------------------------


def _sample(*, batch_shared=False, global_rng=False, first_generator=False,
            greedy_consumes=False, greedy_sampled=False, seeded_also_shared=False,
            whole_block=False, multiply=False, uniform=False, multinomial=False, reseed=False):
    def sample_tokens(probs, is_greedy, generators, shared_generator):
        num_rows, vocab_size = probs.shape
        if batch_shared or global_rng:
            noise = torch.empty_like(probs)
            noise.exponential_(generator=None if global_rng else shared_generator)
            picked = (probs / noise).argmax(-1)
            return [int(probs[r].argmax()) if is_greedy[r] else int(picked[r])
                    for r in range(num_rows)]
        if first_generator:
            g = next((g for g in generators if g is not None), shared_generator)
            generators = [g] * num_rows
        tokens = []
        for row in range(num_rows):
            generator = generators[row] if generators[row] is not None else shared_generator
            if reseed and generators[row] is not None:
                generator = torch.Generator().manual_seed(generators[row].initial_seed())
            if is_greedy[row] and not greedy_sampled:
                if greedy_consumes:
                    torch.empty(vocab_size).exponential_(generator=generator)
                tokens.append(int(probs[row].argmax()))
                continue
            if seeded_also_shared and generators[row] is not None:
                torch.empty(vocab_size).exponential_(generator=shared_generator)
            if multinomial:
                tokens.append(int(torch.multinomial(probs[row], 1, generator=generator)))
                continue
            if whole_block:
                noise = torch.empty_like(probs).exponential_(generator=generator)[row]
            elif uniform:
                noise = torch.empty(vocab_size).uniform_(generator=generator)
            else:
                noise = torch.empty(vocab_size).exponential_(generator=generator)
            score = probs[row] * noise if multiply else probs[row] / noise
            tokens.append(int(score.argmax()))
        return tokens

    return sample_tokens


def _sample_other(probs, is_greedy, generators, shared_generator):
    """Correct, written otherwise: the unseeded rows' noise in one draw (the
    same stream as row by row), Gumbel-max in log space."""
    num_rows, vocab_size = probs.shape
    unseeded = [r for r in range(num_rows) if not is_greedy[r] and generators[r] is None]
    shared_noise = torch.empty(len(unseeded), vocab_size).exponential_(generator=shared_generator)
    noise = {r: shared_noise[i] for i, r in enumerate(unseeded)}
    tokens = torch.empty(num_rows, dtype=torch.long)
    for r in range(num_rows):
        if is_greedy[r]:
            tokens[r] = probs[r].argmax()
            continue
        e = noise[r] if r in noise else torch.empty(vocab_size).exponential_(
            generator=generators[r])
        tokens[r] = (probs[r].log() - e.log()).argmax()
    return tokens


@pytest.mark.parametrize("mistake, message", [
    ("batch_shared", "so the draw came from the shared generator"),
    ("global_rng", "so the draw came from torch's global random generator"),
    ("first_generator", "one seeded request's generator served other rows too"),
    ("greedy_consumes", "greedy row 2 (a greedy request with a seed) advanced its generator"),
    ("greedy_sampled", "greedy row 5 got token 4, but its most likely token is 5"),
    ("seeded_also_shared", "the seeded rows drew from it too"),
    ("whole_block", "row 0's gave 7 x vocab_size numbers"),
    ("multiply", "but the tokens are [1, 2, 2, 5, 2, 5, 2]; the engine's draw gives"),
    ("uniform", "but not vocab_size exponentials each"),
    ("reseed", "a new one made from the seed each call draws the same numbers every step"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day9.exercise_3(_sample(**{mistake: True}))


def test_exercise_3_greedy_rows_drawing_from_the_shared_generator_are_named():
    def greedy_draws_shared(probs, is_greedy, generators, shared_generator):
        for row in range(probs.shape[0]):
            if is_greedy[row] and generators[row] is None:
                torch.empty(probs.shape[-1]).exponential_(generator=shared_generator)
        return _sample()(probs, is_greedy, generators, shared_generator)

    with pytest.raises(AssertionError,
                       match=_re("the greedy row without a seed drew noise from it too")):
        day9.exercise_3(greedy_draws_shared)


def test_exercise_3_torch_multinomial_of_one_sample_is_the_same_draw():
    """In this PyTorch, torch.multinomial(p, 1, generator=g) is the exponential
    race itself on the CPU: a learner who uses it gives the engine's tokens."""
    day9._check_draw_fixture(_sample(multinomial=True))


@pytest.mark.parametrize("answer", [_sample(), _sample_other], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day9.exercise_3(answer)
    assert capsys.readouterr().out == "Day 9, exercise 3: passed\n"


def test_exercise_3_in_the_engine_a_batch_wide_generator_breaks_batch_invariance():
    """The engine half alone catches the batch-wide generator: the same
    seeded request, alone and in another batch, gets other tokens."""
    with pytest.raises(AssertionError, match=r"is not batch-invariant with your sampler inside "
                       r"the engine(.|\n)*alone: (.|\n)*in batch 1"):
        day9._check_draw_in_engine(_sample(batch_shared=True))


def test_exercise_3_in_the_engine_greedy_rows_that_draw_shift_the_unseeded_ones():
    def greedy_draws_shared(probs, is_greedy, generators, shared_generator):
        for row in range(probs.shape[0]):
            if is_greedy[row]:
                torch.empty(probs.shape[-1]).exponential_(generator=shared_generator)
        return _sample()(probs, is_greedy, generators, shared_generator)

    with pytest.raises(AssertionError, match=r"batch 1's unseeded request 'The little dog'"):
        day9._check_draw_in_engine(greedy_draws_shared)


def test_the_lab_sampler_restores_the_engines_own():
    llm = day9.lab_llm()
    own = day9.model_runner(llm).sampler
    with pytest.raises(AssertionError):
        day9.exercise_3(_sample(batch_shared=True))
    assert day9.model_runner(llm).sampler is own


def test_an_exception_inside_the_engine_is_named_and_the_engine_rebuilt():
    def fails_on_real_vocab(logits, *args):
        if logits.shape[-1] > 100:
            raise ValueError("too wide")
        return _warp()(logits, *args)

    with pytest.raises(AssertionError, match=r"your warp, inside the engine, raised ValueError: "
                       r"too wide, in your `fails_on_real_vocab`"):
        day9.exercise_2(fails_on_real_vocab)
    assert not day9.lab_llm().llm_engine.errored
