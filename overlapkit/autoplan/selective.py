"""What "selective" recomputation recomputes, and so what it costs: a framework's policy.

Full recomputation means the same in every framework (a layer's forward again, keeping only its
input); selective recomputation does not: each framework picks which operations it recomputes.
A ``Framework`` (``autoplan.framework``) carries its policy as ``selective``, and the memory
(``autoplan.memory``) and step-time (``autoplan.step_time``) models ask the policy what a layer
keeps and what rebuilding the rest costs. One policy is described:

- ``ATTENTION_CORE`` (Megatron-LM's ``--recompute-granularity selective``, and overlapkit-train's
  once it recomputes): Korthikanti et al.'s (MLSys'23, section 5), the attention core (``QK^T``,
  the softmax and its dropout, ``a x s`` bytes per token and layer) is dropped after forward
  and recomputed in backward, plus the MLP's activation-function outputs, rebuilt from the kept
  first projection (Megatron-LM's ``--recompute-modules mlp_act`` / ``moe_act``). Flash
  attention never stores the core (its backward recomputes it anyway), so there the policy
  saves the activation outputs only, and costs their memory traffic only.

Another framework's policy (torchtitan's per-op selective checkpointing, which saves the outputs
of every second matmul and recomputes the rest) is another object with the same four methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from overlapkit.autoplan.model_spec import ModelSpec


class SelectiveRecompute(Protocol):
    """A framework's selective recomputation, as the memory and step-time models price it."""

    name: str

    def kept_bytes_per_token(
        self,
        model: ModelSpec,
        element_bytes: int,
        *,
        saved: tuple[float, float, float],
        moe_layer: bool,
    ) -> tuple[float, float, float]:
        """Of ``saved`` (``memory.activation_bytes_per_token``: split-with-sp, split-over-tp
        and attention-core bytes one layer saves per token without recomputation), what the
        policy keeps, in the same three parts."""
        ...

    def rebuilt_bytes_per_token(
        self, model: ModelSpec, element_bytes: int, *, moe_layer: bool
    ) -> float:
        """Bytes per token the recomputed element-wise operations write again in backward
        (priced at memory bandwidth, read once and written once)."""
        ...

    def extra_forward_s(self, *, matmul_s: float, attention_s: float, flash: bool) -> float:
        """Seconds of one layer's forward run again, from its matmuls' (``matmul_s``) and its
        attention core's (``attention_s``) forward seconds; ``flash``: flash attention."""
        ...

    def extra_flops_per_token(self, model: ModelSpec, seq_len: int) -> float:
        """FLOPs per token (all layers) recomputed: what hardware FLOPs count beyond 6N."""
        ...


@dataclass(frozen=True, slots=True)
class AttentionCoreRecompute:
    """Korthikanti et al.'s selective recomputation with Megatron-LM's ``mlp_act`` (module doc)."""

    name: str = "attention core"

    def kept_bytes_per_token(
        self,
        model: ModelSpec,
        element_bytes: int,
        *,
        saved: tuple[float, float, float],
        moe_layer: bool,
    ) -> tuple[float, float, float]:
        sp_part, tp_part, _core = saved
        rebuilt = self.rebuilt_bytes_per_token(model, element_bytes, moe_layer=moe_layer)
        return sp_part, tp_part - rebuilt, 0.0

    def rebuilt_bytes_per_token(
        self, model: ModelSpec, element_bytes: int, *, moe_layer: bool
    ) -> float:
        # The activation function's output (and SwiGLU's product) comes back from the first
        # projection's output, which is kept.
        ffn = model.moe_ffn_hidden if moe_layer else model.ffn_hidden
        copies = model.topk + model.shared_experts if moe_layer else 1
        return copies * (2 if model.gated_mlp else 1) * element_bytes * ffn

    def extra_forward_s(self, *, matmul_s: float, attention_s: float, flash: bool) -> float:
        # Flash attention's backward recomputes the core whatever the policy says.
        return 0.0 if flash else attention_s

    def extra_flops_per_token(self, model: ModelSpec, seq_len: int) -> float:
        return model.attention_flops_per_token(seq_len)


ATTENTION_CORE = AttentionCoreRecompute()
