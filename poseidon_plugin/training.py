"""The training setup that moves memory and time: recompute, distributed optimizer, precisions,
attention implementation. One frozen value, ``TrainingSetup``, travels from the command line
(``poseidon plan`` flags) or from Megatron's arguments (a launch) to the memory model, the cost
model, the profile key and the plan.

Fields and what they change
    ``recompute``: ``none`` | ``selective`` | ``full`` (Megatron's ``--recompute-granularity``).
        selective: the core attention is recomputed, so an unfused attention keeps no s x s
        scores; full: a layer keeps only its input, backward re-runs the forward.
    ``distributed_optimizer``: optimizer state (fp32 master + Adam) sharded over DP.
    ``params_dtype``: ``bf16`` | ``fp16`` | ``fp32`` — bytes of a weight (2, 2, 4) and of every
        activation the estimator counts; a 16-bit model also keeps a 4-byte fp32 master copy.
    ``grad_dtype``: ``fp32`` | ``bf16`` — the main-gradient buffer and the DP all-reduce.
        Megatron (megatron-core 0.19 ``validate_args``) accumulates and all-reduces bf16 models'
        gradients in fp32 unless ``--grad-reduce-in-bf16``: the default here is fp32.
    ``overlap_grad_reduce`` / ``overlap_param_gather``: Megatron's bucketed, asynchronous DP
        gradient sync during the last micro-batch's backward / parameter all-gather during the
        next forward (``comm.dp_sync_ms``; the latter needs the distributed optimizer);
        ``ddp_bucket_size`` their bucket (``--ddp-bucket-size``; 0: max(4e7, 1e6 x dp)).
    ``attention``: ``flash`` | ``unfused`` — flash (fused) attention keeps no s x s matrices;
        an unfused one (Megatron's ``local`` spec, ``--attention-backend unfused``) keeps the
        scores, the softmax output and the dropout mask, 5*a*s^2*b/t bytes per layer.

Bytes per parameter (weights | gradients | optimizer): bf16 + fp32 grads 2 | 4 | 12 = 18 (12/dp
with the distributed optimizer); bf16 grads 2 | 2 | 12; fp32 model 4 | 4 | 8 (no master copy).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import PoseidonError

RECOMPUTE = ("none", "selective", "full")
PARAM_DTYPES = ("bf16", "fp16", "fp32")
GRAD_DTYPES = ("fp32", "bf16")
ATTENTION = ("flash", "unfused")
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class TrainingSetup:
    recompute: str = "none"
    distributed_optimizer: bool = False
    params_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    attention: str = "flash"
    overlap_grad_reduce: bool = False    # --overlap-grad-reduce (bucketed, async DP sync)
    overlap_param_gather: bool = False   # --overlap-param-gather (needs the distributed optimizer)
    ddp_bucket_size: int = 0             # --ddp-bucket-size, parameters (0: Megatron's default)

    def __post_init__(self) -> None:
        for name, allowed in (("recompute", RECOMPUTE), ("params_dtype", PARAM_DTYPES),
                              ("grad_dtype", GRAD_DTYPES), ("attention", ATTENTION)):
            value = getattr(self, name)
            if value not in allowed:
                raise PoseidonError(f"training setup {name}: expected one of "
                                    f"{', '.join(allowed)}, got {value!r}")
        for name in ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"):
            if not isinstance(getattr(self, name), bool):
                raise PoseidonError(f"training setup {name}: expected true or false, "
                                    f"got {getattr(self, name)!r}")
        if (isinstance(self.ddp_bucket_size, bool) or not isinstance(self.ddp_bucket_size, int)
                or self.ddp_bucket_size < 0):
            raise PoseidonError(f"training setup ddp_bucket_size: expected an integer >= 0 "
                                f"(parameters per bucket; 0: Megatron's default), got "
                                f"{self.ddp_bucket_size!r}")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise PoseidonError("training setup overlap_param_gather: needs the distributed "
                                "optimizer (Megatron: --overlap-param-gather only with "
                                "--use-distributed-optimizer)")

    # ------------------------------------------------------------------ bytes
    @property
    def weight_bytes(self) -> int:
        return _BYTES[self.params_dtype]

    @property
    def grad_bytes(self) -> int:
        """Main-gradient buffer and DP all-reduce bytes per parameter."""
        return _BYTES[self.grad_dtype]

    def optimizer_bytes(self, dp: int) -> float:
        """fp32 master copy (16-bit models) + Adam's two fp32 moments, sharded over DP with the
        distributed optimizer."""
        state = 8.0 + (4.0 if self.weight_bytes < 4 else 0.0)
        return state / dp if self.distributed_optimizer else state

    @property
    def optimizer_step_bytes(self) -> int:
        """Device-memory bytes one optimizer step moves per parameter (the estimate where no
        profile measured the step): the grad norm reads the gradient (g); Adam reads the
        gradient and its state (g + 12: the fp32 master or fp32 weight, two fp32 moments) and
        writes the state (12); a 16-bit model copies the master back (4 + w); the next
        iteration zeroes the gradient buffer (g). bf16 with fp32 gradients: 42 bytes."""
        g, w = self.grad_bytes, self.weight_bytes
        return 3 * g + 24 + (4 + w if w < 4 else 0)

    @property
    def keeps_attention_scores(self) -> bool:
        """Whether a layer keeps the s x s attention matrices for backward."""
        return self.attention == "unfused" and self.recompute == "none"

    # ------------------------------------------------------------------ profile key
    @property
    def profile_fields(self) -> dict[str, str]:
        """What a layer's profile depends on (the distributed optimizer and the gradient dtype
        do not change one layer's forward / backward or its activations)."""
        return {"dtype": self.params_dtype, "attention": self.attention,
                "recompute": self.recompute}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "TrainingSetup":
        if not data:
            return cls()
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def setup_from_megatron_args(args: Any) -> TrainingSetup:
    """The setup a Megatron / MindSpeed-LLM args namespace (parsed, not necessarily validated)
    trains with. Attention: ``unfused`` for Megatron's local spec (its ``DotProductAttention``)
    or ``--attention-backend unfused/local``, else flash (Transformer Engine's fused attention,
    ``--use-flash-attn``)."""
    def arg(name: str, default: Any = None) -> Any:
        value = getattr(args, name, default)
        return default if value is None else value

    granularity = arg("recompute_granularity")
    recompute = granularity if granularity in ("selective", "full") else "none"
    dtype = "bf16" if arg("bf16", False) else "fp16" if arg("fp16", False) else "fp32"
    grad = "fp32"
    if dtype != "fp32" and (arg("grad_reduce_in_bf16", False)
                            or str(arg("main_grads_dtype", "fp32")).endswith("bf16")):
        grad = "bf16"
    backend = str(arg("attention_backend", "auto")).rsplit(".", 1)[-1].lower()
    local = arg("transformer_impl", "transformer_engine") == "local"
    if backend in ("unfused", "local") or (local and not arg("use_flash_attn", False)):
        attention = "unfused"
    else:
        attention = "flash"
    dist = bool(arg("use_distributed_optimizer", False))
    return TrainingSetup(recompute=recompute, distributed_optimizer=dist,
                         params_dtype=dtype, grad_dtype=grad, attention=attention,
                         overlap_grad_reduce=bool(arg("overlap_grad_reduce", False)),
                         overlap_param_gather=dist and bool(arg("overlap_param_gather", False)),
                         ddp_bucket_size=int(arg("ddp_bucket_size", 0) or 0))


def megatron_flags(setup: TrainingSetup) -> list[str]:
    """Megatron flags that train with ``setup`` (``poseidon profile`` builds its layer with them)."""
    out: list[str] = []
    if setup.params_dtype != "fp32":
        out.append("--" + setup.params_dtype)
    if setup.recompute == "selective":
        out += ["--recompute-granularity", "selective"]
    elif setup.recompute == "full":
        out += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    if setup.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    if setup.grad_dtype == "bf16" and setup.params_dtype == "bf16":
        out.append("--grad-reduce-in-bf16")
    return out


__all__ = ["TrainingSetup", "setup_from_megatron_args", "megatron_flags", "RECOMPUTE",
           "PARAM_DTYPES", "GRAD_DTYPES", "ATTENTION"]
