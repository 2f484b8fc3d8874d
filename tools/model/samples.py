"""Print what a story checkpoint writes, through the engine: greedy
continuations of story openings (with their finish reasons) and a few
temperature-0.8 samples. The model card's samples come from here.

    python -m tools.model.samples [MODEL_DIR]
"""

from __future__ import annotations

import sys

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL

OPENINGS = [
    "Once upon a time",
    "The little dog",
    "Lily was a kind girl",
    "There was once a brave fox",
    "Long ago, there was a shy rabbit called Tom",
    "In a small house by the sea",
]


def main() -> None:
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL)
    greedy = SamplingParams(temperature=0, max_tokens=256)
    for out in llm.generate(OPENINGS, greedy):
        c = out.outputs[0]
        print(f"== greedy: {out.prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
        print(out.prompt + c.text + "\n")
    for seed in (1, 2):
        params = SamplingParams(temperature=0.8, max_tokens=256, seed=seed)
        c = llm.generate(["Once upon a time"], params)[0].outputs[0]
        print(f"== temperature 0.8, seed {seed} ({len(c.token_ids)} tokens, {c.finish_reason})")
        print("Once upon a time" + c.text + "\n")


if __name__ == "__main__":
    main()
