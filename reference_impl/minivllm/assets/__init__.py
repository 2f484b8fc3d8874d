"""Files shipped inside the package: the course's own small model.

Model hubs are unreachable from our machines and from many workshop rooms,
and random weights print gibberish, so a tiny Llama trained here on
generated short stories ships with the package. It is the default model of
`LLM()`, `make demo`, the tracer and the labs, and it loads through exactly
the same path as any Hugging Face checkpoint directory.
"""

from __future__ import annotations

import os

# The checkpoint directory (config.json, model.safetensors, tokenizer files
# and the model card README.md); see tools/model/ for how it is made.
DEFAULT_MODEL: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minivllm-stories")
