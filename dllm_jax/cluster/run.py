"""`dllm-jax serve --replicas N`: the Ray Serve application (`app.build_app`) on a Ray cluster (one started here
for this server unless --address names a running one), until SIGTERM / SIGINT.

The serve flags are checked here before Ray starts (one line, exit 2, as the single server); each replica then
loads the model and warms its engine. The command prints the address once every replica is ready.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

from dllm_jax import cli

APP_NAME = "dllm-jax"  # the Ray Serve application's name (its replicas' processes carry it)
READY_TIMEOUT_S = 1800.0  # a replica's model load and warm-up (minutes for an 8B model's programs)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_address(host: str, port: int) -> tuple[str, int]:
    """Start Ray Serve's HTTP proxy at host:port, or join the one the cluster runs already: Serve keeps the options
    it was first started with (one proxy serves every application of a cluster) and ignores others. Returns where
    the proxy listens."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    try:  # Ray 2.60 has no public getter of the running proxy's options; should this one move, ours are assumed
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config
        return http.host, int(http.port)
    except Exception:  # noqa: BLE001
        return host, port


def refusal(ready: dict) -> str | None:
    """The flag refusal a replica reports in the ingress's GET /ready body (`ReplicaServer.refused`), if any."""
    for replica in ready.get("replicas") or ():
        if isinstance(replica, dict) and replica.get("status") == "failed" and replica.get("error"):
            return str(replica["error"])
    return None


def wait_ready(url: str, deadline: float, stop: threading.Event) -> str | None:
    """Poll GET /ready until every replica is ready (None), one reports a refusal of the flags (its message), the
    deadline passes or a stop comes (None)."""
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return None
        except urllib.error.HTTPError as e:
            try:
                refused = refusal(json.loads(e.read()))
            except ValueError:
                refused = None
            if refused is not None:
                return refused
        except OSError:  # not listening yet
            pass
        stop.wait(1.0)
    return None


def run_cluster(args: argparse.Namespace) -> int:
    cli.check_serve_flags(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise cli.UsageError(
            "argument --replicas: replicas run on Ray Serve: pip install 'dllm-jax[cluster]' (ray[serve])"
        ) from None
    from dllm_jax.cluster.app import build_app

    port = args.port or free_port(args.host)
    stop = threading.Event()
    # without --address, a Ray instance of this server's own: Ray's default would join a cluster this machine runs
    # (`ray start`, RAY_ADDRESS) and stopping would then shut down that cluster's Serve and its other applications
    ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=bool(args.verbose))
    # a shared cluster may run this application already (another server's): deploying ours under its name would
    # replace it, and stopping ours would then delete it
    if args.address is not None and APP_NAME in serve.status().applications:
        ray.shutdown()
        raise cli.UsageError(
            f"argument --address: the Ray cluster at {args.address} already runs a {APP_NAME} server (its own "
            "application, which a second one would replace); stop it first, or start this one on another cluster"
        )
    # after ray.init, which installs its own handlers: the first signal stops the cluster cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        gpus = args.gpus_per_replica
        if gpus is None:  # a tensor-parallel replica is a group of GPUs
            gpus = float(args.tensor_parallel) if ray.cluster_resources().get("GPU", 0) else 0.0
        requested = (args.host, port)
        host, port = serve_address(*requested)
        if (host, port) != requested:
            print(
                f"dllm-jax serve: Ray Serve on this cluster listens at {host}:{port} already (the options it started "
                "with, shared by its applications): serving there",
                file=sys.stderr,
                flush=True,
            )
        app = build_app(
            args,
            args.replicas,
            gpus_per_replica=gpus,
            memory_fraction=args.replica_memory_fraction,
            spill_queue=args.spill_queue,
            affinity=not args.no_affinity,
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{host}:{port}"
        # the cluster's address: other commands join this cluster with it (`--address auto` picks the newest one
        # this machine started, which need not be this one)
        print(
            f"dllm-jax serve: {args.replicas} replicas on Ray Serve at {url}/v1 (Ray cluster at "
            f"{ray.get_runtime_context().gcs_address}), warming up (GET /ready: 200 once every replica is; Ctrl-C "
            "or SIGTERM: stop)",
            file=sys.stderr,
            flush=True,
        )
        refused = wait_ready(f"{url}/ready", time.monotonic() + READY_TIMEOUT_S, stop)
        if refused is not None:
            raise cli.UsageError(refused)
        if not stop.is_set():
            print(f"dllm-jax serve: ready at {url}/v1", file=sys.stderr, flush=True)
        stop.wait()
        print("dllm-jax serve: stopping the replicas", file=sys.stderr, flush=True)
        return 0
    finally:
        try:
            if args.address is None:  # the Ray instance is this command's: Serve goes with it
                serve.shutdown()
            else:  # a shared cluster: its other applications (and Serve's proxy) keep running
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
