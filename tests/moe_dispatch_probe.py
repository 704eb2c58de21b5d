"""Count what megatron-core's ``MoELayer`` moves over its process groups (gloo ranks).

    python tests/moe_dispatch_probe.py TP EP SHARED PORT OUT.json [DISPATCHER]

Spawns TP x EP CPU ranks (the plugin's CPU shims), builds megatron-core's MoE layer with the
``alltoall`` token dispatcher (or DISPATCHER: ``allgather``; sequence parallel at TP > 1,
4 experts top-2, a shared expert when SHARED is 1), runs one micro-batch forward and backward, and writes per rank every
all-gather / reduce-scatter / all-to-all / all-reduce it issued: (collective, group ranks,
values, last dimension), forward and backward apart. ``tests/test_tp_traffic.py`` compares
the volumes with the estimator's (``poseidon_plugin.tp_traffic``).
"""

from __future__ import annotations

import json
import os
import sys

H, B, S, E, K, F, SH = 96, 2, 16, 4, 2, 32, 48     # hidden, micro-batch, seq, experts, top-k


def _wrap(dist, torch, log):
    """Replace the collectives megatron-core calls (and its module-level aliases) with
    counting ones; a tensor's values and last dimension (a list: summed, its first's)."""
    def size(x):
        if torch.is_tensor(x):
            return x.numel(), x.shape[-1]
        return sum(y.numel() for y in x), x[0].shape[-1]

    def wrap(name, which):
        f = getattr(dist, name)

        def counted(*a, **kw):
            g = kw.get("group") or next((x for x in a if isinstance(x, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(g)) if g is not None else ()
            log.append((name, ranks) + size(a[which]))
            # gloo takes split sizes as lists (the CPU shims convert them for the unwrapped call)
            a = tuple(x.tolist() if i in (2, 3) and torch.is_tensor(x) else x
                      for i, x in enumerate(a))
            kw = {k: v.tolist() if torch.is_tensor(v) and k.endswith("split_sizes") else v
                  for k, v in kw.items()}
            return f(*a, **kw)
        setattr(dist, name, counted)

    for name, which in (("all_gather_into_tensor", 0), ("all_gather", 0),
                        ("reduce_scatter_tensor", 1), ("reduce_scatter", 1),
                        ("all_to_all_single", 1), ("all_reduce", 0)):
        wrap(name, which)
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.tensor_parallel.mappings as mappings
    for mod in (mappings, layers):
        for alias, name in (("dist_all_gather_func", "all_gather_into_tensor"),
                            ("dist_reduce_scatter_func", "reduce_scatter_tensor")):
            if hasattr(mod, alias):
                setattr(mod, alias, getattr(dist, name))


def run(rank: int, world: int, tp: int, ep: int, shared: bool, port: int, out: str,
        dispatcher: str = "alltoall") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from poseidon_plugin.megatron.emulate import emulation
    emulation.install_cpu_shims(local_rank=rank, device_count=world, device_name="probe",
                                memory_bytes=1 << 34)
    torch.cuda.current_device = lambda: "cpu"   # the backward runs outside the redirect mode
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=F,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F,
        moe_shared_expert_intermediate_size=SH if shared else None,
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="none",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        sequence_parallel=tp > 1, gated_linear_unit=True, add_bias_linear=False,
        params_dtype=torch.float32, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
    layer = build_module(spec, config=config) if hasattr(spec, "module") else spec(config=config)
    layer.train()
    log: list = []
    _wrap(dist, torch, log)
    x = torch.randn(S // tp, B, H, requires_grad=True)
    y, _ = layer(x)
    forward = list(log)
    log.clear()
    torch.autograd.backward(y, grad_tensors=torch.ones_like(y))
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"forward": forward, "backward": list(log)}, fh)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    tp, ep, shared, port, out = int(argv[0]), int(argv[1]), argv[2] == "1", int(argv[3]), argv[4]
    dispatcher = argv[5] if len(argv) > 5 else "alltoall"
    mp.spawn(run, args=(tp * ep, tp, ep, shared, port, out, dispatcher), nprocs=tp * ep)
    ranks = []
    for r in range(tp * ep):
        with open(f"{out}.{r}") as fh:
            ranks.append(json.load(fh))
    with open(out, "w") as fh:
        json.dump({"shape": {"hidden": H, "micro_batch": B, "seq": S, "experts": E, "top_k": K},
                   "ranks": ranks}, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
