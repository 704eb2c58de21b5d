"""``import poseidon_plugin.auto`` as the first line of a training script (the one-line patch).

At import, if ``--poseidon-auto`` (or ``--poseidon-dry-run`` / ``--poseidon-emulate``) is on the
command line, every rank runs the Poseidon flow (discovery, profiling, plan, rank renumbering) and
``sys.argv`` is rewritten for the plan before the script goes on to parse it. ``--poseidon-*``
options are always stripped, so the script's own parser never sees them. For MindSpeed-LLM, import
this before ``mindspeed_llm`` (its adaptor parses ``sys.argv`` at import).
"""

from __future__ import annotations

from poseidon_plugin.megatron.launch.runner import auto_main as _auto_main

_auto_main()
