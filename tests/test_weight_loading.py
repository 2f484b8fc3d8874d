"""Loading a checkpoint by name (model_executor/weight_utils.py), as vLLM's
models' `load_weights` do: what is skipped, what is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from tools.tiny_models import make_tiny_model

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(path: str) -> list[list[int]]:
    llm = LLM(path, max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _split_into_shards(path, extra: dict[str, torch.Tensor]) -> None:
    """Rewrite the checkpoint as two shards with an index, `extra` in the second."""
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file(weights, path / first, metadata={"format": "pt"})
    save_file(extra, path / second, metadata={"format": "pt"})
    weight_map = {name: first for name in weights} | {name: second for name in extra}
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tied-llama")
    return make_tiny_model("llama", str(path), tie_word_embeddings=True)


def test_a_stored_copy_of_a_tied_head_is_skipped(tied_llama, tmp_path):
    """A tied checkpoint that also stores a (different) lm_head.weight, in a
    later shard: vLLM skips it, the head is the input embedding. Loaded into
    the shared parameter it would overwrite the embedding."""
    path = shutil.copytree(tied_llama, tmp_path / "with-head")
    embedding = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    _split_into_shards(path, {"lm_head.weight": torch.randn_like(embedding)})
    assert _tokens(str(path)) == _tokens(tied_llama)


def test_an_extra_bias_is_skipped_and_any_other_extra_tensor_refused(tiny_model_dir, tmp_path):
    """Biases the model does not have (q/k/v of a model without attention
    bias, fused here into qkv_proj) are skipped, as vLLM's load_weights skip
    them; any other unknown tensor is refused by its checkpoint name."""
    source = tiny_model_dir("llama")
    path = shutil.copytree(source, tmp_path / "extra-bias")
    weights = load_file(path / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    _split_into_shards(path, {
        "model.layers.0.self_attn.q_proj.bias": torch.randn(hidden),
        "model.layers.0.mlp.down_proj.bias": torch.randn(hidden),
    })
    assert _tokens(str(path)) == _tokens(source)

    path = shutil.copytree(source, tmp_path / "extra-weight")
    _split_into_shards(path, {"model.layers.0.self_attn.q_proj.scales": torch.randn(hidden)})
    unknown = r"'model\.layers\.0\.self_attn\.q_proj\.scales' matches no model parameter"
    with pytest.raises(ValueError, match=unknown):
        LLM(str(path), max_model_len=64)
