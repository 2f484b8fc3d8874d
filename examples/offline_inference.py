"""Offline inference in a dozen lines: the first script to run.

vLLM's `examples/offline_inference.py` sends a few prompts through a model
from the Hugging Face hub. Here `LLM()` with no model loads the small story
model that ships with minivllm, so it runs offline, on a CPU:

    python examples/offline_inference.py

Then read what `llm.generate` did, one call at a time, from
`reference_impl/minivllm/entrypoints/llm.py` (Day 1).
"""

from minivllm import LLM, SamplingParams

prompts = [
    "Once upon a time",
    "The little dog",
    "One day, a girl named Lily",
    "The sun was shining and",
]
# Random sampling from the 95 % most likely tokens, a bit sharpened.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM()
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
