# Stand-in for MindSpeed-LLM 26.x's mindspeed_llm/__init__.py: the adaptor is a *name*, bound
# only for the mcore training backend.
import os

backend = os.environ.get("TRAINING_BACKEND", "mcore").lower()
if backend == "mcore":
    from mindspeed_llm.tasks import megatron_adaptor_v2 as megatron_adaptor
