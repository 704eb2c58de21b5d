# Stand-in for MindSpeed-LLM 2.2.0-2.3.0's mindspeed_llm/__init__.py: the adaptor is a *name*.
from mindspeed_llm.tasks import megatron_adaptor_v2 as megatron_adaptor
