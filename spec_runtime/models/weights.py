"""Loading HF-named checkpoint tensors into a model built from spec_runtime.layers.

Each tensor goes to the module that owns the parameter: a layer with a
`weight_loader` (the linear layers) copies its own slice, or shard of a fused
weight; any other parameter takes the whole tensor. Unknown names, wrong shapes and
missing tensors (or missing shards of a fused weight) raise ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from spec_runtime.layers.linear import default_weight_loader


def _expected(model: nn.Module) -> set[tuple[str, object]]:
    """(parameter name, shard id or None) of every tensor the checkpoint must bring."""
    out: set[tuple[str, object]] = set()
    for name, _ in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        shard_ids = getattr(owner, "shard_ids", ())
        if shard_ids:
            out.update((name, s) for s in shard_ids)
        else:
            out.add((name, None))
    return out


@torch.no_grad()
def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    packed: Mapping[str, tuple[str, object]], skip: Callable[[str], bool]) -> None:
    """Copy (HF name, tensor) pairs into `model`. packed: HF module name -> (our fused
    module name, shard id); skip(name): tensors the model has no use for."""
    params = dict(model.named_parameters())
    expected = _expected(model)
    loaded: set[tuple[str, object]] = set()
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if skip(name):
            continue
        shard = None
        for hf_part, (ours, shard_id) in packed.items():
            if f".{hf_part}." in name:
                name, shard = name.replace(hf_part, ours), shard_id
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        owner = model.get_submodule(name.rpartition(".")[0])
        loader = getattr(owner, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        except ValueError as e:
            raise ValueError(f"{hf_name}: {e}") from None
        loaded.add((name, shard))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
