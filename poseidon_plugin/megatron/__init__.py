"""Megatron-LM / MindSpeed-LLM integration of Poseidon (imports torch and megatron lazily).

Rooms, by the phase of a ``--poseidon-auto`` launch they serve:

* ``launch/``    -- the flow on every rank before the user's script builds anything:
  ``options`` (``--poseidon-*``, stripped from argv), ``argv`` (refused flags, the plan's flags,
  MindSpeed-LLM repatch), ``bootstrap`` (rendezvous, deadline barriers, probe group, devices),
  ``discovery`` (who runs where; the discovered Cluster), ``judge`` (the framework's own parser,
  validation and config builder on the rewritten flags), ``renumber`` (launch rank -> new rank),
  ``search_transport`` (the distributed search over torch.distributed), ``compat`` (small fixes
  before the script runs) and ``runner`` (the flow and the entry points)
* ``profile/``   -- measuring: ``profiler`` (the user's own layer per TP degree and micro-batch
  size), ``sampling``, ``group_profile``, ``op_overhead``, ``callcost_profile``,
  ``profile_gather`` (cache, records), ``profile_tps`` and ``offline`` (``poseidon profile``)
* ``calibrate/`` -- the running job: ``calibration`` (predicted vs measured) and ``recorder``
* ``emulate/``   -- CPU emulation of device types (``emulation``) and host ``contention``
* ``checkpoint/`` -- resuming under a new plan when the cluster changes

Shared by the rooms: ``framework_state`` (Megatron's process-wide state while Poseidon works),
``provenance`` (the framework versions actually imported) and ``imports`` (a failed import as one
line).
"""
