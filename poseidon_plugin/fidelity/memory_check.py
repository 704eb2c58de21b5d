"""Hold the memory model (``memory.py``) to megatron-core's own layers (the driver side).

    python -m poseidon_plugin.fidelity.memory_check [--grid ci|full] [--kinds dense,moe-a2a,...]

For each cell (layer kind, TP, EP, CP, sequence parallelism) it runs
:mod:`.mcore_memory` (``TP x EP`` gloo ranks building the real megatron-core layer of that kind
and counting what one micro-batch forward keeps for backward, and its parameters) with the
megatron-core the interpreter imports (``--python`` / ``PYTHONPATH`` choose the line), and
compares, per rank, the memory model's ``layer_activation_bytes`` and parameter bytes at the same
shapes. A cell holds when both are within ``TOLERANCE`` (3 %) of the measured mean over the
ranks (a MoE layer's EP ranks receive slightly different token counts from the router).

Context parallelism: megatron-core's CP attention is Transformer Engine's (it does not build on a
CPU); a CP cell builds the layer at CP 1 on the rank's ``seq / CP`` tokens, which is what every
part around the attention core holds under CP. The core attention itself runs as flash
attention keeps it (``mcore_memory._flash_class``: TE's fused attention does not build here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from .. import memory
from ..model import model_from_dict
from ..training import TrainingSetup

TOLERANCE = 0.03
BYTES_BF16 = 2
SEQ = 64
MBS = 4
BASE = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4,
            ffn_hidden_size=512, vocab_size=1024)
BASE_ARGS = (
    f"--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
    f"--num-query-groups 4 --ffn-hidden-size 512 --max-position-embeddings {SEQ} "
    f"--micro-batch-size {MBS} --vocab-size 1024 --make-vocab-size-divisible-by 128 --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --bf16 "
    "--untie-embeddings-and-output-weights --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --tokenizer-type NullTokenizer --lr 1e-4").split()
MOE_ARGS = "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128".split()
MLA_ARGS = ("--multi-latent-attention --qk-layernorm --q-lora-rank 64 --kv-lora-rank 64 --qk-head-dim 32 "
            "--qk-pos-emb-head-dim 16 --v-head-dim 32").split()
MOE = dict(num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128)
MLA = dict(num_query_groups=8, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=64, kv_lora_rank=64, qk_head_dim=32,
           qk_pos_emb_head_dim=16, v_head_dim=32)

# MindSpeed-LLM's pretrain_gpt.py builds megatron-core's plain GPT layer spec unless --spec
# names another: its MLA models (the DeepSeek recipes) name this one
MINDSPEED_LLM_MLA_SPEC = ["--spec", "mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"]

# kind -> (Megatron arguments, ModelSpec fields)
KINDS = {
    "dense": ([], {}),
    "moe-alltoall": (MOE_ARGS + ["--moe-token-dispatcher-type", "alltoall"], MOE),
    "moe-allgather": (MOE_ARGS + ["--moe-token-dispatcher-type", "allgather",
                                  "--moe-shared-expert-intermediate-size", "256"],
                      {**MOE, "moe_shared_expert_intermediate_size": 256}),
    "mla": (MLA_ARGS, MLA),
    # megatron-core's MultiTokenPredictionLayer (a dense decoder layer inside): the worker's --mtp
    "mtp": (["--mtp-num-layers", "1"], {"mtp_num_layers": 1}),
}


@dataclass(frozen=True)
class Cell:
    kind: str
    tp: int = 1
    ep: int = 1
    cp: int = 1
    sp: bool = False

    def name(self) -> str:
        return (f"{self.kind} TP{self.tp}{' SP' if self.sp else ''} EP{self.ep} CP{self.cp}")


def grid(which: str, kinds=tuple(KINDS)) -> list[Cell]:
    """The cells: ``full`` every kind at TP 1/2/4 (SP off and on at TP > 1; MoE only with SP,
    as megatron-core requires), EP 1/2/4 (MoE), CP 1/2; ``ci`` a few that cover each
    mechanism (TP without and with SP, EP, the two dispatchers, CP, an MTP layer under SP)."""
    if which == "ci":
        cells = [Cell("dense", 2, sp=True), Cell("moe-alltoall", 2, 2, sp=True),
                 Cell("moe-allgather", 2, 1, sp=True), Cell("mla", 2, sp=False),
                 Cell("dense", 1, cp=2), Cell("mtp", 2, sp=True)]
        return [c for c in cells if c.kind in kinds]
    cells = []
    for kind in kinds:
        moe = kind.startswith("moe")
        for tp in (1, 2, 4):
            for sp in ((False,) if tp == 1 else ((True,) if moe else (False, True))):
                for ep in ((1, 2, 4) if moe else (1,)):
                    for cp in (1, 2):
                        cells.append(Cell(kind, tp, ep, cp, sp))
    return cells


def model_of(kind: str):
    return model_from_dict(dict(name=f"memcheck-{kind}", seq_length=SEQ, swiglu=True,
                                normalization="RMSNorm", **{**BASE, **KINDS[kind][1]}))


def predicted(cell: Cell, local_spec: bool = True) -> tuple[float, float]:
    """(activation bytes, parameter bytes) of one layer on one rank, by ``memory.py`` (kind
    ``mtp``: one MTP layer, ``memory.mtp_layer_activation_bytes`` and ``mtp_param_split``).
    ``local_spec``: the layer is megatron-core's local spec, whose MLA down projections are
    column-parallel (the known differences below are added); MindSpeed-LLM's MLA spec builds
    them duplicated on every TP rank (``LinearNoTP``), as the GPU's TE spec and ``memory.py``."""
    model = model_of(cell.kind)
    shape = dict(micro_batch_size=MBS, seq_length=SEQ // cell.cp, tp=cell.tp,
                 sequence_parallel=cell.sp, setup=TrainingSetup())
    if cell.kind == "mtp":
        return (memory.mtp_layer_activation_bytes(model, **shape),
                model.mtp_param_split().per_device(cell.tp, cell.ep) * 2)
    act = memory.layer_activation_bytes(model, **shape)
    params = model.layer_param_split().per_device(cell.tp, cell.ep) * 2
    if cell.kind == "mla" and cell.tp > 1 and local_spec:
        params -= _local_mla_down_params(model) * (cell.tp - 1) / cell.tp * 2
        if cell.sp:
            act += _local_mla_q_latent_view(model, cell)
    return act, params


def _local_mla_q_latent_view(model, cell: Cell) -> float:
    """The local spec's column-parallel Q down projection under SP: megatron-core gathers its
    output over TP and scatters it back to the sequence shard (``MLASelfAttention.
    _qkv_down_projection``); that shard is a slice of the gathered [s, b, q_lora] tensor, so the
    Q norm's saved input keeps the whole storage: 2 q_lora (1 - 1/t) bytes per token more than
    under the GPU's duplicated projection (no gather: what ``memory.py`` counts). The K/V latent
    is split off before its scatter, which copies it. The activation check of an MLA cell at
    TP > 1 with SP adds that known difference to the model's figure."""
    tokens = float(MBS * SEQ // cell.cp)
    return BYTES_BF16 * tokens * (model.attention.q_lora_rank or 0) * (1.0 - 1.0 / cell.tp)


def _local_mla_down_params(model) -> float:
    """MLA's down projections (Q latent, K/V latent with the RoPE key): megatron-core's
    Transformer Engine spec builds them duplicated on every TP rank (``TELinear``,
    ``parallel_mode='duplicated'``; what ``layers.py`` counts), its local spec, the one that
    builds on a CPU, column-parallel (split over TP). The parameter check of an MLA layer at
    TP > 1 takes that difference off the model's figure (a ``local spec`` note in the table)."""
    a = model.attention
    return model.hidden_size * ((a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_pos_emb_head_dim)


def measure(cell: Cell, python: str = sys.executable, env: dict | None = None,
            timeout: float = 900, mindspeed_llm: bool = False) -> list[dict]:
    """The worker's per-rank reports for ``cell`` (``mindspeed_llm``: with MindSpeed-LLM's
    adaptor imported first, its patches and MindSpeed's on megatron-core, as in a launch; its
    trees and the NPU stand-ins on the ``env``'s ``PYTHONPATH``)."""
    base = list(BASE_ARGS)
    if cell.kind == "mla":   # MLA: heads, no query groups
        base = [a for a in base if a != "--group-query-attention"]
        i = base.index("--num-query-groups")
        del base[i:i + 2]
    argv = [python, "-m", "poseidon_plugin.fidelity.mcore_memory", "--tp", str(cell.tp),
            "--ep", str(cell.ep), *(["--sp"] if cell.sp else []),
            *(["--mtp"] if cell.kind == "mtp" else []),
            *(["--mindspeed-llm"] if mindspeed_llm else []), "--",
            *base, "--seq-length", str(SEQ // cell.cp), *KINDS[cell.kind][0],
            *(MINDSPEED_LLM_MLA_SPEC if mindspeed_llm and cell.kind == "mla" else [])]
    run_env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=run_env)
    reports = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("MEMPROBE ")]
    if not reports:
        return [{"error": f"worker exit {done.returncode}: {done.stderr.strip()[-300:]}"}]
    return reports


@dataclass(frozen=True)
class Row:
    cell: Cell
    measured_act: float
    predicted_act: float
    measured_params: float
    predicted_params: float
    error: str = ""

    @property
    def act_ratio(self) -> float:
        return self.predicted_act / self.measured_act if self.measured_act else float("nan")

    @property
    def params_ratio(self) -> float:
        return self.predicted_params / self.measured_params if self.measured_params else \
            float("nan")

    @property
    def holds(self) -> bool:
        return not self.error and abs(self.act_ratio - 1) <= TOLERANCE \
            and abs(self.params_ratio - 1) <= TOLERANCE


def check(cell: Cell, **kw) -> Row:
    reports = measure(cell, **kw)
    act, params = predicted(cell, local_spec=not kw.get("mindspeed_llm", False))
    errors = sorted({r["error"] for r in reports if "error" in r})
    if errors:
        return Row(cell, 0.0, act, 0.0, params, error="; ".join(errors))
    kept = [r["kept_bytes"] for r in reports]
    par = [r["param_bytes"] for r in reports]
    return Row(cell, sum(kept) / len(kept), act, sum(par) / len(par), params)


def table(rows: list[Row]) -> str:
    lines = ["| cell | activations measured / model (B) | ratio | parameters measured / "
             "model (B) | ratio | holds |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.cell.name()} | not built: {r.error} | | | | no |")
            continue
        lines.append(f"| {r.cell.name()} | {r.measured_act:.0f} / {r.predicted_act:.0f} | "
                     f"{r.act_ratio:.3f} | {r.measured_params:.0f} / {r.predicted_params:.0f} | "
                     f"{r.params_ratio:.3f} | {'yes' if r.holds else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poseidon_plugin.fidelity.memory_check")
    parser.add_argument("--grid", choices=("ci", "full"), default="ci")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter whose megatron-core builds the layers")
    parser.add_argument("--mindspeed-llm", action="store_true",
                        help="import MindSpeed-LLM's adaptor first in every worker rank (its "
                        "patches and MindSpeed's; the trees, and tests/npu_fakes off an NPU, "
                        "on PYTHONPATH, TRAINING_BACKEND=mcore)")
    opts = parser.parse_args(argv)
    kinds = tuple(k for k in opts.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"poseidon: error: --kinds: unknown {', '.join(unknown)}; expected "
              f"{', '.join(KINDS)}", file=sys.stderr)
        return 2
    rows = []
    for cell in grid(opts.grid, kinds):
        rows.append(check(cell, python=opts.python, mindspeed_llm=opts.mindspeed_llm))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    return 0 if all(r.holds for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
