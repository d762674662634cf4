"""What a training framework runs for a layout, where frameworks differ in what a step costs.

The step-time model (``autoplan.step_time``) prices a layout as the framework that runs it splits
the model. Two are described:

- ``MEGATRON`` (the default; what the published runs used): Megatron-LM's tensor parallelism
  with sequence parallelism (Korthikanti et al., MLSys'23): each layer's attention and MLP split
  over tp, an all-gather before and a reduce-scatter after each of them, in forward and in
  backward; the embedding and the output layer split over the vocabulary; the parameters plain
  tensors (FSDP2's excepted, which are always DTensors).
- ``OVERLAPKIT_TRAIN``: overlapkit-train (``overlapkit/train/parallel.py``). Its
  ``apply_tensor_parallel`` is torch's ``parallelize_module`` on every block: ``q``, ``k``,
  ``v`` and the MLP's first layer column-wise, ``proj`` and the MLP's second layer row-wise. The
  activations between the blocks stay replicated, so forward all-reduces the output of each
  row-wise layer (2 per layer) and backward the input gradient of each column-wise layer (4:
  ``q``, ``k`` and ``v`` are separate modules). The profiler counts 24 all-reduces in a
  forward and backward of 4-layer gpt_tiny at tp = 2. The embeddings, the norms and the head
  stay replicated: every tp rank computes the whole output layer. The split parameters are
  DTensors, and so are the experts ``shard_experts`` splits over ep. Its MoE layers are not
  split over tp; that case is not modelled (overlapkit-train runs moe_tiny under ep).

"Selective" recomputation is the framework's policy (``selective``, ``autoplan.selective``):
for both, the attention core (Megatron-LM's ``--recompute-granularity selective``).

DTensor parameters matter where the host runs the optimizer step tensor by tensor (CPU ranks:
``StepOptions.optimizer_dtensor_s``); on GPUs the difference is not priced (the defaults are 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.autoplan.selective import ATTENTION_CORE, SelectiveRecompute


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    """How a framework runs tensor and expert parallelism (see module doc)."""

    name: str
    sequence_parallel: bool
    """tp: an all-gather and a reduce-scatter around attention and around the MLP, forward and
    backward (Megatron-LM's sequence parallelism); False: all-reduces (the next two fields)."""
    tp_forward_all_reduces: int = 0
    """Without sequence parallelism: all-reduces per layer in forward (row-wise outputs)."""
    tp_backward_all_reduces: int = 0
    """Without sequence parallelism: all-reduces per layer in backward (column-wise inputs)."""
    vocab_parallel: bool
    """The embedding and the output layer split over tp; False: replicated on every tp rank."""
    dtensor_parameters: bool
    """The parameters split over tp or ep are DTensors (torch's ``parallelize_module``)."""
    selective: SelectiveRecompute = ATTENTION_CORE
    """What its selective recomputation recomputes, and so what it costs."""


MEGATRON = Framework(
    name="megatron", sequence_parallel=True, vocab_parallel=True, dtensor_parameters=False
)
OVERLAPKIT_TRAIN = Framework(
    name="overlapkit-train",
    sequence_parallel=False,
    tp_forward_all_reduces=2,
    tp_backward_all_reduces=4,
    vocab_parallel=False,
    dtensor_parameters=True,
)
