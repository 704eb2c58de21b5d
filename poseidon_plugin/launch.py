"""``python -m poseidon_plugin.launch SCRIPT.py [args...] [--poseidon-auto ...]``

Works under torchrun (``torchrun --nproc-per-node 8 -m poseidon_plugin.launch pretrain_gpt.py ...``).
Without ``--poseidon-auto`` the script runs unchanged (``--poseidon-*`` options are still stripped).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from poseidon_plugin.megatron.launch.runner import launch_main

    return launch_main(argv)


if __name__ == "__main__":
    sys.exit(main())
