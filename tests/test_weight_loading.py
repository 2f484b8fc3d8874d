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


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_an_untied_head_is_loaded_as_stored(arch, tmp_path):
    """GPT-2 and OPT tie their head to the embedding by default; with
    tie_word_embeddings=False HF uses the stored lm_head, and so do we
    (vLLM 0.6 ties them anyway). Greedy tokens equal HF's, and differ from
    those of the same weights with the head tied, so the head is used."""
    from transformers import AutoModelForCausalLM

    from tests.hf_oracle import hf_greedy

    untied = make_tiny_model(arch, str(tmp_path / "untied"), tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(untied).eval()
    head, embedding = hf.get_output_embeddings().weight, hf.get_input_embeddings().weight
    assert head.data_ptr() != embedding.data_ptr()
    ours = _tokens(untied)
    assert ours == [hf_greedy(hf, prompt, max_tokens=8)[0] for prompt in PROMPTS]
    tied = shutil.copytree(untied, tmp_path / "tied")
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    assert _tokens(str(tied)) != ours


@pytest.mark.parametrize(
    ("rope_scaling", "context"),
    [
        ({"rope_type": "linear", "factor": 2.0}, 128),  # the context grows with the factor
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            64,
        ),
    ],
)
def test_rope_scaling_matches_hf_over_the_whole_context(rope_scaling, context, tmp_path):
    """A Llama with 64 positions and RoPE scaling: ours derives vLLM's
    context length (64 x 2 for linear scaling) and its greedy tokens equal
    HF's up to the end of it."""
    from transformers import AutoModelForCausalLM

    from tests.hf_oracle import hf_greedy

    path = make_tiny_model(
        "llama", str(tmp_path / "rope"), max_position_embeddings=64, rope_scaling=rope_scaling
    )
    llm = LLM(path)
    assert llm.llm_engine.model_config.max_model_len == context
    prompt = list(range(2, context - 16))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, max_tokens=16)[0]


def test_an_unsupported_rope_scaling_is_refused_before_loading(tmp_path):
    path = make_tiny_model(
        "llama", str(tmp_path / "yarn"),
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512},
    )
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' of this model is not supported"):
        LLM(path)
