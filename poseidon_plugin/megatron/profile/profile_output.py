"""What ``poseidon profile`` tells its user while it runs (``offline.profile_layers``).

* **Up front** (``cpu_size_warning``): one warning when the device is a CPU and one forward +
  backward of the model's layer is large (``llama3-8b`` at seq 4096: minutes per configuration,
  gigabytes of memory), with what to do instead.
* **Per configuration** (``ProgressLines``): ``poseidon: profiling 2/4: tp 1, micro-batch 2
  (decoder layer) -- 2 left, 95 s elapsed`` on stderr, before each one is measured.
* **Framework notes** (``framework_notes``): megatron-core's import-time notes that Transformer
  Engine / Apex / absl are not installed (10 ``UserWarning`` lines with their source lines on a
  CPU, before a 3-line result) are nothing to act on on a CPU (the CPU profile runs the local
  torch layers by design) and are dropped there; on a GPU / NPU they become one warning (the
  profile then times the torch fallbacks, not the fused kernels a training run with them uses).
  Any other warning is printed once, on one line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
import warnings
from typing import Any, Iterator, TextIO

log = logging.getLogger("poseidon")

CPU_WARN_TFLOP = 1.0   # one forward + backward of the layer above this on a CPU: a warning
                       # (llama3-8b at seq 4096, micro-batch 1: 5.6 TFLOP; tiny-gpt at 128: 1e-4)

_FALLBACK = re.compile(r"(Transformer Engine|Apex|absl\S*|transformer-engine)\b.*?"
                       r"(not installed|supports MoE experts)", re.I)


def cpu_size_warning(model: Any, seq_length: int, micro_batch_sizes, configurations: int,
                     activation_bytes: float) -> str | None:
    """The up-front warning of a large layer profiled on a CPU (None: small enough).
    ``activation_bytes``: what the layer keeps for backward at the largest micro-batch."""
    mbs = max(micro_batch_sizes)
    tflop = 3 * model.layer_forward_flops(mbs, seq_length) / 1e12
    if tflop <= CPU_WARN_TFLOP:
        return None
    gib = (activation_bytes + 16 * model.layer_params()) / 2 ** 30
    return (f"profiling on a CPU: one forward + backward of {model.name}'s layer at micro-batch "
            f"{mbs}, seq {seq_length} is {tflop:.1f} TFLOP and needs about {gib:.1f} GiB "
            f"(activations, bf16 weights, fp32 gradients and optimizer state): minutes per "
            f"configuration, {configurations} configuration(s), each timed several times. "
            f"Profile on the device you will train on (--device cuda / npu), or try the command "
            f"at a shorter --seq-length")


class ProgressLines:
    """``progress(done, total, what)`` of ``profiler.profile_rank``: one stderr line before each
    configuration is measured (what, how many are left after it, the seconds so far)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()

    def __call__(self, done: int, total: int, what: str) -> None:
        self.stream.write(f"poseidon: profiling {done + 1}/{total}: {what} -- "
                          f"{total - done - 1} left, {time.monotonic() - self.t0:.0f} s elapsed\n")
        self.stream.flush()


@contextlib.contextmanager
def framework_notes(device_kind: str) -> Iterator[None]:
    """Collect the warnings raised inside (megatron-core's imports and profiling) and report
    them as the module docstring says, once the block has run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    fallbacks: dict[str, None] = {}
    others: dict[str, None] = {}
    for w in caught:
        text = " ".join(str(w.message).split())
        m = _FALLBACK.search(text)
        if m and issubclass(w.category, UserWarning):
            name = m.group(1)
            fallbacks["Transformer Engine" if name.lower().startswith("transformer")
                      else name] = None
        elif not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning,
                                         FutureWarning)):
            others[f"{w.category.__name__}: {text}"] = None
    if fallbacks and device_kind != "cpu":
        log.warning("%s not installed here: the profile times megatron-core's local torch "
                    "implementations, not the fused kernels a training run with them uses; "
                    "install them where you train and profile there",
                    " / ".join(sorted(fallbacks)))
    for line in others:
        log.warning("%s", line[:300])
