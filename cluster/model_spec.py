"""The checkpoints' model specs, read from their config.json: the target's
and the drafter's shapes, RoPE, tapped layers. Validated here, at the
edge, so that workers can trust what they are given (the engine's own
settings: config.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A checkpoint or setting that specray cannot use; the message says why."""


def read_config_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file} is missing: a checkpoint directory needs a config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_file} must hold a JSON object")
    return cfg


def _need(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: config.json lacks {key!r}")
    return cfg[key]


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @staticmethod
    def from_hf(cfg: dict, where: str) -> "RopeSpec":
        # transformers >= 5 writes rope_parameters; older files carry
        # rope_theta + rope_scaling.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ConfigError(f"{where}: rope type {kind!r} is not supported (default, linear, llama3)")
        return RopeSpec(
            theta=float(theta),
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class DecoderShape:
    """What a Qwen3/Llama-style decoder stack needs from config.json; the
    target and the drafter both have one."""

    path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec

    @staticmethod
    def fields_from(cfg: dict, path, where: str) -> dict:
        hidden = int(_need(cfg, "hidden_size", where))
        heads = int(_need(cfg, "num_attention_heads", where))
        return dict(
            path=str(path),
            vocab_size=int(_need(cfg, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(_need(cfg, "intermediate_size", where)),
            num_layers=int(_need(cfg, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeSpec.from_hf(cfg, where),
        )


@dataclass(frozen=True)
class TargetSpec(DecoderShape):
    """A Qwen3 or Llama dense causal LM, as its config.json describes it."""

    arch: str  # "qwen3" | "llama"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    layer_window: tuple[int | None, ...] = ()

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def check_tensor_parallel(self, tp: int) -> None:
        """What sharding the layers over ``tp`` ranks needs: checked before
        any actor starts, and by the model as it is built."""
        if self.num_heads % tp:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) is not divisible by tensor_parallel_size ({tp})")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ConfigError(f"num_key_value_heads ({self.num_kv_heads}) and tensor_parallel_size ({tp}) "
                              "must divide one another")
        if self.intermediate_size % tp:
            raise ConfigError(
                f"intermediate_size ({self.intermediate_size}) is not divisible by tensor_parallel_size ({tp})"
            )

    @staticmethod
    def from_dir(path: str | os.PathLike) -> "TargetSpec":
        cfg = read_config_json(path)
        where = f"target {str(path)!r}"
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        if "DFlashDraftModel" in archs:  # its model_type says qwen3, but it has no embeddings or head of its own
            raise ConfigError(f"{where} is a DFlash drafter, not a target: pass it as the drafter")
        if "Qwen3ForCausalLM" in archs or model_type == "qwen3":
            arch = "qwen3"
        elif "LlamaForCausalLM" in archs or model_type == "llama":
            arch = "llama"
        else:
            raise ConfigError(
                f"{where}: architecture {archs or model_type!r} is not supported "
                "(Qwen3ForCausalLM, LlamaForCausalLM)"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (silu)")
        shape = DecoderShape.fields_from(cfg, path, where)
        num_layers = shape["num_layers"]
        layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
        if cfg.get("use_sliding_window") is False:
            layer_types = ["full_attention"] * num_layers
        windows = tuple(
            int(cfg["sliding_window"]) if t == "sliding_attention" and cfg.get("sliding_window") else None
            for t in layer_types
        )
        return TargetSpec(
            **shape,
            arch=arch,
            layer_window=windows,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=_generation_eos(path) or _eos_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )


def _generation_eos(path) -> tuple[int, ...]:
    gen = Path(path) / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        return _eos_ids(json.loads(gen.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ()


@dataclass(frozen=True)
class DrafterSpec(DecoderShape):
    """A DFlash drafter in the DFlash authors' checkpoint format."""

    attention_bias: bool
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_causal: tuple[bool, ...]
    layer_window: tuple[int | None, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @staticmethod
    def from_dir(path: str | os.PathLike) -> "DrafterSpec":
        cfg = read_config_json(path)
        where = f"drafter {str(path)!r}"
        archs = cfg.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ConfigError(
                f"{where}: architectures is {archs!r}; a DFlash drafter declares "
                "['DFlashDraftModel']"
            )
        dcfg = cfg.get("dflash_config") or {}

        def value(name, default=None):
            return dcfg.get(name, cfg.get(name, default))

        shape = DecoderShape.fields_from(cfg, path, where)
        num_layers = shape["num_layers"]
        num_target_layers = int(_need(cfg, "num_target_layers", where))
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        mask = value("mask_token_id")
        if mask is None:
            raise ConfigError(f"{where}: config.json lacks dflash_config.mask_token_id")
        layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
        if len(layer_types) != num_layers:
            raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        forced_causal = cfg.get("is_causal")
        window = cfg.get("sliding_window")
        causal, windows = [], []
        for t in layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ConfigError(f"{where}: layer type {t!r} is not supported")
            sliding = t == "sliding_attention"
            # Same rule as the reference: sliding layers are causal unless
            # the config says otherwise.
            causal.append(sliding if forced_causal is None else bool(forced_causal))
            if sliding and not window:
                raise ConfigError(f"{where}: sliding_attention layers need sliding_window")
            windows.append(int(window) if sliding else None)
        softcap = value("final_logit_softcapping")
        return DrafterSpec(
            **shape,
            attention_bias=bool(cfg.get("attention_bias", False)),
            block_size=int(value("block_size", 16)),
            num_target_layers=num_target_layers,
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            layer_causal=tuple(causal),
            layer_window=tuple(windows),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def check_fits(self, target: TargetSpec) -> None:
        """The drafter reads the target's hidden states and shares its
        embedding and lm_head: shapes and ids must agree."""
        where = f"drafter {self.path!r} does not fit target {target.path!r}"
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"{where}: hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"{where}: vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"{where}: mask_token_id {self.mask_token_id} is outside the vocabulary")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad or not self.target_layer_ids:
            raise ConfigError(
                f"{where}: target_layer_ids {list(self.target_layer_ids)} must lie in "
                f"[0, {target.num_layers}) (the target has {target.num_layers} layers)"
            )
        if self.num_target_layers != target.num_layers:
            raise ConfigError(
                f"{where}: it was built for {self.num_target_layers} target layers, "
                f"the target has {target.num_layers}"
            )
        if self.block_size < 2:
            raise ConfigError(f"{where}: block_size must be >= 2, got {self.block_size}")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash authors' default: evenly spaced over layers 1 .. L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
