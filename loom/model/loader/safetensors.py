"""Weights of a Hugging Face model directory: one or many (indexed) *.safetensors files."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loom.model.loader.hf_config import read_json

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files, from model.safetensors.index.json when present, else every *.safetensors.

    Raises:
        ValueError: no safetensors file, or the index names a missing shard.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{INDEX_FILE} names missing shards: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors weights")
    return files


@contextmanager
def _open_shard(path: Path) -> Iterator[object]:
    """safe_open on one shard; a damaged file (truncated, empty, a bad header) raises ValueError naming it.

    Raises:
        ValueError: the file is not a readable safetensors file.
    """
    try:
        with safe_open(str(path), framework="pt") as shard:
            yield shard
    except SafetensorError as exc:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({exc})") from None


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor in the stored dtype) for every tensor of every shard.

    Raises:
        ValueError: no shard, a missing shard, or a damaged one (named).
    """
    for path in safetensors_files(model_dir):
        with _open_shard(path) as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def safetensors_tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name of the checkpoint (headers only, no data read).

    Raises:
        ValueError: no shard, a missing shard, or a damaged one (named).
    """
    names: set[str] = set()
    for path in safetensors_files(model_dir):
        with _open_shard(path) as shard:
            names.update(shard.keys())
    return names
