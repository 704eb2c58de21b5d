"""``poseidon validate``: the simulator against real megatron-core pipeline runs (CPU emulation).

For every case (PP degree, per-stage layer split, emulated device type per stage, schedule,
micro-batch count) the harness

1. spawns ``PP x DP`` processes (``torch.multiprocessing``, gloo), installs the CPU shims of
   ``poseidon_plugin.megatron.emulate.emulation`` and calls megatron-core's
   ``parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP, ...)``;
2. builds a tiny real model per stage: ``layers[s]`` emulated layers, each a real ``Linear``
   (``hidden x hidden``) whose forward and backward are padded by ``sleep`` to
   ``forward_ms_per_layer / speed`` and ``backward_ms_per_layer / speed`` (the emulated device
   type's speed), so a stage costs layers x per-layer time / speed;
3. **profiles the way the plugin would**, on the same emulation: the forward and backward of each
   stage's chunk(s) timed alone (median of a few), the activation send of every pipeline link
   (gloo ping-pong, half the round trip), the gradient finalisation (DP all-reduce) and the
   optimizer step of every stage, plus -- for the engine-aware model only -- megatron-core's
   per-op overheads (the schedule run once with zero-time layers);
4. **measures** with megatron-core's own ``get_forward_backward_func()`` (real p2p, real
   ``send_forward_recv_backward`` pairs, real finalize hook), followed by a Megatron-like
   optimizer step (grad-norm all-reduce over the model-parallel group, then the update): 30
   iterations, the first 5 discarded, the mean of the rest (``--iterations`` / ``--discard``);
   the span of an iteration is max over ranks of its end minus min over ranks of its start
   (one host, one monotonic clock); every op of every stage is recorded by
   ``poseidon_plugin.megatron.calibrate.recorder``;
5. predicts the iteration time with (a) the paper's DAG (``simulator.simulate_pipeline``),
   (b) Eq. (1) (``simulator.static_estimate_ms``) and (c) the engine-aware model
   (``simulator.engine``), and prints a table with the relative errors, their median and max.

The per-stage tail R[s] given to (a) and (b) is the measured finalize + optimizer time of stage s
(what the plugin would profile as the stage's all-reduce); (c) models the tail as megatron runs it.

Layout (only ``harness`` and ``mcore_memory`` import torch and megatron-core; the rest imports
without them):

===============  ==============================================================================
``cases``        ``Case``, ``DEFAULT_CASES`` / ``FULL_EXTRA``, ``select_cases``, ``Emulation``
``predict``      ``StageProfile`` and the three predictors (``predict_dag``, ``predict_eq1``,
                 ``predict_engine``) over the simulator family
``report``       ``Row``, ``error_stats``, ``format_table``, ``CaseResult``,
                 ``assemble_case`` (worker results -> row), ``draw_case``, ``write_json``
``harness``      the spawned workers: emulated model, profiling, measurement; ``run_cases``
``command``      the argument parser and ``main``
``memory_check`` the memory model held to megatron-core's layers (``python -m
                 poseidon_plugin.fidelity.memory_check``): cells, predictions, table
``mcore_memory`` its worker: gloo ranks build one layer, count the bytes kept for backward
===============  ==============================================================================

``main(argv)`` accepts a list of argv strings (or an argparse namespace from the CLI);
``--gantt FILE`` draws the measured and the predicted timeline of one case side by side;
``--json FILE`` writes every row; ``--full`` runs the larger case set.
"""

from .command import main

__all__ = ["main"]
