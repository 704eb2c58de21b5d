"""Megatron-LM / MindSpeed-LLM integration of Poseidon (imports torch and megatron lazily).

Modules, in the order the ``--poseidon-auto`` flow uses them:

* ``options``   -- ``--poseidon-*`` options, stripped from argv
* ``argv``      -- refused flags, plan -> flags, argv rewrite, MindSpeed-LLM translation / repatch
* ``emulation`` -- CPU emulation of device types (``--poseidon-emulate FILE``)
* ``bootstrap`` -- rendezvous store, deadline barriers, probe gloo group, devices, re-init
* ``discovery`` -- who runs where; nodes, device types, link probe; the Cluster
* ``profiler``  -- the user's own layer, timed per TP degree and micro-batch size
* ``renumber``  -- launch rank -> new rank so each device lands on its planned stage
* ``runner``    -- the flow and the entry points (``poseidon_plugin.launch``, ``poseidon_plugin.auto``)
* ``compat``    -- small fixes before the script runs (prebuilt dataset helpers; CPU-only flags)
* ``_testing``  -- a stand-in planner for the integration's own tests
"""
