"""The Ray tests' cluster: a head on 127.0.0.1 and a node on 127.0.0.2 (one CPU each, token authentication), up
once for the Ray stage (every module that uses the `ray_cluster` fixture shares it: a node takes ~8 s to start here)
and taken down after it, every process it started. Skipped with
the reason where Ray Train isn't installed. This process gets the cluster's token before it first imports ray
(Ray reads its token settings once, at import)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from workbench.cluster.raytrain.local import LocalRayCluster, available


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    why = available()
    if why is not None:
        pytest.skip(why)
    local = LocalRayCluster(nodes=2, cpus=1)
    local.start()
    try:
        with local.in_environment():
            yield local
    finally:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        local.stop()
