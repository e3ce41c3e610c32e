"""Start one engine on a Ray cluster: a placement group with a bundle per
target TP rank (plus one for the drafter when it runs apart), the actors,
their process group and channels, and the serving loops.

``drafter_placement``:
  * ``"auto"`` (the default): ``resolve_placement`` picks the fastest the
    hardware allows;
  * ``"separate"``: the drafter is its own actor with its own GPU (or CPU
    process), fed over NCCL via CuPy (GPU) or gloo (CPU);
  * ``"colocated"``: the drafter shares target rank 0's GPU and runs inside
    rank 0's process (NCCL cannot pair two ranks on one device);
  * ``"separate_same_gpu"``: the drafter is its own actor on rank 0's GPU
    (half of it each, in one bundle), fed through a CUDA IPC ring
    (ipc_channel.py): a drafter that can fail apart from the target without
    a second GPU. Without MPS the two processes take turns on the GPU, so it
    is slower than colocated; on CPUs it is ``"separate"``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

from specray.config import ConfigError, EngineConfig, TargetSpec
from specray.priority import local_ray_env


# Ray reads this when it is imported: a local cluster then stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def ensure_ray(num_cpus: int | None = None):
    """Connect to ``RAY_ADDRESS`` if set, else start a private local Ray
    bound to loopback (``address="local"``: never join a stale cluster that
    happens to be recorded on this machine). A local cluster declares at
    least 8 logical CPUs: actors that mostly wait (followers, a CPU drafter)
    should not need a core each."""
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, logging_level="WARNING")
        else:
            local_ray_env()
            ray.init(
                address="local",
                num_cpus=num_cpus or max(8, os.cpu_count() or 1),
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                logging_level="WARNING",
            )
    return ray


@dataclass
class EngineActors:
    """Handles of one running engine on Ray."""

    driver: object  # TargetRank 0: the EngineLoop lives here
    ranks: list
    drafter: object | None
    placement_group: object
    loops: list = field(default_factory=list)  # refs of the blocking serve loops
    rendezvous_dir: str | None = None  # the file store of a one-node process group
    # Ray ends the actors with their last handle, but a placement group lives
    # (its GPUs reserved) until removed: an engine dropped without shutdown()
    # releases it and the rendezvous directory when collected.
    release: weakref.finalize | None = None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        import ray

        try:
            ray.get(self.driver.shutdown.remote(), timeout=timeout_s)
            ray.get(self.loops, timeout=timeout_s)
        except Exception:
            pass
        for a in [*self.ranks, self.drafter]:
            if a is not None:
                ray.kill(a)
        if self.release is not None:
            self.release()
        else:
            release_group(self.placement_group, self.rendezvous_dir)


def release_group(placement_group, rendezvous_dir: str | None = None) -> None:
    import ray

    if ray.is_initialized():
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception:
            pass  # at exit, Ray may be going down with the job (which removes it)
    if rendezvous_dir is not None:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _check_resources(ray, need: dict[str, float]) -> None:
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0)) for k, v in need.items() if have.get(k, 0) < v}
    if short:
        detail = ", ".join(f"{k}: needs {v:g}, the cluster has {h:g}" for k, (v, h) in short.items())
        raise ConfigError(f"the Ray cluster is too small for this engine ({detail})")


PLACEMENTS = ("auto", "separate", "colocated", "separate_same_gpu")


def resolve_placement(drafter_placement: str) -> str:
    """``"auto"``: colocated. On one GPU it is the only placement NCCL
    allows; on the CPU it was the faster (embedded pair, batch 8: 45.0
    tok/s colocated, 42.3 separate, results/README.md). A drafter on a GPU
    of its own is chosen by name until the multi-GPU runs say it pays."""
    if drafter_placement not in PLACEMENTS:
        raise ConfigError(f"drafter_placement must be one of {PLACEMENTS}, got {drafter_placement!r}")
    return "colocated" if drafter_placement == "auto" else drafter_placement


def start_engine_actors(
    config: EngineConfig,
    tensor_parallel_size: int = 1,
    drafter_placement: str = "auto",
    ready_timeout_s: float = 120.0,
    shared_drafter=None,
) -> EngineActors:
    """``shared_drafter``: a ``shared_drafter.DrafterShare``, this replica's
    place at a drafter actor serving several replicas (N:1); the drafter is
    then not this engine's to start or end."""
    from specray.actors.workers import DrafterActor, TargetRank
    from specray.llm import resolve_max_model_len

    if shared_drafter is not None:
        if drafter_placement not in ("auto", "separate", "separate_same_gpu"):
            raise ConfigError(f"a shared drafter runs apart from the targets: drafter_placement must be 'separate' "
                              f"(or 'auto'), got {drafter_placement!r}")
        if not config.drafter:
            raise ConfigError("a shared drafter needs config.drafter")
        drafter_placement = "separate"
    drafter_placement = resolve_placement(drafter_placement)
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {tp}")
    target_spec = TargetSpec.from_dir(config.target)
    target_spec.check_tensor_parallel(tp)
    if config.drafter:
        from specray.config import DrafterSpec

        DrafterSpec.from_dir(config.drafter).check_fits(target_spec)
    max_model_len = resolve_max_model_len(config, target_spec)
    if shared_drafter is not None:
        from specray.shared_drafter import check_compatible

        check_compatible(shared_drafter.drafter.config, config)
        if shared_drafter.drafter.max_model_len != max_model_len:
            raise ConfigError(f"max_model_len {max_model_len} differs from the shared drafter's "
                              f"{shared_drafter.drafter.max_model_len}")
    ray = ensure_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = config.device != "cpu"
    separate = bool(config.drafter) and drafter_placement in ("separate", "separate_same_gpu")
    # A drafter on rank 0's GPU shares its bundle: Ray then gives both the same device.
    beside = separate and shared_drafter is None and drafter_placement == "separate_same_gpu"
    n_bundles = tp + int(separate and shared_drafter is None and not beside)
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    bundles = [dict(bundle) for _ in range(n_bundles)]
    if beside:
        bundles[0]["CPU"] = 2
    _check_resources(ray, {k: sum(b.get(k, 0) for b in bundles) for k in bundle})
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=ready_timeout_s)
    except Exception:
        ray.util.remove_placement_group(pg)
        raise ConfigError(
            f"the Ray cluster could not place {n_bundles} bundles of {bundle} within {ready_timeout_s:.0f} s "
            "(resources busy or spread over nodes that lack them)"
        ) from None

    def opts(i):
        return dict(
            num_cpus=1,
            num_gpus=(0.5 if beside and i == 0 else 1) if gpu else 0,
            max_concurrency=8,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        )

    ranks = [ray.remote(TargetRank).options(**opts(r)).remote(config, r, tp, max_model_len) for r in range(tp)]
    own = separate and shared_drafter is None
    drafter = ray.remote(DrafterActor).options(**opts(0 if beside else tp)).remote(config, max_model_len) \
        if own else None
    actors = EngineActors(ranks[0], ranks, drafter, pg)
    try:
        _wire(ray, actors, config, tp, gpu, separate, drafter_placement, shared_drafter, beside)
    except BaseException:
        actors.shutdown(timeout_s=5)
        raise
    actors.release = weakref.finalize(actors, release_group, pg, actors.rendezvous_dir)
    return actors


def _wire(ray, actors: EngineActors, config, tp, gpu, separate, drafter_placement, share=None,
          beside: bool = False) -> None:
    ranks, drafter = actors.ranks, actors.drafter
    if share is not None:
        drafter = share.drafter.actor
    # Process group: the TP ranks. A separate drafter pairs with rank 0
    # over a gloo group of their own (pair_channel.py), so that a new one can.
    world = tp
    init_method = None
    if world > 1:
        members = ranks
        if len(set(ray.get([a.node_id.remote() for a in members]))) == 1:
            # One node: rendezvous through a file, so no TCP store listens
            # on any interface.
            actors.rendezvous_dir = tempfile.mkdtemp(prefix="specray-pg-")
            init_method = f"file://{actors.rendezvous_dir}/store"
        else:
            ip, port = ray.get(ranks[0].address.remote())
            init_method = f"tcp://{ip}:{port}"
    ray.get([r.init_distributed.remote(init_method, world) for r in ranks])

    colocated = bool(config.drafter) and drafter_placement == "colocated"
    n_target = config.num_kv_blocks
    if n_target is None:
        # A drafter beside rank 0 is loaded (its weights off the free memory)
        # before rank 0 sizes both pools, each that many blocks.
        cost = ray.get(drafter.memory_cost.remote()) if beside and gpu else None
        caps = ray.get([r.kv_capacity.remote(colocated and i == 0, cost if i == 0 else None)
                        for i, r in enumerate(ranks)])
        n_target = min(caps)
    n_draft = None
    if config.drafter:
        n_draft = config.num_draft_kv_blocks or n_target
        if share is not None:
            # The replica's partition of the shared pool.
            n_draft = min(n_draft, share.drafter.blocks_per_replica)
        elif separate and config.num_draft_kv_blocks is None and not (beside and gpu):
            n_draft = min(n_target, ray.get(drafter.kv_capacity.remote()))
    for n, what in ((n_target, "target KV"), (n_draft, "drafter context KV")):
        if n is not None and n < 2:
            raise ConfigError(f"no memory left for the {what} cache ({n} blocks)")
    own = separate and share is None
    ray.get([r.init_cache.remote(n_target) for r in ranks] + ([drafter.init_cache.remote(n_draft)] if own else []))

    start_kwargs = dict(num_target_blocks=n_target, num_draft_blocks=n_draft,
                        drafter_mode="separate" if separate else ("colocated" if colocated else "none"))
    pending = []
    if separate:
        from specray.actors.pair_channel import pair_address

        # Headers (and on CPUs everything) over a gloo pair of their own;
        # between GPUs the tensors over NCCL.
        kind = ("ipc" if beside else "nccl") if gpu else "gloo"
        uid = ray.get(ranks[0].nccl_unique_id.remote()) if kind == "nccl" else None
        ends = ray.get([ranks[0].node_id.remote(), drafter.node_id.remote()])
        ip, port = ray.get(ranks[0].address.remote())
        if ends[0] == ends[1] and actors.rendezvous_dir is None:
            actors.rendezvous_dir = tempfile.mkdtemp(prefix="specray-pg-")
        address = pair_address(ends[0] == ends[1], ip, port, actors.rendezvous_dir)
        start_kwargs.update(channel_kind=kind, unique_id=uid, address=address)
        if share is not None:
            pending.append(drafter.connect.remote(share.index, kind, address, uid))
            start_kwargs.update(shared=True)
        else:
            pending.append(drafter.connect.remote(kind, address, uid))
            start_kwargs.update(drafter_handle=drafter, placement_group=actors.placement_group,
                                drafter_bundle=0 if beside else tp, drafter_gpus=0.5 if beside else 1)
    # NCCL communicators form collectively: both ends must be constructing.
    pending.append(ranks[0].start_engine.remote(**start_kwargs))
    ray.get(pending)
    actors.loops = [r.serve_follower.remote() for r in ranks[1:]]
    if separate:
        actors.loops.append(drafter.serve.remote() if share is None else drafter.serve_replica.remote(share.index))
