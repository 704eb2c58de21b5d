"""Poseidon: automatic parallel-plan search for LLM pre-training on heterogeneous clusters.

The core (specs, profiles, memory model, simulator, search, plan, CLI) imports no torch.
The Megatron-LM / MindSpeed-LLM integration lives in ``poseidon_plugin.megatron`` and
imports torch lazily.
"""

__version__ = "0.1.0"
