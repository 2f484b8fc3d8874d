"""The Hugging Face oracle shared by the equivalence tests: HF greedy
`generate` on each prompt alone (no padding), and a comparison that allows a
divergence only where HF's own top-2 logits are a float-rounding tie."""

from __future__ import annotations

import torch

from minivllm import LLM, SamplingParams

# Around the block boundaries of block_size 16 and 8.
PROMPT_LENS = [1, 3, 7, 15, 16, 17, 33, 60]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# Below this gap between Hugging Face's top-2 logits, float rounding may
# legitimately pick the other token.
TIE_MARGIN = 1e-4


def poison_kv_cache(llm: LLM) -> None:
    """Fill both block pools with NaN: a read of any slot not written this
    run (a stale or padding slot) would turn the output into NaN."""
    cache_engine = llm.llm_engine.worker.cache_engine
    for layer in cache_engine.gpu_cache + cache_engine.cpu_cache:
        layer.fill_(float("nan"))


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


_HF_CACHE: dict[tuple, tuple[list[int], list[float]]] = {}


def hf_greedy(hf, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per step, the gap between its top-2 logits."""
    key = (id(hf), tuple(prompt), max_tokens)
    if key not in _HF_CACHE:
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=hf.generation_config.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        gaps = [float(t[0] - t[1]) for t in (step[0].topk(2).values for step in out.logits)]
        _HF_CACHE[key] = (tokens, gaps)
    return _HF_CACHE[key]


def assert_matches_hf(hf, prompts, outputs, max_tokens: int = MAX_TOKENS) -> None:
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        ref, gaps = hf_greedy(hf, prompt, max_tokens)
        diverge = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
        if diverge is None:
            assert len(ours) == len(ref), f"prompt of {len(prompt)}: {ours} vs HF {ref}"
        else:
            assert gaps[diverge] < TIE_MARGIN, (
                f"prompt of {len(prompt)} tokens diverges from HF at output {diverge}: "
                f"{ours} vs {ref} (HF top-2 gap {gaps[diverge]:.2e})"
            )
        expected = "stop" if ref[-1] == hf.generation_config.eos_token_id else "length"
        assert output.outputs[0].finish_reason == expected
