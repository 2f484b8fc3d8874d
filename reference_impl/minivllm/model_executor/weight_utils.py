"""Finding a checkpoint and streaming its tensors into a model."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open
from torch import nn


def resolve_model_path(model: str) -> str:
    """A local checkpoint directory, or a hub id downloaded to the HF cache.

    Raises a `FileNotFoundError` that names the path and what was looked for.
    """
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(
                f"Model directory {model!r} has no config.json: expected a Hugging Face "
                "checkpoint (config.json, *.safetensors, tokenizer files)."
            )
        return model
    looks_like_hub_id = model.count("/") <= 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
            )
        except Exception as e:  # offline, unknown id, gated repo ...
            raise FileNotFoundError(
                f"Model {model!r} is not a local directory and could not be fetched as a "
                f"Hugging Face hub id ({type(e).__name__}: {e}). Pass the path of a "
                "checkpoint directory holding config.json and *.safetensors."
            ) from e
    raise FileNotFoundError(
        f"Model path {model!r} does not exist: expected a directory holding config.json "
        "and *.safetensors weights."
    )


def safetensors_weights_iterator(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every *.safetensors file."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weight files in {path!r}")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    yield name, tensor
        except (SafetensorError, OSError) as e:
            # A truncated or corrupt file: say which one.
            raise ValueError(f"Could not read the weights file {file!r}: {e}") from e


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor (or this rank's shard of it) into a parameter
    (or its rows of a fused one), refusing a shape that does not match."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape {tuple(loaded.shape)} in the checkpoint, the model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, str | int]] = (),
) -> None:
    """Copy checkpoint tensors into the model's parameters, by name.

    Each parameter's `weight_loader` (layers/linear.py) copies this rank's
    shard of the full checkpoint tensor; a checkpoint part listed in
    `stacked_params_mapping` goes into its rows of a fused projection. Every
    parameter must be loaded exactly once, except an output head tied to
    the input embedding.

    Skipped, as vLLM's models skip them: a stored `lm_head.weight` when the
    head is tied (the head *is* the embedding, whatever copy the checkpoint
    holds), and a bias the model does not have (quantized checkpoints carry
    them). Any other tensor the model lacks is refused by name.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for checkpoint_name, tensor in weights:
        if "rotary_emb.inv_freq" in checkpoint_name:
            continue  # derived from the config, not a weight
        if tied and checkpoint_name == "lm_head.weight":
            continue
        name, shard_id = checkpoint_name, None
        for fused, part, part_id in stacked_params_mapping:
            if f".{part}." in name:
                name, shard_id = name.replace(f".{part}.", f".{fused}."), part_id
                break
        if name not in params:
            if name.endswith(".bias"):
                continue
            raise ValueError(f"Checkpoint tensor {checkpoint_name!r} matches no model parameter")
        param = params[name]
        try:
            if shard_id is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"Checkpoint tensor {checkpoint_name!r}: {e}") from e
        loaded.add(name)
    # A tied parameter appears under two names; loading either loads both.
    loaded_ids = {id(params[n]) for n in loaded}
    missing = [n for n, p in params.items() if id(p) not in loaded_ids]
    if missing:
        raise ValueError(f"Checkpoint is missing weights: {sorted(missing)[:8]}")
