"""One GPU: a llama3-8b layer (seq 2048, the shape examples/gpu_check.sh trains) timed four ways,
micro-batches 1 and 2 -- the profiler (``time_layer``: device events, back to back), the same
after 20 untimed micro-batches, 8 micro-batches back to back with one synchronisation (what
training does), and device events with no synchronisation inside -- plus the profiler's
optimizer step. Writes diag.json to $OUT (or here). This is how the per-phase synchronisation
the profiler used to do was found 9 % slow on an H200 (docs/fidelity.md, "On a real GPU").

    PYTHONPATH=$PWD python benchmarks/gpu_layer_timing.py   # megatron-core and a CUDA GPU
"""
import json, os, socket, sys, time
sys.path.insert(0, os.getcwd())
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
import torch
import torch.distributed as dist
from poseidon_plugin.megatron.profile import profiler
from poseidon_plugin.megatron.launch import compat

torch.cuda.set_device(0)
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    _port = _s.getsockname()[1]
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port}", rank=0, world_size=1)
compat.patch_dataset_helpers()
MODEL = ("--num-layers 4 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
         "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
         "--position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear --seq-length 2048 --max-position-embeddings 2048 "
         "--vocab-size 32000 --transformer-impl local --micro-batch-size 1 --global-batch-size 8 "
         "--bf16 --seed 1234 --lr 1e-4").split()
argv = MODEL + [f for _, _, f in compat.missing_kernel_flags(MODEL)]
args = profiler.parse_megatron_args("pretrain_gpt.py", argv)
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.spec_utils import build_module
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
dev = torch.device("cuda", 0)
out = {}
for mbs in (1, 2):
    vargs = profiler.profiling_args(args, 1, mbs, 1, 0)
    config, spec = profiler.layer_config_and_spec(vargs)
    layer = build_module(spec, config=config, layer_number=1).to(device=dev, dtype=config.params_dtype)
    layer.train()
    hooks = profiler.attach_main_grads(layer)
    res, _, _ = profiler.time_layer(layer, config, vargs, dev, 10)
    ours = res.medians
    x, kw, g = profiler._layer_inputs(config, vargs, dev)
    def fb():
        o = layer(hidden_states=x, **kw); o = o[0] if isinstance(o, tuple) else o
        o.backward(g); x.grad = None
    for _ in range(20):
        fb()
    torch.cuda.synchronize()
    res2, _, _ = profiler.time_layer(layer, config, vargs, dev, 10)
    # back to back: 8 micro-batches, one sync
    per = []
    for r in range(10):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(8):
            fb()
        torch.cuda.synchronize(); per.append((time.perf_counter() - t0) * 1e3 / 8)
    # CUDA events, no sync inside
    evs = []
    torch.cuda.synchronize()
    for _ in range(24):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record(); o = layer(hidden_states=x, **kw); o = o[0] if isinstance(o, tuple) else o
        e1.record(); o.backward(g); x.grad = None; e2.record(); evs.append((e0, e1, e2))
    torch.cuda.synchronize()
    ef = sorted(a.elapsed_time(b) for a, b, _ in evs[4:]); eb = sorted(b.elapsed_time(c) for _, b, c in evs[4:])
    opt = profiler.time_optimizer_step(layer, dev, 10).medians[0]
    out[mbs] = dict(ours_f=ours[0], ours_b=ours[1], after_burn_f=res2.medians[0], after_burn_b=res2.medians[1],
                    back_to_back_fb=sorted(per)[len(per)//2], events_f=ef[len(ef)//2], events_b=eb[len(eb)//2],
                    optimizer=opt)
    print(mbs, json.dumps(out[mbs]), flush=True)
    for h in hooks: h.remove()
    del layer; torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "diag.json"), "w"), indent=1)
