"""overlapkit.optim.forward_reads against what torch.nn modules really read.

A dispatch mode records every parameter passed to a kernel during a forward, and a global
module pre-hook (what the per-bucket scheduler uses) records which modules had started by then.
A read is covered when some module that had started lists the parameter in ``forward_reads``:
its pre-hook would have waited for the parameter's bucket. Checked for every ``torch.nn``
module class that has children (found by building every class in ``torch.nn``), in training and
in eval under ``no_grad`` (where ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``
take their fused fast paths), plus parametrizations and parameter holders without a forward.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.utils import parametrizations
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from overlapkit.optim.forward_reads import CHILD_READERS, forward_reads
from tests.torch_version import requires_torch

E = 8  # model width


class _ReadProbe(TorchDispatchMode):
    """Every parameter (by storage) a kernel receives, with the modules started before it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.owner = {
            p.untyped_storage().data_ptr(): n for n, p in model.named_parameters() if p.numel()
        }
        self.started: list[nn.Module] = []
        self.reads: list[tuple[str, tuple[nn.Module, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and not t.is_nested and t.numel():
                name = self.owner.get(t.untyped_storage().data_ptr())
                if name is not None:
                    self.reads.append((name, tuple(self.started), str(func)))
        return func(*args, **(kwargs or {}))


def _uncovered(model: nn.Module, call, train: bool) -> list[tuple[str, str]]:
    probe = _ReadProbe(model)
    mine = {id(m) for m in model.modules()}
    handle = register_module_forward_pre_hook(
        lambda m, _a: probe.started.append(m) if id(m) in mine else None
    )
    names = {id(p): n for n, p in model.named_parameters()}
    covered_by = {m: {names[id(p)] for p in ps} for m, ps in forward_reads(model).items()}
    model.train(train)
    try:
        with torch.set_grad_enabled(train), probe:
            call(model)
    finally:
        handle.remove()
    return sorted(
        {
            (name, op)
            for name, started, op in probe.reads
            if not any(name in covered_by.get(m, ()) for m in started)
        }
    )


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


class _Holder(nn.Module):
    """A module that keeps parameters in forward-less holders and reads them itself."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(_x(E, E)), nn.Parameter(_x(E))])
        self.extra = nn.ParameterDict({"scale": nn.Parameter(_x(E))})
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        x = x @ self.weights[0] + self.weights[1]
        return self.proj(x * self.extra["scale"])


def _encoder(nested: bool):
    layer = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)


PAD = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
# Every torch.nn class with children, and the models a parameter's reader is not its owner in.
CASES = {
    "MultiheadAttention": (
        lambda: nn.MultiheadAttention(E, 2, batch_first=True),
        lambda m: m(_x(2, 5, E), _x(2, 5, E), _x(2, 5, E)),
    ),
    "TransformerEncoderLayer": (
        lambda: nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=True),
        lambda m: m(_x(2, 5, E)),
    ),
    "TransformerDecoderLayer": (
        lambda: nn.TransformerDecoderLayer(E, 2, 16, dropout=0.0, batch_first=True),
        lambda m: m(_x(2, 5, E), _x(2, 4, E)),
    ),
    "TransformerEncoder": (
        lambda: _encoder(True),
        lambda m: m(_x(2, 5, E), src_key_padding_mask=PAD),
    ),
    "TransformerDecoder": (
        lambda: nn.TransformerDecoder(
            nn.TransformerDecoderLayer(E, 2, 16, dropout=0.0, batch_first=True), 2
        ),
        lambda m: m(_x(2, 5, E), _x(2, 4, E)),
    ),
    "Transformer": (
        lambda: nn.Transformer(E, 2, 1, 1, 16, dropout=0.0, batch_first=True),
        lambda m: m(_x(2, 5, E), _x(2, 4, E)),
    ),
    "LinearCrossEntropyLoss": (
        lambda: nn.LinearCrossEntropyLoss(E, 3),
        lambda m: m(_x(4, E), torch.tensor([0, 1, 2, 1])),
    ),
    "AdaptiveLogSoftmaxWithLoss": (
        lambda: nn.AdaptiveLogSoftmaxWithLoss(E, 10, [4, 8]),
        lambda m: (m(_x(4, E), torch.tensor([0, 5, 9, 3])), m.log_prob(_x(4, E))),
    ),
    "TripletMarginWithDistanceLoss": (
        lambda: nn.TripletMarginWithDistanceLoss(),
        lambda m: m(_x(4, E), _x(4, E), _x(4, E)),
    ),
    "Sequential": (lambda: nn.Sequential(nn.Linear(E, E), nn.ReLU()), lambda m: m(_x(2, E))),
    "ModuleList": (
        lambda: nn.Sequential(nn.ModuleList([nn.Linear(E, E)])[0]),
        lambda m: m(_x(2, E)),
    ),
    "holder_without_forward": (_Holder, lambda m: m(_x(2, E))),
    "parametrized_orthogonal": (
        lambda: parametrizations.orthogonal(nn.Linear(E, E)),
        lambda m: m(_x(2, E)),
    ),
    "parametrized_weight_norm": (
        lambda: parametrizations.weight_norm(nn.Linear(E, E)),
        lambda m: m(_x(2, E)),
    ),
    "LSTM": (lambda: nn.LSTM(E, E, 2, batch_first=True), lambda m: m(_x(2, 5, E))),
}
# The classes that only hold or order modules: their children's forwards run by themselves.
CONTAINERS = {
    "Sequential",
    "ModuleList",
    "ModuleDict",
    "ParameterList",
    "ParameterDict",
    "Container",
}


def _classes_with_children() -> set[str]:
    """Every public torch.nn module class whose instances have child modules."""
    special = {
        "AdaptiveLogSoftmaxWithLoss": lambda: nn.AdaptiveLogSoftmaxWithLoss(E, 10, [4, 8]),
        "TransformerEncoder": lambda: _encoder(False),
        "TransformerDecoder": CASES["TransformerDecoder"][0],
    }
    sizes = {"nhead": 2, "num_heads": 2}
    found = set()
    for name in nn.modules.__all__:
        cls = getattr(nn, name, None)
        if not (inspect.isclass(cls) and issubclass(cls, nn.Module)) or name in CONTAINERS:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if name in special:
                    module = special[name]()
                else:
                    required = [
                        p
                        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                        if p.default is inspect.Parameter.empty
                        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                    ]
                    module = cls(**{p.name: sizes.get(p.name, 4) for p in required})
        except (TypeError, ValueError):
            continue  # needs real arguments; none of those builds children (RNNs, pools)
        if any(True for _ in module.children()):
            found.add(name)
    return found


def test_every_torch_nn_class_with_children_is_probed():
    missing = _classes_with_children() - CASES.keys()
    assert not missing, f"add a case for {sorted(missing)} (and check it reads only its own)"


# Cases of classes newer than a GPU host's torch may be (tests/torch_version.py).
NEWER_TORCH = {"LinearCrossEntropyLoss": requires_torch("2.13", "nn.LinearCrossEntropyLoss")}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval_no_grad"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=NEWER_TORCH.get(c, ())) for c in CASES])
def test_every_parameter_a_forward_reads_is_waited_for_by_a_started_module(case, train):
    make, call = CASES[case]
    torch.manual_seed(0)
    assert _uncovered(make(), call, train) == []


def test_without_the_child_reader_rule_the_probe_finds_the_fast_path_reads(monkeypatch):
    # The check can fail: with the reader classes forgotten it finds their reads.
    from overlapkit.optim import forward_reads as module

    monkeypatch.setattr(module, "CHILD_READERS", ())
    make, call = CASES["TransformerEncoderLayer"]
    reads = _uncovered(make(), call, train=False)
    assert ("linear1.weight", "aten._transformer_encoder_layer_fwd.default") in reads
    make, call = CASES["MultiheadAttention"]
    assert {n for n, _ in _uncovered(make(), call, train=True)} == {
        "out_proj.weight",
        "out_proj.bias",
    }


def test_child_readers_are_the_installed_torch_classes():
    assert nn.MultiheadAttention in CHILD_READERS and nn.TransformerEncoderLayer in CHILD_READERS
