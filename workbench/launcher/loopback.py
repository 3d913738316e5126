"""`python -m workbench.launcher.loopback MODULE ARGS...`: run a shell launcher (torchrun's
`torch.distributed.run`, `accelerate.commands.launch`) of a single-node run with its rendezvous
store listening on loopback only.

torch's TCPStore server listens on every interface whatever --master_addr says, so anyone who can
reach the host could read and write the store of a run on it. The launcher is run here, in this
interpreter, after bind_store_servers: its elastic agent hosts the store, and its ranks, told to use
the agent's store, only connect to it.
"""

from __future__ import annotations

import runpy
import sys

from workbench.utils.distributed import LOOPBACK, bind_store_servers


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m workbench.launcher.loopback MODULE [ARGS...]")
    module, *args = argv
    bind_store_servers(LOOPBACK)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
