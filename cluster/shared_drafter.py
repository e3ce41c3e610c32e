"""One drafter actor for several target replicas (N:1).

    shared = start_shared_drafter(config, num_replicas=2)
    a = LLM(..., backend="ray", shared_drafter=shared.replica(0))
    b = LLM(..., backend="ray", shared_drafter=shared.replica(1))
    ...
    a.shutdown(); b.shutdown(); shared.shutdown()

The drafter runs in a placement group of its own (one GPU, or one CPU
process), so it outlives any one replica's group: a replica rebuilt after a
lost target rank pairs with it again under the same index. Each replica's
engine is started as with ``drafter_placement="separate"``, its rank 0
pairing with the shared actor instead of a drafter of its own
(``actors/shared_drafter.py`` holds the drafter's side).

How many replicas one drafter serves: ``replicas_per_drafter``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

from specray.config import ConfigError, EngineConfig, TargetSpec


def replicas_per_drafter(propose_ms: float, verify_ms: float) -> int:
    """Target replicas one drafter can serve, from one replica's measured
    propose and verify times a step (on the deployment's hardware;
    ``bench/step_phases.py`` times the propose phase). A replica waits for its drafts, then verifies; while it
    verifies, the drafter can serve the others. With ``N`` replicas in turn
    none waits on a busy drafter while ``(N - 1) * propose <= verify``, so
    ``1 + verify / propose`` replicas would keep the drafter busy all the
    time; this leaves one propose of slack for jitter and host work:
    ``floor(verify / propose)``, at least 1. (Batching proposals of
    replicas that arrive together makes a merged propose cheaper than its
    parts, which only adds slack.)"""
    if not (propose_ms > 0 and verify_ms >= 0) or math.isinf(propose_ms) or math.isinf(verify_ms):
        raise ValueError(f"need propose_ms > 0 and verify_ms >= 0, got {propose_ms}, {verify_ms}")
    return max(1, math.floor(verify_ms / propose_ms))


# What the drafter's side was built with and each replica must agree on.
_SHARED_FIELDS = ("drafter", "device", "kv_block_size", "draft_top_k", "num_speculative_tokens", "resolved_dtype",
                  "cuda_graphs", "draft_tree")


def check_compatible(shared: EngineConfig, replica: EngineConfig) -> None:
    """A replica's config against the shared drafter's: the drafter, its
    pool's block size and how it drafts must be the same."""
    bad = [f for f in _SHARED_FIELDS if getattr(shared, f, None) != getattr(replica, f, None)]
    if TargetSpec.from_dir(shared.target).hidden_size != TargetSpec.from_dir(replica.target).hidden_size:
        bad.append("target")
    if bad:
        raise ConfigError(f"this replica's config differs from its shared drafter's in {', '.join(bad)}")


@dataclass
class SharedDrafter:
    """Handles of a running shared drafter."""

    actor: object
    placement_group: object
    config: EngineConfig
    num_replicas: int
    max_model_len: int
    blocks_per_replica: int
    release: weakref.finalize | None = field(default=None, repr=False)

    def replica(self, index: int) -> DrafterShare:
        if not 0 <= index < self.num_replicas:
            raise ConfigError(f"replica index must be in [0, {self.num_replicas}), got {index}")
        return DrafterShare(self, index)

    def stats(self, timeout_s: float = 30.0) -> dict:
        """Proposals served per replica, proposes run, proposals merged."""
        import ray

        return ray.get(self.actor.stats.remote(), timeout=timeout_s)

    def shutdown(self) -> None:
        """Shut the replicas down first: their rank 0s would find the pair
        closed and step on without a drafter."""
        import ray

        try:
            ray.kill(self.actor)
        except Exception:
            pass
        if self.release is not None:
            self.release()


@dataclass(frozen=True)
class DrafterShare:
    """A replica's place at a shared drafter (its pool partition)."""

    drafter: SharedDrafter
    index: int


def start_shared_drafter(config: EngineConfig, num_replicas: int, gather_ms: float = 0.0,
                         ready_timeout_s: float = 120.0) -> SharedDrafter:
    """A drafter actor for ``num_replicas`` replicas of ``config``'s target.
    Each replica gets ``config.num_draft_kv_blocks`` context blocks, or an
    equal share of what fits on the drafter's device (capped at
    ``config.num_kv_blocks`` when set: a replica's context never needs more
    blocks than its target pool). ``gather_ms``: how long a propose may
    wait for the other replicas' to run with them as one batch
    (``actors/shared_drafter.py: ProposeBatcher``; 0: only what queued while
    the drafter was busy)."""
    if not 0 <= gather_ms < 1000:
        raise ConfigError(f"gather_ms must be in [0, 1000), got {gather_ms}")
    from specray.actors.shared_drafter import SharedDrafterActor
    from specray.config import DrafterSpec
    from specray.llm import resolve_max_model_len
    from specray.placement import ensure_ray, release_group

    if not config.drafter:
        raise ConfigError("a shared drafter needs config.drafter")
    n = int(num_replicas)
    if n < 1:
        raise ConfigError(f"num_replicas must be >= 1, got {num_replicas}")
    target_spec = TargetSpec.from_dir(config.target)
    DrafterSpec.from_dir(config.drafter).check_fits(target_spec)
    max_model_len = resolve_max_model_len(config, target_spec)
    ray = ensure_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = config.device != "cpu"
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    pg = placement_group([bundle])
    try:
        ray.get(pg.ready(), timeout=ready_timeout_s)
    except Exception:
        ray.util.remove_placement_group(pg)
        raise ConfigError(f"the Ray cluster could not place the shared drafter's bundle {bundle} "
                          f"within {ready_timeout_s:.0f} s") from None
    actor = None
    try:
        # A thread per replica's loop, and room for set-up calls beside them.
        actor = ray.remote(SharedDrafterActor).options(
            num_cpus=1, num_gpus=1 if gpu else 0, max_concurrency=2 * n + 4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(config, max_model_len, n, gather_ms / 1000)
        per = config.num_draft_kv_blocks
        if per is None:
            per = ray.get(actor.kv_capacity.remote()) // n
            if config.num_kv_blocks is not None:
                per = min(per, config.num_kv_blocks)
        if per < 2:
            raise ConfigError(f"no memory left for {n} replicas' drafter context KV ({per} blocks each)")
        ray.get(actor.init_cache.remote(per))
    except BaseException:
        if actor is not None:
            ray.kill(actor)
        ray.util.remove_placement_group(pg)
        raise
    shared = SharedDrafter(actor, pg, config, n, max_model_len, per)
    shared.release = weakref.finalize(shared, release_group, pg)
    return shared
