"""Megatron-LM / MindSpeed-LLM integration of Poseidon (imports torch and megatron lazily).

Modules, in the order the ``--poseidon-auto`` flow uses them:

* ``options``   -- ``--poseidon-*`` options, stripped from argv
* ``argv``      -- refused flags, argv rewrite with the plan's flags, MindSpeed-LLM repatch
* ``emulation`` -- CPU emulation of device types (``--poseidon-emulate FILE``)
* ``bootstrap`` -- rendezvous store, deadline barriers, probe gloo group, devices and their
  collective backend, the NCCL / HCCL group for profiling, re-init
* ``discovery`` -- who runs where; nodes, device types, link probe; the discovered Cluster
* ``profiler``  -- the user's own layer, timed per TP degree and micro-batch size
* ``profile_gather`` -- the profile cache, gathered timings as profile records, calibration
* ``renumber``  -- launch rank -> new rank so each device lands on its planned stage
* ``runner``    -- the flow and the entry points (``poseidon_plugin.launch``, ``poseidon_plugin.auto``)
* ``compat``    -- small fixes before the script runs (prebuilt dataset helpers; CPU-only flags)
* ``calibration``, ``recorder`` -- live calibration of the running job (predicted vs measured)
* ``offline``   -- ``poseidon profile``: the profiler as an offline, one-process command
* ``provenance`` -- the versions of the frameworks actually imported (records' ``env``, cache key)
* ``imports``   -- a failed import as one line: what is missing and the fix
"""
