"""In-layer overlap: the communication inside each layer (tensor parallel's collectives, expert
parallel's dispatch and combine) pipelined with the layer's own compute, on any backend.

``chunked_ep``: expert parallelism's all-to-alls chunked by tokens and pipelined with the experts.

Tensor parallelism with sequence parallelism (``ok.sequence_parallel``), by concept:
``sequence_parallel`` (the transform, the sequence's cut and gather, the replicated gradients'
sum over tp), ``parallel_linear`` (column- and row-parallel linears), ``tp_collectives`` (the
asynchronous sequence-dimension collectives), and the schedules that meet them with the matmuls:
``tp_sync`` (``tp_comm=sync``, and the contract), ``split_overlap`` (``split``), ``ring_overlap``
(``ring``).
"""
