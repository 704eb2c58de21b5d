"""Read a pipeline layout the way megatron-core builds the model from it (one JSON line).

    python tests/mcore_layout_probe.py '<json: layout, pp, num_layers, moe_layer_freq>'

With a Megatron-LM tree first on PYTHONPATH: ``PipelineParallelLayerLayout`` parses the
layout string and checks it (``validate_layer_layout``), a ``TransformerConfig`` carries it
(its own checks), and ``get_gpt_decoder_block_spec`` builds each (PP rank, virtual stage)'s
layer specs from the model's ``moe_layer_freq`` (each rank's PP rank and virtual size set in
``parallel_state`` as its process would see them); printed per rank and stage: the decoder
layer ids and for each whether its MLP is a ``MoELayer``. No process group, no layer built.
Used by tests/test_search_mixed.py.
"""

from __future__ import annotations

import json
import sys


def _is_moe(mlp, moe_layer) -> bool:
    """Whether a layer spec's MLP builds ``MoELayer`` (a ``ModuleSpec`` or a partial of it)."""
    target = getattr(mlp, "module", None) or getattr(mlp, "func", None)
    return isinstance(target, type) and issubclass(target, moe_layer)


def main() -> None:
    req = json.loads(sys.argv[1])
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch

    pp = req["pp"]
    layout = PipelineParallelLayerLayout(req["layout"], pp)
    layout.validate_layer_layout(num_layers=req["num_layers"], mtp_num_layers=None)
    vpp = layout.virtual_pipeline_model_parallel_size
    config = TransformerConfig(
        num_layers=req["num_layers"], hidden_size=64, num_attention_heads=4,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_layer_freq=req["moe_layer_freq"], pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_model_parallel_layout=layout, pipeline_dtype=torch.float32)
    out = []
    # each rank's view, as its process would have it (no process group needed)
    parallel_state.set_pipeline_model_parallel_world_size(pp)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    for rank in range(pp):
        parallel_state.set_pipeline_model_parallel_rank(rank)
        row = []
        for stage in range(vpp):
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              vp_stage=stage, pp_rank=rank)
            ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=stage,
                                           pp_rank=rank)
            moe = [_is_moe(s.submodules.mlp, MoELayer) for s in spec.layer_specs]
            row.append({"ids": ids, "moe": moe})
        out.append(row)
    print(json.dumps({"vpp": vpp, "stages": out}))


if __name__ == "__main__":
    main()
