"""New drafters for rank 0 when its drafter is lost (``faults.FaultHandler``
calls these; the engine steps autoregressively meanwhile).

* ``RemoteDrafterRestart``: the drafter is its own Ray actor. The old actor
  is killed (it may be alive and stuck), a new one is created in the same
  placement-group bundle (owned by rank 0: it dies with rank 0), its cache
  allocated, its channel paired with rank 0 and its serve loop started.
* ``LocalDrafterRestart``: the drafter lives in rank 0's process (or the
  in-process engine's): a new worker on the same device.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("specray.drafter_restart")


class RemoteDrafterRestart:
    def __init__(self, handle, config, max_model_len: int, num_draft_blocks: int, channel_kind: str,
                 placement_group, bundle_index: int, device, address: str | None = None, gpus: float = 1):
        self.handle, self.config, self.max_model_len = handle, config, max_model_len
        self.num_draft_blocks, self.channel_kind = num_draft_blocks, channel_kind
        self.placement_group, self.bundle_index, self.device = placement_group, bundle_index, device
        self.gpus = gpus  # its share of a GPU: half of rank 0's where it runs beside it
        self.address = address  # the current pairing's rendezvous (a file store to remove)
        # New pairings' file stores go beside the first one's, in the directory
        # the engine's owner removes with its placement group.
        self.directory = os.path.dirname(address[len("file://"):]) if address and address.startswith("file://") \
            else None
        self.loop_ref = None
        self.created = []  # handles of the actors made here

    def __call__(self):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specray.actors.pair_channel import pair_address, remove_address
        from specray.actors.remote_drafter import RemoteDrafter, drafter_channel
        from specray.actors.workers import DrafterActor, free_address, node_id

        timeout = max(60.0, 4 * self.config.drafter_timeout_s)
        old, self.handle = self.handle, None
        if old is not None:
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass
        if self.address is not None:
            remove_address(self.address)
            self.address = None
        gpu = self.config.device != "cpu"
        new = ray.remote(DrafterActor).options(
            num_cpus=1, num_gpus=self.gpus if gpu else 0, max_concurrency=8,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                placement_group_bundle_index=self.bundle_index),
        ).remote(self.config, self.max_model_len)
        self.created.append(new)
        try:
            ray.get(new.init_cache.remote(self.num_draft_blocks), timeout=timeout)
            uid = None
            if self.channel_kind == "nccl":
                from specray.actors.transport import nccl_unique_id

                uid = nccl_unique_id()
            same = ray.get(new.node_id.remote(), timeout=timeout) == node_id()
            ip, port = free_address()
            self.address = pair_address(same, ip, port, self.directory)
            pending = new.connect.remote(self.channel_kind, self.address, uid)
            channel = drafter_channel(self.channel_kind, 0, self.device, self.address, uid,
                                      timeout_s=self.config.drafter_timeout_s)
            ray.get(pending, timeout=timeout)
            self.loop_ref = new.serve.remote()
        except BaseException:
            ray.kill(new, no_restart=True)
            raise
        self.handle = new
        log.warning("a new drafter actor is connected")
        return RemoteDrafter(channel, self.device)

    def close(self) -> None:
        """The engine stops: end the drafters made here (the first one is
        its owner's to end)."""
        import ray

        from specray.actors.pair_channel import remove_address

        for h in self.created:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        if self.address is not None:
            remove_address(self.address)


class LocalDrafterRestart:
    def __init__(self, make):
        self.make = make  # () -> a DrafterWorker with its cache allocated

    def __call__(self):
        return self.make()

    def close(self) -> None:
        pass


def local_drafter_restart(engine, graphs: bool | None = None) -> LocalDrafterRestart:
    """New drafters for an engine whose drafter runs in its process."""

    def make():
        from specray.actors.drafter import DrafterWorker

        c = engine.config
        w = DrafterWorker(engine.drafter_spec, engine.target_spec, device=str(engine.device), dtype=c.resolved_dtype,
                          max_model_len=engine.max_model_len, draft_top_k=c.draft_top_k)
        w.init_cache(engine.scheduler.draft_pool.num_blocks, c.kv_block_size)
        if c.cuda_graphs if graphs is None else graphs:
            w.enable_decode_graphs(c.max_num_seqs, c.kv_block_size, engine.block_size)
        return w

    return LocalDrafterRestart(make)
