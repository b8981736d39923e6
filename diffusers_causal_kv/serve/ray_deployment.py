"""Scale-out on Ray Serve: replicas that each hold a pipeline and its session loop, the same protocol in front.

Each replica is a Ray Serve deployment replica whose ASGI app is the single-process server's own app
(:func:`~.server.create_server`), built in the replica after it loaded its pipeline. A session lives on one
WebSocket connection, and Ray Serve's proxy routes a connection to one replica for its whole life, so a session is
pinned to the replica that admitted it: its cache never moves. A replica takes at most ``max_sessions`` connections
(``max_ongoing_requests``); the proxy sends a new one to a replica with room, or holds it until one has.

Locally (:func:`run_local`, ``python -m diffusers_causal_kv.serve MODEL --replicas N``) Ray runs on this machine on
the loopback address only: node IP 127.0.0.1, no dashboard, no usage statistics. On a cluster, ``serve run
diffusers_causal_kv.serve.ray_deployment:app_builder model=...`` (docs/serving.md).
"""

from __future__ import annotations

import os
import time

from ray import serve
from ray.serve import Application

from .server import ServerOptions, create_server, load_pipeline


@serve.deployment
@serve.ingress()
class StreamReplica:
    """One replica: a pipeline on its device, its session loop and the app in front of it."""

    def __init__(self, model: str, options: ServerOptions, device: str | None = None, dtype: str | None = None):
        _bind_to_node_ip()
        name = serve.get_replica_context().replica_id.unique_id
        self._app, self._loop = create_server(load_pipeline(model, device, dtype), options, name=name)

    def __serve_build_asgi_app__(self):
        return self._app

    def __del__(self):  # Ray Serve calls it when the replica stops: end the sessions, free their caches
        self._loop.shutdown()


def _bind_to_node_ip() -> None:
    """Ray Serve (2.60) binds each replica's internal gRPC server to every interface (``[::]:0``) once the replica's
    constructor returned, where Ray's own servers bind to the node IP; bind it to the node IP too (127.0.0.1 on a
    local Ray), so that a local server listens on nothing but the loopback."""
    import ray
    from ray.serve._private import replica

    node = ray.util.get_node_ip_address()
    host = f"[{node}]" if ":" in node else node
    bind = replica.add_port_to_grpc_server

    def bind_to_node(server, address: str):
        return bind(server, host + address[len("[::]"):] if address.startswith("[::]:") else address)

    replica.add_port_to_grpc_server = bind_to_node


def build(model: str, options: ServerOptions, replicas: int = 1, gpus_per_replica: float = 0.0,
          device: str | None = None, dtype: str | None = None) -> Application:
    """The Ray Serve application: ``replicas`` replicas of ``model``, each with ``gpus_per_replica`` GPUs (one per
    pipeline; a context-parallel replica takes more, see docs/serving.md)."""
    return StreamReplica.options(
        num_replicas=replicas, max_ongoing_requests=options.max_sessions,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": 0 if gpus_per_replica else 1},
    ).bind(model, options, device, dtype)


def app_builder(args: dict) -> Application:
    """For ``serve run diffusers_causal_kv.serve.ray_deployment:app_builder model=FOLDER replicas=N
    gpus_per_replica=1 ...`` (and ``serve deploy`` configs): ``model`` and the :class:`ServerOptions` fields
    ``budget``, ``max_sessions``, ``token``, ``height``, ``width``."""
    fields = {name: kind for name, kind in (("budget", int), ("max_sessions", int), ("token", str),
                                            ("height", int), ("width", int)) if name in args}
    options = ServerOptions(**{name: kind(args[name]) for name, kind in fields.items()})
    return build(args["model"], options, int(args.get("replicas", 1)), float(args.get("gpus_per_replica", 1)),
                 args.get("device"), args.get("dtype"))


def start_local_ray(**init_kwargs) -> None:
    """Start Ray on this machine, on the loopback address only: node IP 127.0.0.1, no dashboard, no usage
    statistics (nothing is sent to another address)."""
    import ray
    from ray._private import ray_constants

    # Read by Ray and inherited by the processes it starts. Ray turns a node IP of 127.0.0.1 into the machine's own
    # address unless it runs as a single machine (its flag for the platforms where it does so by default), which is
    # also read when ray is imported: set for this process too.
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, **init_kwargs)


def serve_local(app: Application, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run ``app`` on the running local Ray, its HTTP proxy on ``host:port`` (returns once every replica is up)."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="causal-wan-stream", route_prefix="/")


def run_local(model: str, options: ServerOptions, replicas: int, host: str = "127.0.0.1", port: int = 8000,
              gpus_per_replica: float = 0.0, device: str | None = None, dtype: str | None = None) -> None:
    """The command line's ``--replicas N``: a local Ray on loopback, ``replicas`` replicas, until interrupted."""
    start_local_ray()
    serve_local(build(model, options, replicas, gpus_per_replica, device, dtype), host, port)
    print(f"serving {model} with {replicas} Ray Serve replicas on http://{host}:{port}/", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
