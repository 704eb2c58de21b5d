"""Integration: our op orders == what megatron-core 0.19 actually executes (CPU, one process).

For each pipeline rank in turn, megatron-core's own schedule function
(``forward_backward_pipelining_with_interleaving`` / ``..._without_interleaving``) runs with:

- a fake pipeline group reporting (rank, world size) -- megatron reads the rank through it,
- a ``P2PCommunicator`` subclass whose send/recv methods return dummy tensors (no peers),
- model chunks that are bare modules, one data iterator per chunk yielding 0, 1, 2, ...
  (so the micro-batch id is what megatron actually *consumes*, not what it claims),
- a ``forward_step_func`` recording (chunk, micro-batch) and ``backward_step`` patched to
  record the backward of whichever forward produced the output tensor it is handed.

The recorded sequence per rank is compared with ``poseidon_plugin.simulator.schedules``.
"""

from __future__ import annotations

import warnings

import pytest

from poseidon_plugin.simulator.schedules import stage_op_order

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def megatron():
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.process_groups_config import ProcessGroupCollection
    started = False
    if not dist.is_initialized():  # megatron's rank getters consult the group only when it is
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        started = True
    yield schedules, P2PCommunicator, ProcessGroupCollection, ModelParallelConfig
    if started:
        dist.destroy_process_group()


class FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def record_megatron(megatron, monkeypatch, num_stages: int, num_microbatches: int,
                    virtual_stages: int, rank: int, group_size: int | None = None):
    schedules, P2PCommunicator, ProcessGroupCollection, ModelParallelConfig = megatron

    class DummyComm(P2PCommunicator):
        def __init__(self, group, config):  # no peers: skip the global-rank lookups
            self.pp_group, self.config = group, config
            self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
            self.next_rank = self.prev_rank = 0

        @staticmethod
        def _t():
            return torch.zeros(1)

        def recv_forward(self, *a, **k):
            return self._t()

        def recv_backward(self, *a, **k):
            return self._t()

        def send_forward(self, *a, **k):
            return None

        def send_backward(self, *a, **k):
            return None

        def send_forward_recv_backward(self, *a, **k):
            return self._t()

        def send_backward_recv_forward(self, *a, **k):
            return self._t()

        def send_forward_recv_forward(self, *a, overlap_p2p_comm=False, **k):
            return (self._t(), {}) if overlap_p2p_comm else self._t()

        def send_backward_recv_backward(self, *a, overlap_p2p_comm=False, **k):
            return (self._t(), {}) if overlap_p2p_comm else self._t()

        def send_forward_backward_recv_forward_backward(self, *a, **k):
            return self._t(), self._t()

    kwargs = {}
    if group_size is not None:
        kwargs["microbatch_group_size_per_vp_stage"] = group_size
    config = ModelParallelConfig(
        pipeline_model_parallel_size=num_stages,
        virtual_pipeline_model_parallel_size=virtual_stages if virtual_stages > 1 else None,
        pipeline_dtype=torch.float32, **kwargs)
    config.hidden_size = 1

    class Chunk(torch.nn.Module):
        def __init__(self, chunk_id: int) -> None:
            super().__init__()
            self.chunk_id, self.config, self.model_type = chunk_id, config, None

        def set_input_tensor(self, tensor) -> None:
            pass

    record: list[tuple[bool, int, int]] = []
    producer: dict[int, tuple[int, int]] = {}

    def forward_step_func(data_iterator, model):
        mb = next(data_iterator)
        record.append((False, model.chunk_id, mb))
        return torch.zeros(1), (lambda out: (out.sum(), {}))

    original_forward_step = schedules.forward_step

    def forward_step(*args, **kwargs):
        out, num_tokens = original_forward_step(*args, **kwargs)
        producer[id(out[0] if isinstance(out, list) else out)] = record[-1][1:]
        return out, num_tokens

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        tensor = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        record.append((True, *producer[id(tensor)]))
        return torch.zeros(1)

    real_zeros = torch.zeros

    def zeros_on_cpu(*args, device=None, **kwargs):  # megatron allocates a counter on "cuda"
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    monkeypatch.setattr(torch, "zeros", zeros_on_cpu)
    group = FakeGroup(rank, num_stages)
    pgc = ProcessGroupCollection()
    pgc.tp, pgc.cp = FakeGroup(0, 1), FakeGroup(0, 1)
    models = [Chunk(c) for c in range(virtual_stages)]
    iterators = [iter(range(num_microbatches)) for _ in range(virtual_stages)]
    common = dict(forward_step_func=forward_step_func, num_microbatches=num_microbatches,
                  seq_length=1, micro_batch_size=1, p2p_communicator=DummyComm(group, config),
                  pg_collection=pgc)
    if virtual_stages > 1:
        schedules.forward_backward_pipelining_with_interleaving(
            data_iterator=iterators, model=models, **common)
    else:
        schedules.forward_backward_pipelining_without_interleaving(
            data_iterator=iterators[0], model=models[0], **common)
    monkeypatch.undo()
    return record


CASES = [
    # (N, M, V, group size): non-interleaved, incl. M < N (warm-up capped)
    (2, 3, 1, None), (4, 6, 1, None), (4, 2, 1, None), (3, 1, 1, None),
    # interleaved, default group size N: M multiple of N, incl. "all micro-batches in warm-up"
    (2, 2, 2, None), (2, 6, 3, None), (3, 6, 2, None), (4, 8, 2, None), (4, 4, 2, None),
    (4, 12, 3, None),
    # interleaved with a non-default group size (megatron's own example: PP2 M5 G3 VP2)
    (2, 5, 2, 3), (3, 8, 2, 4),
]


@pytest.mark.parametrize("n,m,v,g", CASES)
def test_orders_match_megatron(megatron, monkeypatch, n, m, v, g):
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    for rank in range(n):
        ran = record_megatron(megatron, monkeypatch, n, m, v, rank, g)
        ours = [tuple(op) for op in stage_op_order(schedule, n, m, rank, v, g)]
        assert ran == ours, f"rank {rank}"
