"""Train the shipped teaching model: corpus, tokenizer, a small Llama, save.

Everything comes from one seed: the stories (tools/model/corpus.py), the
tokenizer trained on them, the initial weights and the batch order. The run
length is a number of optimizer steps, never a wall-clock budget, so a
re-run on a busy or a fast machine gives the same checkpoint (up to
floating-point differences between CPU kernels).

    nice -n 10 python -m tools.model.train      # writes minivllm/assets/minivllm-stories

Any field of `TrainConfig` is a flag (`--steps 200 --hidden-size 64 --out DIR`).
The checkpoint is saved at every evaluation, so a long run can be sampled
(python -m tools.model.samples DIR) before it ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from minivllm.assets import DEFAULT_MODEL
from tools.model.corpus import generate_stories
from tools.model.tokenizer import BOS_ID, EOS_ID, train_byte_level_bpe

IGNORE = -100  # label of padding: no loss


@dataclass
class TrainConfig:
    out: str = DEFAULT_MODEL
    seed: int = 0
    # Corpus: training and held-out stories come from different seeds.
    num_stories: int = 40000
    num_heldout_stories: int = 256
    vocab_size: int = 2048  # an upper bound: BPE stops when every word is one token
    # Model: a Llama with grouped-query attention (2 query heads per KV head).
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    # Optimisation
    steps: int = 1200
    batch_size: int = 32  # stories per step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    threads: int = 2


def encode_stories(tokenizer, stories: list[str]) -> list[list[int]]:
    """BOS (added by the tokenizer) + story + EOS: how a story is generated."""
    return [ids + [EOS_ID] for ids in tokenizer(stories)["input_ids"]]


def make_batch(stories: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One story per row, right-padded; the padding carries no loss.

    Every story starts at position 0 after BOS, exactly as a prompt does at
    inference, and no row attends across two stories. Right padding needs no
    attention mask: causal attention never lets a real token see it.
    """
    width = max(map(len, stories))
    input_ids = torch.full((len(stories), width), EOS_ID)
    labels = torch.full((len(stories), width), IGNORE)
    for row, ids in enumerate(stories):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(ids)
    return input_ids, labels


def batches(stories: list[list[int]], batch_size: int, rng: random.Random):
    """Endless batches, epoch by epoch; stories of similar length share a
    batch (sorted within windows of 16 batches) so little compute is padding."""
    while True:
        order = list(range(len(stories)))
        rng.shuffle(order)
        window = 16 * batch_size
        epoch = []
        for w in range(0, len(order) - batch_size + 1, window):
            chunk = sorted(order[w : w + window], key=lambda i: len(stories[i]))
            epoch += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
        rng.shuffle(epoch)
        for idx in epoch:
            if len(idx) == batch_size:
                yield make_batch([stories[i] for i in idx])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def loss_of(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token loss over the labelled positions, and their count."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
        reduction="sum",
    )  # fmt: skip
    return loss, int((targets != IGNORE).sum())


@torch.no_grad()
def heldout_loss(model, stories: list[list[int]], batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(stories), batch_size):
        loss, n = loss_of(model, *make_batch(stories[i : i + batch_size]))
        total, count = total + float(loss), count + n
    model.train()
    return total / count


def build_model(cfg: TrainConfig, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return model


def train(cfg: TrainConfig) -> dict[str, float]:
    """Train and save to `cfg.out`; returns the final losses and timings."""
    torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    texts = generate_stories(cfg.num_stories, seed=cfg.seed)
    heldout_texts = generate_stories(cfg.num_heldout_stories, seed=cfg.seed + 1_000_000)
    tokenizer = train_byte_level_bpe(texts, cfg.vocab_size, add_bos=True)
    stories = encode_stories(tokenizer, texts)
    heldout = encode_stories(tokenizer, heldout_texts)
    num_tokens = sum(map(len, stories))
    print(
        f"corpus: {len(texts)} stories, {sum(map(len, texts)) / 1e6:.1f} MB, "
        f"{num_tokens / 1e6:.2f} M tokens; vocabulary {len(tokenizer)}; "
        f"held-out {len(heldout)} stories",
        flush=True,
    )
    model = build_model(cfg, len(tokenizer))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay}],
        lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
    )  # fmt: skip
    data = batches(stories, cfg.batch_size, random.Random(cfg.seed))
    model.train()
    train_start, tokens_seen, recent = time.perf_counter(), 0, []
    result: dict[str, float] = {}
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        input_ids, labels = next(data)
        loss_sum, count = loss_of(model, input_ids, labels)
        optimizer.zero_grad(set_to_none=True)
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        tokens_seen += count
        recent.append(loss_sum.item() / count)
        last = step == cfg.steps - 1
        if (step + 1) % cfg.eval_every == 0 or last:
            elapsed = time.perf_counter() - train_start
            result = {
                "train_loss": sum(recent) / len(recent),
                "heldout_loss": heldout_loss(model, heldout, cfg.batch_size),
                "seconds_per_step": elapsed / (step + 1),
            }
            print(
                f"step {step + 1:5d}/{cfg.steps}  train loss {result['train_loss']:.3f}  "
                f"held-out loss {result['heldout_loss']:.3f}  lr {lr_at(step, cfg):.2e}  "
                f"{result['seconds_per_step']:.2f} s/step  {tokens_seen / 1e6:.2f} M tokens",
                flush=True,
            )
            recent = []
            model.save_pretrained(cfg.out)
            tokenizer.save_pretrained(cfg.out)
    result["wall_seconds"] = time.perf_counter() - start
    print(f"saved to {cfg.out} after {result['wall_seconds']:.0f} s", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default)
    return TrainConfig(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    train(parse_args())
