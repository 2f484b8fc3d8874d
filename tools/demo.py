"""`make demo`: generate from a few prompts with the vLLM-style API.

Until the course's trained model ships in the repo, this builds a tiny
randomly initialised Llama checkpoint on the fly (so its text is gibberish;
the point is the engine). Pass a checkpoint directory to use a real model:

    python tools/demo.py [MODEL_DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minivllm import LLM, SamplingParams  # noqa: E402
from tools.tiny_models import make_tiny_model  # noqa: E402


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        model = make_tiny_model("llama", os.path.join(tempfile.mkdtemp(), "tiny-llama"))
        print(f"Built a tiny random Llama checkpoint at {model}\n")

    llm = LLM(model=model)
    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "Once upon a time",
        "The scheduler picks",
    ]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24)
    for title, params in (("greedy", greedy), ("temperature 0.8, top_p 0.95", sampled)):
        print(f"== {title} ==")
        for out in llm.generate(prompts, params):
            completion = out.outputs[0]
            print(f"{out.prompt!r} -> {completion.text!r}")
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
