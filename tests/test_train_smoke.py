"""The shipped model's recipe keeps working: a few training steps of a tiny
Llama on a few stories, saved and loaded back through the engine. (The full
run is in the model card; this only guards the code path.)"""

from __future__ import annotations

import math
import os

from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from tools.model.corpus import generate_stories
from tools.model.train import parse_args, train


def test_corpus_is_deterministic_from_the_seed():
    assert generate_stories(5, seed=3) == generate_stories(5, seed=3)
    assert generate_stories(5, seed=3) != generate_stories(5, seed=4)


def test_a_few_training_steps_save_a_checkpoint_the_engine_loads(tmp_path, capsys):
    out = str(tmp_path / "model")
    flags = (
        f"--out {out} --num-stories 64 --num-heldout-stories 8 --vocab-size 400 "
        "--hidden-size 32 --intermediate-size 64 --num-hidden-layers 1 "
        "--num-attention-heads 4 --num-key-value-heads 2 --max-position-embeddings 256 "
        "--steps 4 --batch-size 4 --warmup-steps 2 --eval-every 2"
    )
    result = train(parse_args(flags.split()))
    log = capsys.readouterr().out
    assert "train loss" in log and "held-out loss" in log
    assert math.isfinite(result["train_loss"]) and math.isfinite(result["heldout_loss"])
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        os.listdir(out)
    )

    llm = LLM(model=out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt_ids = tokenizer("Once upon a time")["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id
    output = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert output.prompt_token_ids == prompt_ids
    assert len(output.outputs[0].token_ids) >= 1
