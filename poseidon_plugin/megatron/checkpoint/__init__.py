"""Checkpoints across a re-plan: a job saved under one plan resumes under another.

* ``change``  -- what changed between two launches (devices lost / added, the plan's shape and
  predicted time), in one line; torch-free (``poseidon plan --keep`` prints it offline)
* ``reader``  -- a Megatron checkpoint read without loading it (format, the layout it was saved
  at, the distributed optimizer's sharding type, the files its metadata lists), and Poseidon's
  own record beside it
* ``resume``  -- the launch's hooks: ``--save`` refused up front when megatron-core's writer
  cannot run, the load checked against the new plan on rank 0 before any model is built (one
  line: convert or refuse, never load silently wrong), and the record written after each save

Nothing here imports torch at module level.
"""
