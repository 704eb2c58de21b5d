"""Run under torchrun by tests/test_search_distributed.py: searcher ranks over the real
torch.distributed store, one of them misbehaving on request.

    torchrun --nproc-per-node K tests/dist_search_probe.py MODE
MODE: ok (rank 0 prints the plan's JSON), never (rank 1 joins the process group but never
searches), die (rank 1 exits once it has sent its root bounds, as a lost process would)."""

from __future__ import annotations

import os
import sys
import time

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.launch.search_transport import searchers_from_environ
from poseidon_plugin.model import get_model
from poseidon_plugin.search import SearchOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    with searchers_from_environ(workers=1) as g:
        if rank == 1 and mode == "never":
            g.close()                  # joined the group, then silent (no heartbeat)
            time.sleep(300)
            return 0
        if rank == 1 and mode == "die":
            orig = g.store.set

            def set_(key, value):
                orig(key, value)
                if key.endswith(f"/roots/{rank}"):
                    os._exit(0)
            g.store.set = set_
        if not g.coordinator:
            g.serve()
            return 0
        cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", "paper-setting1.yaml"))
        try:
            plan = g.search(cluster, get_model("llama3-8b"), SearchOptions(
                global_batch_size=128, seq_length=4096, runner_up=False))
        except PoseidonError as e:
            print(f"poseidon: error: {e}", flush=True)
            os._exit(3)                # (the process group's teardown would wait for rank 1)
        print(plan.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
