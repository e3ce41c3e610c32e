"""The Serve application's settings (``ServeArgs``: a Serve config's
``args``) and their resolution before any replica starts, so that a bad
setting fails the deploy instead of a replica constructor Serve retries."""

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ServeArgs(BaseModel):
    """``build_app`` arguments (the ``args`` of a Serve config)."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # None: the embedded default target (and drafter)
    drafter: str | None = None
    no_drafter: bool = False
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    backend: Literal["ray", "inprocess"] = "ray"
    tensor_parallel_size: int = Field(1, ge=1)
    drafter_placement: Literal["auto", "separate", "colocated", "separate_same_gpu"] = "auto"
    max_model_len: int | None = Field(None, ge=2)
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_block_size: int = Field(16, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    engine: dict[str, Any] = Field(default_factory=dict)  # further EngineConfig fields
    model_name: str | None = None  # served id; default: the target directory's name
    max_queued_requests: int = Field(64, ge=0)  # admitted beyond max_num_seqs
    retry_after_s: int = Field(1, ge=0)
    max_request_bytes: int = Field(32 << 20, ge=1024)  # larger bodies get a 413, gRPC RESOURCE_EXHAUSTED
    request_body_timeout_s: float = Field(30.0, gt=0)  # a body still arriving after this gets a 408
    api_key: str | None = None  # default: env SPECRAY_API_KEY
    num_replicas: int = Field(1, ge=1)
    replica_num_cpus: float = Field(1.0, ge=0)
    deployment_name: str = "SpecRay"
    # Faults (serve/health.py): a request's time limit unless it asks for
    # less (None: none), the step time past which the replica counts as
    # stuck, how long a rebuild after a lost rank may take before Serve
    # replaces the replica, and Serve's health-check period.
    request_timeout_s: float | None = Field(600.0, gt=0)
    stuck_step_s: float = Field(180.0, gt=0)
    rebuild_grace_s: float = Field(300.0, gt=0)
    health_check_period_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.backend == "inprocess" and self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs backend='ray'")
        return self

    @property
    def max_in_flight(self) -> int:
        return self.max_num_seqs + self.max_queued_requests

    def engine_config(self):
        from specray.config import EngineConfig

        kw = dict(self.engine)
        kw.update(target=self.target, drafter=None if self.no_drafter else self.drafter, device=self.device,
                  dtype=self.dtype, max_model_len=self.max_model_len, num_kv_blocks=self.num_kv_blocks,
                  kv_block_size=self.kv_block_size, max_num_seqs=self.max_num_seqs)
        return EngineConfig(**kw)


def _resolve(args: dict | ServeArgs | None) -> ServeArgs:
    if isinstance(args, ServeArgs):
        s = args
    else:
        try:
            s = ServeArgs.model_validate(dict(args or {}))
        except ValidationError as e:
            raise ValueError(f"specray.serve: invalid app args: {e}") from None
    if s.target is None:
        from specray.cli import resolve_models

        target, drafter = resolve_models(s)
        s = s.model_copy(update={"target": target, "drafter": drafter})
    if s.no_drafter:
        s = s.model_copy(update={"drafter": None})
    if s.model_name is None:
        s = s.model_copy(update={"model_name": os.path.basename(os.path.normpath(s.target))})
    if s.api_key is None and os.environ.get("SPECRAY_API_KEY"):
        s = s.model_copy(update={"api_key": os.environ["SPECRAY_API_KEY"]})
    try:  # fail here, not in a replica constructor that Serve would retry
        s.engine_config()
    except TypeError as e:
        raise ValueError(f"specray.serve: invalid engine settings: {e}") from None
    return s
