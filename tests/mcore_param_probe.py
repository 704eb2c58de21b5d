"""Build a whole GPT model with the importable megatron-core on CPU and print its parameter counts
(one JSON line): each decoder layer, the MTP block, embedding and output layer.

    python tests/mcore_param_probe.py <megatron args...>

One gloo process (world 1, TP 1, PP 1, CPU shims as under --poseidon-emulate); Megatron's parser,
validate_args (the profiler's validated copy) and its own model builder, as ``pretrain_gpt.py``
builds the model. Used by tests/test_model_layers.py to hold the per-kind counts of model.py to
what megatron-core actually allocates (MLA, shared experts, dense/MoE patterns, MTP).
``PROBE_STAGE=last``: the model as a pipeline's last stage (no pre-processing) is built instead
and its ``sharded_state_dict()`` called, as a distributed save does (tests/test_framework_rules.py:
an MTP model with tied embeddings cannot be saved there).
"""

from __future__ import annotations

import json
import os
import sys


def _count(module) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _core_attention_takes_mla_head_dims() -> None:
    """The local ``DotProductAttention`` (no parameters) refuses MLA's ``k_channels`` /
    ``v_channels`` (megatron-core runs MLA on Transformer Engine's); counting parameters needs
    only the model built, so they are dropped here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    init = DotProductAttention.__init__

    def patched(self, *args, k_channels=None, v_channels=None, **kwargs):
        init(self, *args, **kwargs)

    DotProductAttention.__init__ = patched


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    from megatron.core import parallel_state, tensor_parallel
    from poseidon_plugin.megatron.emulate import emulation
    from poseidon_plugin.megatron.profile import profiler

    emulation.install_cpu_shims(local_rank=0, device_count=1, device_name="probe",
                                memory_bytes=1 << 34)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("PROBE_PORT", "29534"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    args = profiler.parse_megatron_args("pretrain_gpt.py", argv)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    vargs = profiler.profiling_args(args, 1, 1, 1, 0)
    vargs.padded_vocab_size = vargs.vocab_size

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    _core_attention_takes_mla_head_dims()
    cfg = gpt_config_from_args(vargs)
    last_only = os.environ.get("PROBE_STAGE") == "last"
    model = GPTModelBuilder(cfg).build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                             pre_process=not last_only, post_process=True)
    if last_only:
        # the last stage of a pipeline (no pre-processing): can Megatron checkpoint it?
        try:
            model.sharded_state_dict()
            saved = "ok"
        except AssertionError as exc:
            saved = f"AssertionError: {str(exc)[:200]}"
        print("PROBE " + json.dumps({"mtp": _count(getattr(model, "mtp", None)),
                                     "sharded_state_dict": saved}), flush=True)
        return
    decoder = model.decoder
    report = {
        "layers": [_count(layer) for layer in decoder.layers],
        "layer_modules": [sorted({type(m).__name__ for m in layer.modules()})
                          for layer in decoder.layers],
        "final_norm": _count(getattr(decoder, "final_layernorm", None)),
        "embedding": _count(getattr(model, "embedding", None)),
        "output": _count(getattr(model, "output_layer", None)),
        "mtp": _count(getattr(model, "mtp", None)),
        "total": _count(model),
    }
    print("PROBE " + json.dumps(report), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
