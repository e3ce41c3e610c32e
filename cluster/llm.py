"""The offline API: ``LLM(target=..., drafter=...).generate(prompts, params)``."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from specray.config import ConfigError, DrafterSpec, EngineConfig, TargetSpec
from specray.detokenizer import load_tokenizer
from specray.engine import EngineCore
from specray.request import PromptsRefused, RequestOutput
from specray.sampling import SamplingParams


def resolve_max_model_len(config: EngineConfig, target: TargetSpec) -> int:
    limit = target.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(
            f"max_model_len {config.max_model_len} exceeds the target's max_position_embeddings {limit}"
        )
    return config.max_model_len


def size_kv_pools(config: EngineConfig, workers: list) -> int:
    """Blocks per pool when the workers share one device: the target pool and
    the drafter context pool cover the same positions, so they get the same
    number of blocks and split the memory by their per-block cost."""
    from specray.actors.target import kv_capacity

    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    n = kv_capacity(config, workers)
    if n < 2:
        per_block = sum(w.bytes_per_block(config.kv_block_size) for w in workers)
        raise MemoryError(
            f"~{n * per_block / 2**20:.0f} MiB left for KV caches holds {n} blocks of {per_block / 2**20:.2f} MiB; "
            "lower max_model_len or give the cache more memory"
        )
    return n


def build_engine(config: EngineConfig) -> EngineCore:
    """An in-process engine: target and drafter in this process, on
    ``config.device``."""
    from specray.actors.drafter import DrafterWorker
    from specray.actors.target import TargetWorker

    if str(config.device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r}, but this process sees no CUDA device "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
    target_spec = TargetSpec.from_dir(config.target)
    drafter_spec = DrafterSpec.from_dir(config.drafter) if config.drafter else None
    if drafter_spec is not None:
        drafter_spec.check_fits(target_spec)
    max_model_len = resolve_max_model_len(config, target_spec)
    dtype = config.resolved_dtype
    target = TargetWorker(
        target_spec,
        device=config.device,
        dtype=dtype,
        max_model_len=max_model_len,
        tap_layer_ids=drafter_spec.target_layer_ids if drafter_spec else (),
        block_size=drafter_spec.block_size if drafter_spec else 1,
    )
    drafter = None
    if drafter_spec is not None:
        drafter = DrafterWorker(
            drafter_spec,
            target_spec,
            device=config.device,
            dtype=dtype,
            max_model_len=max_model_len,
            draft_top_k=config.draft_top_k,
        )
    workers = [w for w in (target, drafter) if w is not None]
    num_blocks = size_kv_pools(config, workers)
    # The drafter's pool may be sized apart, as the Ray backend allows.
    num_draft_blocks = (config.num_draft_kv_blocks or num_blocks) if drafter else None
    target.init_cache(num_blocks, config.kv_block_size)
    if drafter is not None:
        drafter.init_cache(num_draft_blocks, config.kv_block_size)
    core = EngineCore(
        config,
        target_spec,
        drafter_spec,
        target,
        drafter,
        load_tokenizer(config.target),
        max_model_len,
        num_target_blocks=num_blocks,
        num_draft_blocks=num_draft_blocks,
    )
    if config.cuda_graphs:
        enable_decode_graphs(config, core.block_size, target, drafter, tree=core.tree is not None)
    return core


def enable_decode_graphs(config: EngineConfig, block_size: int, target, local_drafter, want_hidden: bool | None = None,
                         tree: bool = False):
    """Static decode buffers (and CUDA graphs on CUDA) for the target and a
    drafter living in the same process (``tree``: verify blocks may hold
    draft trees)."""
    want_hidden = local_drafter is not None if want_hidden is None else want_hidden
    target.enable_decode_graphs(block_size, config.max_num_seqs, config.kv_block_size, want_hidden=want_hidden,
                                tree=tree)
    target.enable_prefill_graphs(config.kv_block_size, config.max_num_batched_tokens, want_hidden=want_hidden)
    if local_drafter is not None:
        local_drafter.enable_decode_graphs(config.max_num_seqs, config.kv_block_size, block_size)


def _iterable(x) -> bool:
    # A 0-d array or tensor has __iter__ but cannot be iterated.
    return hasattr(x, "__iter__") and getattr(x, "ndim", None) != 0


def _is_token_id(x) -> bool:
    """An integer, numpy's and a 0-d integer tensor's too (a list of those
    is one prompt); not True / False."""
    if isinstance(x, (bool, str)) or getattr(x, "ndim", 0) != 0:
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


class LLM:
    """Batch generation with DFlash speculative decoding.

    ``drafter=None`` decodes autoregressively with the same engine: the
    baseline every benchmark compares against. ``backend="ray"`` runs the
    target as ``tensor_parallel_size`` Ray actors and the drafter as its own
    actor (``drafter_placement="separate"``) or inside target rank 0
    (``"colocated"``; ``"auto"`` picks, ``placement.resolve_placement``).
    ``shared_drafter``: a replica's place at a drafter actor serving several
    engines (``shared_drafter.start_shared_drafter(...).replica(i)``)."""

    def __init__(
        self,
        target: str,
        drafter: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        backend: str = "inprocess",
        tensor_parallel_size: int = 1,
        drafter_placement: str = "auto",
        shared_drafter=None,
        **kwargs,
    ):
        self.config = EngineConfig(
            target=str(target), drafter=str(drafter) if drafter else None, device=device, dtype=dtype, **kwargs
        )
        self.backend = backend
        self.engine: EngineCore | None = None
        self._core = None
        if shared_drafter is not None and backend != "ray":
            raise ConfigError("shared_drafter needs backend='ray'")
        if backend == "inprocess":
            if tensor_parallel_size != 1:
                raise ConfigError("tensor_parallel_size > 1 needs backend='ray'")
            from specray.actors.drafter_restart import local_drafter_restart
            from specray.faults import FaultHandler

            self.engine = build_engine(self.config)
            self._tokenizer = self.engine.tokenizer
            restart = local_drafter_restart(self.engine) if self.engine.drafter is not None else None
            self._faults = FaultHandler(self.engine, restart, restart_inline=True)
        elif backend == "ray":
            from specray.async_engine import make_core

            self._core = make_core(self.config, "ray", tensor_parallel_size, drafter_placement, shared_drafter)
            self._tokenizer = load_tokenizer(self.config.target)
        else:
            raise ConfigError(f"backend must be 'inprocess' or 'ray', got {backend!r}")

    @property
    def tokenizer(self):
        return self._tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        errors: str = "raise",
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is text or a list of token ids.
        Every prompt is validated before any runs. A request that fails
        alone raises, or with ``errors="return"`` comes back with
        ``finish_reason="error"`` and its ``error`` (the others ran)."""
        if errors not in ("raise", "return"):
            raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")
        if isinstance(prompts, (bytes, dict)) or not _iterable(prompts):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                             f"got {type(prompts).__name__}")
        # One prompt: text, or its ids as an array / tensor or a list of ints.
        if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1:
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and _is_token_id(prompts[0]):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif isinstance(params, (str, bytes, dict)) or not _iterable(params):
            # list() of a dict of settings would name its first key's type.
            raise ValueError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if self._core is not None:
            from specray.async_engine import generate_sync

            return generate_sync(self._core, prompts, params, errors)
        reqs, bad = [], []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                reqs.append(self.engine.make_request(p, sp))
            except ValueError as e:
                bad.append((i, str(e)))
        if bad:
            raise PromptsRefused(bad)
        for r in reqs:
            self.engine.admit(r)
        wanted = {r.request_id for r in reqs}
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(reqs):
                for out in self._faults.step():
                    if out.finished and out.request_id in wanted:
                        if out.finish_reason == "error" and errors == "raise":
                            raise RuntimeError(f"the engine failed a step of this generate call:\n{out.error}")
                        done[out.request_id] = out
        except BaseException:
            # Interrupted (Ctrl-C) or a failed step: this call's requests
            # must not stay in the engine, to be stepped by the next call.
            for r in reqs:
                if r.request_id not in done:
                    self.engine.abort_request(r.request_id)
            raise
        return [done[r.request_id] for r in reqs]

    def stats(self) -> dict:
        return self._core.stats() if self._core is not None else {}

    def shutdown(self) -> None:
        if self._core is not None:
            self._core.shutdown()
            self._core = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
