"""`logit_bias` (OpenAI's) and `allowed_token_ids` (vLLM's) on both engines:
a bias is added to a token's logit before any other stage, and only the
allowed tokens can be drawn. The oracle: Hugging Face's `generate` with the
same bias (`sequence_bias`) or the same allowed tokens
(`prefix_allowed_tokens_fn`), greedy.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def hf_greedy(hf, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_TOKENS,
                          **kwargs)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_biased_and_restricted_greedy_runs_equal_hugging_faces(model, hf_model, use_v1):
    hf = hf_model("llama")
    plain = hf_greedy(hf)
    # Raise two tokens the plain run never picks enough to matter, and ban
    # the plain run's first token: the run must change.
    fresh = [t for t in range(20, 200) if t not in plain][:2]
    bias = {fresh[0]: 6.0, fresh[1]: 3.0, plain[0]: -100.0}
    allowed = [t for t in range(30, 60) if t not in plain[:1]]
    biased = hf_greedy(hf, sequence_bias={(t,): b for t, b in bias.items()})
    restricted = hf_greedy(hf, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert biased != plain and restricted != plain  # the test can fail

    llm = LLM(model, use_v1=use_v1, max_model_len=64)
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 3,
        [SamplingParams(**greedy, logit_bias=bias), SamplingParams(**greedy),
         SamplingParams(**greedy, allowed_token_ids=allowed)],
        use_tqdm=False,
    )
    assert [list(o.outputs[0].token_ids) for o in outputs] == [biased, plain, restricted]


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_random_draws_keep_to_the_allowed_tokens(model, use_v1):
    llm = LLM(model, use_v1=use_v1, max_model_len=64)
    allowed = [40, 41, 42]
    params = SamplingParams(temperature=1.5, max_tokens=24, seed=3, allowed_token_ids=allowed,
                            logit_bias={41: -100.0})
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    tokens = set(out.outputs[0].token_ids)
    assert tokens <= {40, 42} and len(tokens) == 2


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_token_ids_the_model_cannot_sample_are_refused_naming_the_field(model, use_v1):
    engine = LLM(model, use_v1=use_v1, max_model_len=64).llm_engine
    vocab = engine.model_config.hf_config.vocab_size
    eos = engine.tokenizer.eos_token_id
    cases = [
        (dict(logit_bias={vocab: 1.0}), "logit_bias token ids"),
        (dict(allowed_token_ids=[3, vocab + 5]), r"allowed_token_ids \[\d+\] are outside"),
        (dict(allowed_token_ids=[eos], min_tokens=2), "allowed_token_ids .* are all stop"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request("r", {"prompt_token_ids": PROMPT}, SamplingParams(**kwargs))
        assert not engine.has_unfinished_requests()
