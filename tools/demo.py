"""`make demo`: generate from a few prompts with the vLLM-style API.

By default this runs the small story model that ships in the package
(minivllm/assets/), so the text is readable: greedy decoding finishes its
stories by itself ("stop"), while the sampled ones are cut at `max_tokens`
("length"). Pass a checkpoint directory to use another model:

    python tools/demo.py [MODEL_DIR]
"""

from __future__ import annotations

import sys

from minivllm import LLM, SamplingParams


def main() -> None:
    # No model: LLM() loads the shipped story model.
    llm = LLM(model=sys.argv[1]) if len(sys.argv) > 1 else LLM()
    prompts = ["Once upon a time", "The little dog", "Lily was a kind girl"]
    greedy = SamplingParams(temperature=0, max_tokens=256)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40)
    for title, params in (("greedy", greedy), ("temperature 0.8, top_p 0.95", sampled)):
        print(f"== {title} ==")
        for out in llm.generate(prompts, params):
            completion = out.outputs[0]
            print(out.prompt + completion.text)
            ids = completion.token_ids[:12]
            print(f"    token_ids={ids}...  finish_reason={completion.finish_reason}")
        print()

    engine = llm.llm_engine
    cache = engine.cache_config
    print(
        f"KV cache: {cache.num_gpu_blocks} device blocks and {cache.num_cpu_blocks} swap blocks "
        f"of {cache.block_size} tokens; model dtype {engine.model_config.dtype}."
    )


if __name__ == "__main__":
    main()
