"""What one decoder layer's tensor-parallel collectives move, per direction (forward or backward).

Megatron runs a layer at TP > 1 with its collectives over the TP group (MoE at TP > 1 only under
sequence parallelism: megatron-core 0.19's ``MoELayer.forward`` refuses training without it):

* attention: the input's all-gather before the QKV projection and the output projection's
  reduce-scatter (an all-reduce of ``b*s*h`` without sequence parallelism): one exchange of the
  ``b*s*h`` activation;
* dense MLP: the same again around fc1 / fc2;
* MoE with the ``alltoall`` token dispatcher (the one the plan pins): after the expert-parallel
  all-to-all the token copies are all-gathered over the expert-TP group
  (``MoEAlltoAllTokenDispatcher.dispatch_postprocess``: ``gather_from_sequence_parallel_region``)
  and reduce-scattered back after the experts (``combine_preprocess``): a rank ends with every
  copy routed to its experts, ``b*s*k`` rows of ``h`` over the group, so one exchange of
  ``k*b*s*h`` values (expert-TP = TP: the plugin refuses ``--expert-tensor-parallel-size``);
  the backward moves the same (the all-gather's gradient is a reduce-scatter and vice versa).
  Shared experts (``SharedExpertMLP``) gather and scatter the ``b*s*h`` input like a dense MLP.
  The routing probabilities gathered with the tokens (``b*s*k`` values) are left out (1/h).
* MoE with the ``allgather`` token dispatcher (``MoEAllGatherTokenDispatcher``): the tokens
  themselves, not their copies, are all-gathered over the TP x EP group before the experts
  (``token_dispatch``: ``gather_from_sequence_parallel_region(hidden_states, tp_ep_group)``,
  with the routing probabilities, ``E`` = ``num_experts`` values per token) and the experts'
  outputs reduce-scattered back (``token_combine``); the backward the mirror (the tokens' and
  the probabilities' gradients reduce-scattered, the outputs' all-gathered). Per direction
  that is an all-gather and a reduce-scatter of ``ep*b*s*h`` values plus a one-way move of
  ``ep*b*s*E``: one exchange of ``ep*b*s*(h + E/2)`` values over ``tp*ep`` ranks
  (``allgather_dispatch_values``). At EP 1 that is a TP exchange of ``b*s*(h + E/2)`` (priced
  here, with the layer); at EP > 1 the cost model prices the TP x EP exchange on the EP
  group's link in place of it (``CostModel.expert_dispatch_ms``). The boolean routing map
  gathered beside them (``E`` bytes per token, no gradient) and the probabilities' own call
  latencies are left out.
* ``flex`` and ``alltoall_seq`` are priced as ``alltoall`` (``Model.planning_note`` says so).

An exchange of ``v`` values (an all-gather of ``v`` plus a reduce-scatter of ``v``, or one
all-reduce of ``v``) costs a ring all-reduce of ``v`` values (``comm.allreduce_ms``: the same
2(t-1) steps of 1/t of the bytes). Each exchange is one call (its own latency).
``tests/test_tp_traffic.py`` counts what megatron-core's ``MoELayer`` moves on gloo ranks and
compares it with these volumes.
"""

from __future__ import annotations

from .comm import allreduce_ms


def allgather_dispatch_values(hidden_size: int, num_experts: int, micro_batch_size: int,
                              seq_length: int, ep: int) -> float:
    """The values the ``allgather`` token dispatcher's exchange over the TP x EP group moves for
    one MoE layer in one direction: every token of the group's ``ep`` sequences, its hidden
    state both ways and its ``num_experts`` routing probabilities one way (see the module
    docstring)."""
    return float(ep * micro_batch_size * seq_length) * (hidden_size + num_experts / 2.0)


def kind_tp_exchanges(kind, micro_batch_size: int, seq_length: int,
                      dispatcher: str = "alltoall") -> tuple[float, ...]:
    """The TP exchanges of one layer of ``kind`` (``layers.LayerKind``) in one direction at EP 1:
    the values each moves (see the module docstring), attention first; ``dispatcher``: the
    model's ``--moe-token-dispatcher-type`` (``allgather`` exchanges the tokens and their
    routing probabilities, every other one the ``top_k`` token copies)."""
    tokens = float(micro_batch_size * seq_length) * kind.hidden_size
    mlp = kind.mlp
    if not mlp.is_moe:
        return (tokens, tokens)
    routed = (allgather_dispatch_values(kind.hidden_size, mlp.num_experts, micro_batch_size,
                                        seq_length, 1)
              if dispatcher == "allgather" else mlp.top_k * tokens)
    return (tokens,) + ((tokens,) if mlp.shared_ffn_hidden_size else ()) + (routed,)


def layer_tp_comm_ms(model, micro_batch_size: int, seq_length: int, tp: int, gbps: float,
                     latency_ms: float, bytes_per_value: float) -> float:
    """One direction's TP collectives of one decoder layer of ``model`` on a ``gbps`` link, ms;
    a model of several kinds: the largest kind's (the envelope the estimator prices it at)."""
    if tp <= 1:
        return 0.0
    kinds = getattr(model, "layer_kinds", None)
    if not kinds:          # a stand-in without kinds: a dense layer of its hidden size
        one = allreduce_ms(bytes_per_value * micro_batch_size * seq_length * model.hidden_size,
                           tp, gbps, latency_ms)
        return 2 * one
    dispatcher = getattr(model, "moe_token_dispatcher_type", "alltoall")
    return max(sum(allreduce_ms(bytes_per_value * v, tp, gbps, latency_ms)
                   for v in kind_tp_exchanges(kind, micro_batch_size, seq_length, dispatcher))
               for kind in kinds)


__all__ = ["allgather_dispatch_values", "kind_tp_exchanges", "layer_tp_comm_ms"]
