"""Small models for recipes, tests and benchmarks: an MLP and a nanoGPT-style causal transformer.

Every model keeps its repeated blocks in one ``nn.ModuleList`` named ``blocks``, which is what
``ok.fsdp`` shards block by block.
"""

from overlapkit.train.models.gpt import GPT, GPTConfig
from overlapkit.train.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "MLP", "GPTConfig", "MLPConfig"]
