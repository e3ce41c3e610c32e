"""``specray serve``: run the OpenAI-compatible HTTP + gRPC server on Ray
Serve, on loopback by default, until Ctrl-C."""

import argparse
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request

from specray.cli import add_model_args, drafting_args

# A one-line answer, then one long enough for its acceptance and speed to mean something.
SAMPLE_QUESTIONS = ("What is the capital of France?", "Explain in a few sentences why the sky is blue.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specray serve", description=__doc__)
    m = p.add_argument_group("model")
    add_model_args(m)
    m.add_argument("--model-name", help="served model id (default: the target directory's name)")
    m.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="target TP ranks")
    m.add_argument("--drafter-placement", choices=["auto", "separate", "colocated", "separate_same_gpu"],
                   default="auto", help="auto (default): colocated, the fastest measured; separate: the drafter on "
                   "a GPU of its own; separate_same_gpu: its own process on rank 0's GPU (fails apart, slower)")
    m.add_argument("--backend", choices=["ray", "inprocess"], default="ray",
                   help="ray: engine actors beside the replica (default); inprocess: the model inside the replica")
    m.add_argument("--num-kv-blocks", type=int)
    m.add_argument("--kv-block-size", type=int, default=16)
    m.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch")
    m.add_argument("--eager", action="store_true",
                   help="no CUDA graphs (on a GPU, decode steps and lone prefills replay from graphs by default)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="HTTP port")
    s.add_argument("--grpc-port", type=int, default=9000, help="gRPC port (0: no gRPC)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: env SPECRAY_API_KEY)")
    s.add_argument("--max-queued", type=int, default=64,
                   help="requests admitted beyond --max-num-seqs per replica; more get HTTP 429")
    s.add_argument("--num-replicas", type=int, default=1)
    s.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                   help="the replica serves HTTP on --port itself, without Serve's proxy in between (Ray Serve's "
                        "experimental direct ingress). Default: on where it can run (one replica, a Ray this "
                        "command starts), else Serve's proxy with a note saying why; --direct-ingress where it "
                        "cannot run is an error; --no-direct-ingress: always Serve's proxy")
    s.add_argument("--app-name", default="specray")
    s.add_argument("--sample-request", action="store_true",
                   help=f"after startup, ask {' and '.join(map(repr, SAMPLE_QUESTIONS))} and print the answers "
                        "with their speed and acceptance stats")
    s.add_argument("--exit-after-sample", action="store_true", help="exit after --sample-request")
    s.add_argument("--sample-max-tokens", type=int, default=100, help="the most tokens of each sample answer")
    return p


def _start_ray(host: str):
    """Connect to RAY_ADDRESS, else start a local Ray bound to loopback with
    Serve's gRPC proxy bound to ``host``. Returns True when this process
    started Ray (and so should stop it)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    # log_to_driver=False: the actors' logs (Serve's controller, proxies and
    # replicas log every request at INFO) stay in Ray's log files.
    if address:
        ray.init(address=address, namespace="serve", logging_level="WARNING", log_to_driver=False)
        return False
    from specray.priority import local_ray_env
    from specray.serve.loopback import prepare_local_ray

    prepare_local_ray(host)
    local_ray_env()
    # address="local": a fresh cluster even if /tmp/ray/ray_current_cluster
    # names one that `ray start` left behind.
    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), _node_ip_address="127.0.0.1",
             include_dashboard=False, namespace="serve", logging_level="WARNING", log_to_driver=False)
    return True


def direct_ingress_refused(args) -> str | None:
    """Why direct ingress cannot run with these arguments, or None."""
    if args.num_replicas != 1:
        return f"serves one replica on --port; got --num-replicas {args.num_replicas}"
    if os.environ.get("RAY_ADDRESS"):
        return "needs the Ray this command starts (RAY_ADDRESS is set: that cluster's Serve runs as it was started)"
    return None


def choose_direct_ingress(args) -> tuple[bool, str | None]:
    """(serve HTTP from the replica?, error). ``--direct-ingress`` unset:
    on where it can run, else Serve's proxy with a printed note; given
    where it cannot run: an error; ``--no-direct-ingress``: the proxy."""
    if args.direct_ingress is False:
        return False, None
    why = direct_ingress_refused(args)
    if why is None:
        return True, None
    if args.direct_ingress:
        return False, f"--direct-ingress {why}"
    print(f"specray: HTTP through Serve's proxy, not direct ingress: it {why}", flush=True)
    return False, None


def direct_ingress_environment(host: str, port: int) -> int:
    """Before Ray starts (its processes read these at start-up): the
    replica's own HTTP server on ``port``, the one port Serve may give it.
    Serve still runs its proxy (gRPC, and HTTP on a free port returned
    here). The proxy's hop (the request to the replica and every streamed
    chunk back through a Ray call) cost 5-10 ms of time to first token on
    the development CPU (results/cpu_direct_ingress.json). The proxy's port
    is taken outside the kernel's ephemeral range: one the kernel handed
    out here could be taken by an outgoing connection of Ray's, which
    starts after, before the proxy binds it (CI: "Failed to bind to address
    127.0.0.1:52365")."""
    from specray.serve_process import free_port

    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(port + 1)  # exclusive
    # A released port is held back for Serve's HAProxy mode (none here): the
    # replica Serve starts in place of a lost one must take the same port.
    os.environ["RAY_SERVE_PORT_QUARANTINE_S"] = "0"
    while (proxy := free_port(host)) == port:
        pass
    return proxy


def _ray_logs_dir() -> str | None:
    try:
        from ray._private import worker

        return os.path.join(worker._global_node.get_session_dir_path(), "logs")
    except Exception:  # a private API: the path is a convenience, not a need
        return None


def _metrics_url() -> str | None:
    """Ray's metrics export endpoint of this node (where specray_* land)."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
        for node in ray.nodes():
            if node.get("Alive") and node.get("NodeManagerAddress") == ip and node.get("MetricsExportPort"):
                return f"http://{ip}:{node['MetricsExportPort']}/metrics"
    except Exception:
        pass
    return None


def sample_request(base_url: str, model: str, api_key: str | None, max_tokens: int = 100,
                   timeout: float = 300.0, question: str = SAMPLE_QUESTIONS[0]) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def print_sample(question: str, resp: dict, seconds: float) -> None:
    choice, stats = resp["choices"][0], resp.get("specray", {})
    tokens = resp["usage"]["completion_tokens"]
    print(f"specray: sample Q: {question}", flush=True)
    print(f"specray: sample A: {' '.join(choice['message']['content'].split())}", flush=True)
    print(f"specray:   {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s "
          f"(finish {choice['finish_reason']}); mean acceptance length {stats.get('mean_acceptance_length', 0):.2f} "
          f"over {len(stats.get('acceptance_lengths', []))} decode steps "
          f"(accepted {stats.get('num_accepted_tokens')} of {stats.get('num_draft_tokens')} drafts)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.exit_after_sample and not args.sample_request:
        print("specray serve: --exit-after-sample needs --sample-request", file=sys.stderr)
        return 2
    direct, error = choose_direct_ingress(args)
    if error:
        print(f"specray serve: error: {error}", file=sys.stderr)
        return 2
    from specray.config import ConfigError

    try:
        from specray.cli import resolve_models
        from specray.default_model import default_cache_dir, default_target_ready

        if args.target is None and not default_target_ready():
            print(f"specray: converting the embedded target (SmolLM2-135M-Instruct, from its GGUF) into "
                  f"{default_cache_dir()}, once", flush=True)
        target, drafter = resolve_models(args)
    except Exception as e:  # the embedded default pair may be missing or not convertible here
        what = "the default models" if args.target is None else "the models"
        print(f"specray serve: error: cannot resolve {what}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY") or None
    app_args = dict(
        target=target, drafter=drafter, no_drafter=args.no_drafter, model_name=args.model_name,
        device=args.device, dtype=args.dtype, backend=args.backend, tensor_parallel_size=args.tp,
        drafter_placement=args.drafter_placement, max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks, kv_block_size=args.kv_block_size, max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued, api_key=api_key, num_replicas=args.num_replicas,
        engine=dict(**drafting_args(args), num_speculative_tokens=args.num_speculative_tokens,
                    cuda_graphs=False if args.eager else None, async_scheduling=args.async_scheduling),
    )
    try:
        from specray.serve.app import GRPC_SERVICER_FUNCTIONS, build_app
        from specray.serve.settings import _resolve

        settings = _resolve(app_args)
        application = build_app(settings)
    except (ConfigError, ValueError) as e:
        print(f"specray serve: error: {e}", file=sys.stderr)
        return 2

    proxy_port = args.port
    if direct:
        proxy_port = direct_ingress_environment(args.host, args.port)
    print("specray: starting Ray and the Serve app", flush=True)
    started_ray = _start_ray(args.host)
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    # Serve's driver-side logger says each step of starting up at INFO.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)

    try:  # Serve already running on a cluster we joined: leave it running on exit
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        serve_was_running = True
    except ValueError:
        serve_was_running = False

    grpc_options = {"port": args.grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS} \
        if args.grpc_port else {"port": 0, "grpc_servicer_functions": []}
    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Explicitly: a shell starting us in the background leaves SIGINT ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        t = time.perf_counter()
        serve.start(http_options={"host": args.host, "port": proxy_port}, grpc_options=grpc_options)
        serve.run(application, name=args.app_name, route_prefix="/")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        base_url = f"http://{host}:{args.port}"
        print(f"specray: serving {settings.model_name!r} (target {target}, drafter {drafter or 'none'}) "
              f"ready in {time.perf_counter() - t:.1f} s", flush=True)
        print(f"specray: OpenAI API at {base_url}/v1  (health: {base_url}/health)", flush=True)
        if direct:
            print(f"specray: HTTP served by the replica itself (direct ingress); Serve's proxy at {host}:{proxy_port}",
                  flush=True)
        else:
            print("specray: HTTP served through Serve's proxy", flush=True)
        if args.grpc_port:
            print(f"specray: gRPC specray.v1.SpecRay at {host}:{args.grpc_port}", flush=True)
        metrics = _metrics_url()
        if metrics:
            print(f"specray: Prometheus metrics (ray_specray_*) at {metrics}", flush=True)
        logs = _ray_logs_dir()
        if logs:
            print(f"specray: Ray's logs (Serve controller, proxy, replicas) in {logs}", flush=True)
        if args.sample_request:
            for question in SAMPLE_QUESTIONS:
                t = time.perf_counter()
                resp = sample_request(base_url, settings.model_name, api_key, args.sample_max_tokens,
                                      question=question)
                print_sample(question, resp, time.perf_counter() - t)
            if args.exit_after_sample:
                return 0
        print("specray: press Ctrl-C to stop", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("specray: shutting down", flush=True)
    except urllib.error.URLError as e:
        print(f"specray serve: sample request failed: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            # A Serve of a Ray we started goes with that Ray: serve.shutdown()
            # would have its controller kill itself mid-call, which Ray reports
            # on stdout as a failed task.
            if serve_was_running or started_ray:
                serve.delete(args.app_name)
            else:
                serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
    return 0
