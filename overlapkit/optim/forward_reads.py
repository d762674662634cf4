"""Which parameters a module's forward reads before any module below it runs.

The per-bucket scheduler applies a bucket's update when the next forward first needs one of its
parameters: in a forward pre-hook of the module that reads it. A module's own parameters
(``parameters(recurse=False)``) are the usual answer, but not the only one; a module can read a
child's parameters without calling the child:

- ``nn.MultiheadAttention`` hands ``out_proj.weight`` / ``out_proj.bias`` to
  ``F.multi_head_attention_forward`` (or to ``torch._native_multi_head_attention`` in its eval
  fast path); ``out_proj``'s own forward never runs.
- ``nn.TransformerEncoderLayer`` in eval under ``no_grad`` takes a fused fast path
  (``torch._transformer_encoder_layer_fwd``) over all its children's parameters and runs no
  child at all. It checks for forward hooks on itself and every submodule and leaves the fast
  path if it finds one, so the scheduler's hook is a *global* module hook (which it does not
  see): the model takes the same kernels as without overlapkit.
- ``nn.LinearCrossEntropyLoss`` (torch 2.13) reads ``self.linear``'s parameters.
- A module without a forward of its own (``ParameterList``, ``ParameterDict``, a plain
  ``nn.Module`` holder) is never called: whoever uses its parameters is an ancestor.

So a module reads its own parameters; a reader of its children (the list above) reads its whole
subtree; and the parameters of a module without a forward belong to its nearest ancestor that
has one. ``tests/test_forward_reads.py`` records, with a dispatch mode, every parameter each
``torch.nn`` module with children actually passes to a kernel (training and eval forwards, fast
paths included) and checks that this rule covers it; it fails on a torch that adds a reader.
A user's module that reads another module's parameter directly (``x @ self.proj.weight``) is
not seen: call ``bucketer.before_forward(self.proj)`` (or ``synchronize()``) before it.

The wait itself runs in one process-wide module pre-hook (``global_forward_pre_hook``).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

_CHILD_READER_NAMES = ("MultiheadAttention", "TransformerEncoderLayer", "LinearCrossEntropyLoss")
CHILD_READERS: tuple[type[nn.Module], ...] = tuple(
    getattr(nn, name) for name in _CHILD_READER_NAMES if hasattr(nn, name)
)
"""``torch.nn`` classes whose forward reads their children's parameters (the installed torch's)."""


def has_own_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward (``nn.Module``'s placeholder raises)."""
    return type(module).forward is not nn.Module.forward


def forward_reads(model: nn.Module) -> dict[nn.Module, list[nn.Parameter]]:
    """For each module of ``model`` with a forward, the parameters its forward may read first.

    Returns:
        dict: module -> parameters (each once, in ``named_parameters`` order); modules that
        read none are left out. A tied parameter is listed under every module that holds it.
    """
    reads: dict[nn.Module, dict[int, nn.Parameter]] = {}

    def visit(module: nn.Module, reader: nn.Module) -> None:
        # ``reader``: the module that is called when ``module``'s parameters are used.
        if has_own_forward(module):
            reader = module
        mine = reads.setdefault(reader, {})
        params = (
            module.parameters()
            if isinstance(module, CHILD_READERS)
            else module.parameters(recurse=False)
        )
        for p in params:
            mine.setdefault(id(p), p)
        for child in module.children():
            visit(child, reader)

    visit(model, model)
    return {m: list(ps.values()) for m, ps in reads.items() if ps}


def reads_of(model: nn.Module, params: list[torch.Tensor]) -> dict[nn.Module, list[int]]:
    """``forward_reads`` as indices into ``params`` (parameters not in ``params`` dropped)."""
    index = {id(p): i for i, p in enumerate(params)}
    out = {}
    for module, read in forward_reads(model).items():
        mine = sorted({index[id(p)] for p in read if id(p) in index})
        if mine:
            out[module] = mine
    return out


class WaitsBeforeForward(Protocol):
    def pre_forward(self, module: nn.Module) -> None: ...


def global_forward_pre_hook(owner: WaitsBeforeForward) -> RemovableHandle:
    """One process-wide module pre-hook calling ``owner.pre_forward(module)``, holding it weakly.

    Global, not per module: ``nn.TransformerEncoderLayer`` leaves its fused eval path when it
    or any submodule carries a forward hook (``transformer.py``), and a hook must not change
    which kernels the model runs. Removed when ``owner`` is collected.
    """
    ref = weakref.ref(owner)

    def hook(module: nn.Module, _args: object) -> None:
        target = ref()
        if target is not None:
            target.pre_forward(module)

    handle = register_module_forward_pre_hook(hook)
    weakref.finalize(owner, handle.remove)
    return handle
