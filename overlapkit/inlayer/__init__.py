"""In-layer overlap: the communication inside each layer (tensor parallel's collectives, expert
parallel's dispatch and combine) pipelined with the layer's own compute, on any backend.

``chunked_ep``: expert parallelism's all-to-alls chunked by tokens and pipelined with the experts.
"""
