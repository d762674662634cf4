"""Find the repeated blocks of a model: the units ``ok.fsdp`` shards, gathers and prefetches.

``blocks=None`` picks the children of the model's largest ``nn.ModuleList``/``nn.Sequential``
whose children all have the same class (the transformer layers, the MLP blocks). "Largest" means
the most parameters, then the most children. Blocks are returned in registration order, which
``ok.fsdp`` takes as their forward order (as torchtitan does with ``model.layers``); pass a list of
modules in execution order when the two differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

BlockSpec = type | str | Sequence[type | str] | Sequence[nn.Module] | None


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeated_children(container: nn.Module) -> list[nn.Module] | None:
    """The children of ``container`` when it is a list of at least two same-class modules."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return None
    children = list(container.children())
    if len(children) < 2 or len({type(child) for child in children}) != 1:
        return None
    if not any(_num_params(child) for child in children):
        return None
    return children


def discover_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the largest ``ModuleList``/``Sequential`` of same-class modules.

    Raises:
        ValueError: the model has no such container; the message says how to name blocks.
    """
    best: list[nn.Module] | None = None
    best_key = (0, 0)
    for module in model.modules():
        children = _repeated_children(module)
        if children is None:
            continue
        key = (sum(_num_params(child) for child in children), len(children))
        if key > best_key:
            best, best_key = children, key
    if best is None:
        raise ValueError(
            f"ok.fsdp: blocks=None found no nn.ModuleList/nn.Sequential of two or more "
            f"same-class modules with parameters in {type(model).__name__}; pass blocks= a "
            "module class, a list of class names or a list of modules"
        )
    return best


def _outermost(model: nn.Module, matches: list[nn.Module]) -> list[nn.Module]:
    """Drop matches nested inside another match (a block's sub-block is part of the block)."""
    chosen = set(map(id, matches))
    nested: set[int] = set()
    for match in matches:
        for sub in match.modules():
            if sub is not match and id(sub) in chosen:
                nested.add(id(sub))
    return [m for m in model.modules() if id(m) in chosen and id(m) not in nested]


def _check_modules(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    inside = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if block is model:
            raise ValueError(
                "ok.fsdp: blocks contains the model itself; blocks are its repeated "
                "sub-modules (the model is sharded as the root after them)"
            )
        if id(block) not in inside:
            raise ValueError(
                f"ok.fsdp: blocks[{i}] ({type(block).__name__}) is not a sub-module of the "
                f"model ({type(model).__name__})"
            )
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("ok.fsdp: blocks lists the same module more than once")
    if len(_outermost(model, blocks)) != len(blocks):
        raise ValueError(
            "ok.fsdp: blocks contains a module nested inside another block; list only "
            "non-overlapping blocks"
        )
    return blocks


def resolve_blocks(model: nn.Module, blocks: BlockSpec) -> list[nn.Module]:
    """The modules ``ok.fsdp`` shards one by one, in forward order.

    Args:
        model (nn.Module): the whole model (not yet sharded).
        blocks: None (discover), a module class, a class name, a list of classes or class
            names (every outermost module of those classes), or a list of modules (used
            as given, in that order).

    Returns:
        list[nn.Module]: at least one block, none nested in another, none the model itself.

    Raises:
        ValueError: nothing matches, or a listed module is not a proper sub-module.
        TypeError: ``blocks`` is of an unsupported type.
    """
    if blocks is None:
        return discover_blocks(model)
    if isinstance(blocks, (type, str)):
        spec: list = [blocks]
    elif isinstance(blocks, (Sequence, nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
        spec = list(blocks)
    else:
        raise TypeError(
            "ok.fsdp: blocks must be None, a module class, a class name, or a non-empty list "
            f"of classes, class names or modules; got {blocks!r}"
        )
    if all(isinstance(item, nn.Module) for item in spec):
        return _check_modules(model, spec)
    if not all(isinstance(item, (type, str)) for item in spec):
        raise TypeError(
            "ok.fsdp: blocks must list only module classes/class names or only modules, "
            f"got {[type(item).__name__ for item in spec]}"
        )
    classes = tuple(item for item in spec if isinstance(item, type))
    names = {item for item in spec if isinstance(item, str)}
    matches = [
        m
        for m in model.modules()
        if m is not model and (isinstance(m, classes) or type(m).__name__ in names)
    ]
    if not matches:
        wanted = [c.__name__ for c in classes] + sorted(names)
        raise ValueError(
            f"ok.fsdp: blocks={blocks!r} matches no sub-module of {type(model).__name__} "
            f"(looked for classes {wanted}); module classes present: "
            f"{sorted({type(m).__name__ for m in model.modules()})}"
        )
    return _outermost(model, matches)
