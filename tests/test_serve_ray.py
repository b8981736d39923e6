"""The stream server on Ray Serve: two CPU replicas, each loading the pipeline from a folder, serve two sessions
pinned to one replica each, whose frames equal the single-process ones; Ray runs on the loopback address only (every
socket the cluster opened is listed and must be a loopback one). Ray starts once for the module (slow on two cores).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pathlib
import urllib.request

import numpy as np
import psutil
import pytest
from serve_helpers import Viewer, direct_video, free_port, loopback_only, options, tiny_pipe

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SESSIONS = [("a red ball", 1), ("a blue cube on a table", 2)]


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _cluster_sockets() -> list[tuple]:
    """(process, local address, remote address, status) of every inet socket of this process and the processes it
    started (Ray's GCS, raylet, workers, proxy, controller and replicas)."""
    found = []
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            found += [(process.name(), c.laddr, c.raddr, c.status) for c in process.net_connections(kind="inet")]
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray with two replicas of a tiny pipeline saved to a folder: ``(address, folder)``."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from diffusers_causal_kv.serve.ray_deployment import build, serve_local, start_local_ray

    folder = tmp_path_factory.mktemp("model") / "tiny"
    tiny_pipe().save_pretrained(folder)
    port = free_port()
    with pytest.MonkeyPatch.context() as patch, loopback_only():
        # the replicas import this checkout's package, as the tests do (not an installed copy)
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        # Serve kills a proxy not ready within 5 s, too short on two busy cores
        patch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
        patch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "120")
        start_local_ray(num_cpus=2)
        try:
            serve_local(build(str(folder), options(max_sessions=1), replicas=2), port=port)
            yield f"127.0.0.1:{port}", folder
        finally:
            serve.shutdown()
            ray.shutdown()


def test_two_replicas_serve_two_pinned_sessions_equal_to_one_process_on_loopback_only(cluster):
    from ray._common.usage import usage_lib

    from diffusers_causal_kv import CausalWanPipeline

    address, folder = cluster
    with urllib.request.urlopen(f"http://{address}/health", timeout=60) as reply:
        assert json.load(reply)["max_sessions"] == 1
    viewers = [Viewer(address) for _ in SESSIONS]  # both connections open: one per replica (one session each)
    for viewer, (prompt, seed) in zip(viewers, SESSIONS):
        viewer.send(type="start", prompt=prompt, seed=seed, num_frames=9)
    started = [viewer.until("started") for viewer in viewers]
    replicas = {s["session"].rsplit("-", 1)[0] for s in started}
    assert len(replicas) == 2
    for viewer, start in zip(viewers, started):
        headers = [viewer.until("chunk") for _ in range(3)]
        assert {h["session"] for h in headers} == {start["session"]}  # every chunk from the replica it started on
        viewer.until("done")
    sockets = _cluster_sockets()
    for viewer in viewers:
        viewer.close()

    pipe = CausalWanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for viewer, (prompt, seed) in zip(viewers, SESSIONS):
        np.testing.assert_array_equal(viewer.video(), direct_video(pipe, prompt, seed, 3)[0])

    assert len(sockets) > 10  # the GCS, raylet, workers and the proxy talk over sockets
    outside = [s for s in sockets if not _loopback(s[1].ip) or (s[2] and not _loopback(s[2].ip))]
    assert outside == []
    assert not usage_lib.usage_stats_enabled()
    # Ray's API server runs without the dashboard's web frontend and modules (only the usage-statistics module,
    # which RAY_USAGE_STATS_ENABLED=0 keeps silent)
    heads = [p.cmdline() for p in psutil.Process().children(recursive=True) if "dashboard.py" in " ".join(p.cmdline())]
    assert heads and all("--disable-frontend" in c and "--modules-to-load=UsageStatsHead" in c for c in heads)


def test_the_cluster_builder_takes_serve_run_arguments():
    from ray.serve import Application

    from diffusers_causal_kv.serve.ray_deployment import app_builder

    app = app_builder({"model": "/shared/model", "replicas": "4", "gpus_per_replica": "1", "max_sessions": "3",
                       "token": "s3cret", "height": "32"})
    assert isinstance(app, Application)
    deployment = app._bound_deployment
    assert deployment.num_replicas == 4 and deployment.max_ongoing_requests == 3
    assert deployment.ray_actor_options["num_gpus"] == 1.0
    model, options, *_ = deployment.init_args
    assert model == "/shared/model" and (options.max_sessions, options.token, options.height) == (3, "s3cret", 32)
