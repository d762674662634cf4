"""Small models for recipes, tests and benchmarks: an MLP, a nanoGPT-style causal transformer
and its mixture-of-experts variant.

Every model keeps its repeated blocks in one ``nn.ModuleList`` named ``blocks``, which is what
``ok.fsdp`` shards block by block.
"""

from overlapkit.train.models.gpt import GPT, GPTConfig
from overlapkit.train.models.mlp import MLP, MLPConfig
from overlapkit.train.models.moe import MoE, MoEConfig, MoEGPT, shard_experts

__all__ = ["GPT", "MLP", "GPTConfig", "MLPConfig", "MoE", "MoEConfig", "MoEGPT", "shard_experts"]
