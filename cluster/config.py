"""Typed configs: the engine's own settings, validated here, at the edge,
so that workers can trust what they are given; the target and drafter
model specs (read from config.json) live in model_spec.py and are named
here too."""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass, field, fields

from specray.model_spec import (  # noqa: F401  (their long-standing home: specray.config)
    ConfigError,
    DecoderShape,
    DrafterSpec,
    RopeSpec,
    TargetSpec,
    default_target_layer_ids,
    read_config_json,
)


DTYPES = ("float32", "bfloat16", "float16")


_SETTING_TYPES = {"int": (numbers.Integral,), "int | None": (numbers.Integral, type(None)), "float": (numbers.Real,),
                  "bool": (bool,), "bool | None": (bool, type(None)),
                  "str": (str, os.PathLike), "str | None": (str, os.PathLike, type(None))}


@dataclass
class EngineConfig:
    """What an engine runs and how much it may hold."""

    target: str
    drafter: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    max_model_len: int | None = None  # None: the target's max_position_embeddings
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    num_draft_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Rejection sampling keeps the draft distribution restricted to its top
    # draft_top_k tokens: exact for any q, and cheap to ship to the target.
    draft_top_k: int = 64
    num_speculative_tokens: int | None = None  # None: block_size - 1
    # Prompt-lookup drafts (prompt_lookup.py): a request whose last
    # prompt_lookup_min..max tokens occurred before drafts what followed
    # them instead of the drafter's tokens. 0 turns it off. None: 1 when
    # lookups must agree with the drafter's first token (that check makes a
    # one-token match worth trying: H200, dev set, T=0, batch 1, acceptance
    # 2.495 -> 2.518, three passes 1.97-2.02x -> 2.01-2.03x; eval 2.499 ->
    # 2.501), 2 when a lookup replaces the drafter (a lone repeated token
    # is too weak a cue there: dev 2.410 -> 2.205 on the CPU).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int = 4
    # Lookups for sampled requests too: exact, but at T=1 they lowered mean
    # acceptance on the eval set (1.753 -> 1.730, CPU): a one-hot draft is
    # accepted with the target's probability of it, a sampled one more often.
    prompt_lookup_sampled: bool = False
    # A greedy row takes its lookup draft only where it opens with the
    # drafter's first draft token; the drafter then runs every step (no
    # step is left to lookups alone). It suits async_scheduling, whose step
    # graphs run the drafter every step anyway: on the H200 (eval / dev,
    # T=0, batch 1) acceptance 2.445 / 2.468 -> 2.498 / 2.494 and 1.94x /
    # 1.96x -> 1.98x / 1.98x. None: on with async_scheduling, off without
    # (synchronous steps skip the drafter where every row has a lookup).
    prompt_lookup_agree: bool | None = None
    # Draft trees (draft_tree.py): a row (greedy or sampled) verifies the
    # B - 1 likeliest paths through the drafter's top tokens instead of one
    # chain, in the same block (CPU, eval set, T=0: acceptance 2.31 -> 3.00
    # by replay); a sampled row walks its tree with the target's samples.
    # Such steps take no prompt lookups. Needs the target and the drafter in
    # one process and no sliding-window layers. None: on where possible.
    draft_tree: bool | None = None
    seed: int = 0
    # Time each asynchronous step's replay on the device (two CUDA events a
    # step): the engine stats then give the GPU time of those steps beside
    # their wall time, whose difference is the control the host adds.
    profile_steps: bool = False
    # Synchronize the device around model passes so that StepStats splits a
    # step into model time and control overhead (costs a little speed).
    sync_timing: bool = False
    # Replay decode steps (verify block, batched propose) and lone prompt
    # chunks from CUDA graphs captured per padded size (TP 1). None: on for
    # a CUDA device (eager launches cost the host more than the GPU's work:
    # 6x fewer tokens/s at batch 1 on the H200). Off CUDA, True runs the
    # same padded static-shaped path eagerly, which is how CPU tests cover it.
    cuda_graphs: bool | None = None
    # Launch a decode-only step as one graph from the previous step's
    # results on the device, before the host reads them (async_decode.py,
    # step_graph.py): the same tokens as synchronous steps, greedy or
    # sampled, prompt lookups included. Needs cuda_graphs, a target at TP 1
    # and the drafter in its process. Off CUDA it runs the same path
    # synchronously, which is how CPU tests cover it. None: on with CUDA
    # graphs on a GPU (a placement that cannot run it says so at start-up:
    # EngineCore.features).
    async_scheduling: bool | None = None
    # Step graphs whose drafter half a drafter in another process replays
    # (placements "separate", "separate_same_gpu", a shared drafter), on a
    # GPU. None: on where the GPU tests run them (a drafter on rank 0's GPU,
    # through the CUDA IPC ring: the in-process engine's greedy tokens and
    # seeded samples), off for a drafter on another GPU (NCCL: not yet run
    # on GPUs), whose engine runs synchronous steps and says so. True: on
    # (the multi-GPU runs); False: off. CPUs always run them.
    remote_step_graphs: bool | None = None
    # Micro-batch overlap of asynchronous steps: a batch of at least
    # overlap_min_batch requests runs as two lanes, each a chain of step
    # graphs on a CUDA stream of its own, so the GPU runs one lane's drafter
    # under the other's target (target and drafter in one process). None:
    # off (see EngineCore._overlap_unsupported); True on CPU runs the lanes
    # in turn, to test them.
    overlap: bool | None = None
    overlap_min_batch: int = 16
    # Up to this many prompts admitted together (while decoding rows wait:
    # EngineCore._shape_admission) are prefilled one a step, each through a
    # captured prefill graph, rather than in one eager step of several
    # prompts (on the H200 an eager prompt forward cost ~12 ms of host for
    # ~1 ms of GPU). 0: off. GPUs only: off CUDA the graphs' padding is
    # only more compute.
    lone_prefills: int = 4
    # The first step of each sampling kind (greedy, sampled, filtered; its
    # speculative and autoregressive steps apart) captures that kind's whole-
    # step graph at every padded batch size at once, where the batch sizes
    # met later would each stall a step with a capture (tens of ms: on the
    # H200 under churn such captures were 0.7 of a 1.6 s point). Rank 0's
    # own graphs only (peers capture their halves as the sizes come).
    capture_all_batch_sizes: bool = True
    # A waiting request joins a running chain of asynchronous steps in a
    # finished row's place (or as a row more) instead of draining it: its
    # prompt is prefilled alone behind the step in flight, its row's state
    # written on the device (chain_admit.py); finished rows ride as padding
    # meanwhile. One lane.
    admit_into_chain: bool = True
    # When waiting requests join a running chain (join_wait.py): None waits,
    # finished rows riding meanwhile, for the batch that costs least given
    # a join cycle's measured extra cost (a join costs several steps' time
    # whatever it admits) and how often requests arrive (1, at once, under
    # light load); N waits until N may join together (1: at once). Either
    # waits join_wait_steps steps at most.
    join_batch: int | None = None
    join_wait_steps: int = 8
    # Load-adaptive speculation (spec_policy.py): each async step verifies
    # the drafter's block or runs autoregressively, whichever the measured
    # step times and acceptance say emits more tokens per second. None: on
    # where async steps run.
    adaptive_speculation: bool | None = None
    # The adaptive policy may also verify chains of the drafter's block
    # halved while it keeps this many rows (16 -> 8, 4, 2; the block size: off):
    # the later drafts are the ones rejected.
    shortest_verify_block: int = 2
    # While the policy keeps choosing autoregressive steps, run the
    # autoregressive engine's own step and rebuild the drafter's context
    # when speculation resumes (drafter_rest.py).
    drafter_rest: bool = True
    # A drafter in another process that does not answer a message within
    # this many seconds is taken for lost: steps go on without it and a new
    # one is started (faults.py).
    drafter_timeout_s: float = 30.0
    # Fail a step whose target logits hold NaN or infinity (its request is
    # then found and fails alone) rather than emit what their argmax is.
    # None: on for the CPU; on a GPU the check costs a sync a step.
    check_logits: bool | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        # Settings come from YAML, --engine-arg and JSON too: a wrong type
        # is named here, not as a tensor-shape error in a worker.
        for f in fields(self):
            kinds = _SETTING_TYPES.get(f.type)
            v = getattr(self, f.name)
            if kinds and (not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)):
                raise ConfigError(f"{f.name} must be {f.type.replace(' | None', ' (or unset)')}, got {v!r}")
            if isinstance(v, numbers.Number) and not isinstance(v, bool):  # numpy scalars -> Python numbers
                setattr(self, f.name, int(v) if isinstance(v, numbers.Integral) else float(v))
        # Anything else reached torch in a worker as a RuntimeError (a
        # traceback from the CLI, a failed replica from a batch job).
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("num_kv_blocks", "num_draft_kv_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 2:  # block 0 is reserved
                raise ConfigError(f"{name} must be at least 2 (or unset), got {getattr(self, name)}")
        for name in ("kv_block_size", "max_num_seqs", "max_num_batched_tokens", "draft_top_k", "overlap_min_batch",
                     "join_batch", "shortest_verify_block"):
            if getattr(self, name) is not None and int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lone_prefills", "join_wait_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not 0 < self.drafter_timeout_s < float("inf"):
            raise ConfigError(f"drafter_timeout_s must be a positive number of seconds, got {self.drafter_timeout_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.cuda_graphs is None:
            self.cuda_graphs = str(self.device).startswith("cuda")
        if self.async_scheduling is None:
            self.async_scheduling = bool(self.cuda_graphs) and str(self.device).startswith("cuda")
        if self.async_scheduling and not self.cuda_graphs:
            raise ConfigError("async_scheduling replays whole decode steps from graphs: it needs cuda_graphs")
        if self.prompt_lookup_agree is None:
            self.prompt_lookup_agree = self.async_scheduling
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = 1 if self.prompt_lookup_agree else 2
        if self.prompt_lookup_min < 0 or (self.prompt_lookup_min and self.prompt_lookup_max < self.prompt_lookup_min):
            raise ConfigError(f"prompt lookup needs 0 (off) or 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.num_speculative_tokens is not None and int(self.num_speculative_tokens) < 1:
            # A drafter that drafts nothing would still run every step: run without one instead.
            raise ConfigError(f"num_speculative_tokens must be at least 1 (or unset), got "
                              f"{self.num_speculative_tokens}; to decode without speculation, give no drafter")

    def draft_block_size(self, drafter_block_size: int) -> int:
        """Rows of a speculative step: the anchor and its drafts. A drafter
        trained on blocks of ``drafter_block_size`` drafts a shorter block
        when ``num_speculative_tokens`` asks for fewer."""
        if self.num_speculative_tokens is None:
            return drafter_block_size
        if self.num_speculative_tokens > drafter_block_size - 1:
            raise ConfigError(f"num_speculative_tokens {self.num_speculative_tokens} is more than the drafter drafts "
                              f"in one pass ({drafter_block_size - 1}: its block size is {drafter_block_size})")
        return int(self.num_speculative_tokens) + 1

    @property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
