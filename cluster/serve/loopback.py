"""Keep Ray Serve's own listening sockets off the outside interfaces.

Two servers of Ray Serve 2.60 ignore the addresses they are given:

* the gRPC proxy (see :func:`proxy_callback`);
* each replica's inter-deployment gRPC server, bound to ``[::]:0`` when the
  replica initialises (see :func:`bind_replica_server_to_node_ip`).


Ray Serve 2.60 starts its gRPC server on ``[::]:<grpc port>``
(``ray.serve._private.grpc_util.start_grpc_server``), whatever
``http_options.host`` says. Serve calls a user callback in each proxy actor
before it starts its servers: the import path in the environment variable
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, which must return a list of
HTTP middlewares. :func:`proxy_callback` returns none and makes the gRPC
server listen on ``SPECRAY_GRPC_HOST`` (default 127.0.0.1) instead.

The variable must be in the environment of the Ray node (the process that
starts Ray) so that the proxy actors inherit it::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specray.serve.loopback:proxy_callback \\
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \\
    ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1

The same callback makes a client's cancel reach the replica reliably
(:mod:`specray.serve.proxy_cancel`). ``specray serve`` sets both when it
starts Ray itself. This patches a private
Ray function: on a Ray without it the callback logs a warning and changes
nothing.
"""

import logging
import os

CALLBACK = "specray.serve.loopback:proxy_callback"
log = logging.getLogger("specray.serve")


def grpc_host() -> str:
    return os.environ.get("SPECRAY_GRPC_HOST", "127.0.0.1")


def proxy_callback() -> list:
    """Runs in each Serve proxy actor before its servers start: binds the
    gRPC server to ``SPECRAY_GRPC_HOST`` and installs
    :mod:`specray.serve.proxy_cancel`."""
    from specray.serve import proxy_cancel

    proxy_cancel.install()
    bind_grpc_servers(grpc_host())
    return []


def bind_grpc_servers(host: str) -> None:
    """Serve's gRPC servers of this process (the proxy's; a replica's own,
    under direct ingress) listen on ``host`` instead of ``[::]``."""
    try:
        from ray.serve._private import default_impl

        original = getattr(default_impl.add_grpc_address, "__wrapped__", default_impl.add_grpc_address)

        def add_grpc_address(grpc_server, server_address: str):
            if server_address.startswith("[::]:"):
                port = server_address.rsplit(":", 1)[1]
                server_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            return original(grpc_server, server_address)

        add_grpc_address.__wrapped__ = original
        default_impl.add_grpc_address = add_grpc_address
    except (ImportError, AttributeError) as e:
        log.warning("specray: cannot bind Serve's gRPC server to %s (%s); it listens on all interfaces", host, e)


def bind_replica_server_to_node_ip() -> None:
    """Called in the replica's constructor (before Serve starts the
    replica's inter-deployment gRPC server): on a node whose Ray address is
    loopback, that server listens on loopback too. Elsewhere nothing changes
    (other nodes must reach it)."""
    try:
        import ray
        from ray.serve._private import replica

        ip = ray.util.get_node_ip_address()
        if not (ip.startswith("127.") or ip == "::1"):
            return
        original = getattr(replica.add_port_to_grpc_server, "__wrapped__", replica.add_port_to_grpc_server)

        def add_port_to_grpc_server(server, address: str):
            if address.startswith("[::]:"):
                address = f"{ip}:{address.rsplit(':', 1)[1]}"
            return original(server, address)

        add_port_to_grpc_server.__wrapped__ = original
        replica.add_port_to_grpc_server = add_port_to_grpc_server
    except (ImportError, AttributeError) as e:
        log.warning("specray: cannot bind the replica's gRPC server to loopback (%s)", e)
    bind_grpc_servers(grpc_host())  # its own gRPC server under direct ingress (``specray serve``'s default)


def environment(host: str = "127.0.0.1") -> dict:
    """Environment variables a Ray node needs for loopback-only serving."""
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK, "SPECRAY_GRPC_HOST": host}
    if host in ("127.0.0.1", "localhost", "::1"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray itself on loopback (read when ray is imported)
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the engine's CPU process group
    return env


def prepare_local_ray(host: str = "127.0.0.1") -> None:
    """Before starting a local Ray from this process: the environment above
    (values already set win), and Ray's loopback switch even if ``ray`` was
    imported before the variable was set (Ray reads it at import)."""
    env = environment(host)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        try:
            import ray._private.ray_constants as rc

            rc.ENABLE_RAY_CLUSTER = False
        except (ImportError, AttributeError):
            pass
