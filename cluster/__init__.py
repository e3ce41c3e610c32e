"""specray: Ray-distributed LLM serving with DFlash block-diffusion
speculative decoding and a disaggregated drafter."""

from specray.config import ConfigError, EngineConfig
from specray.llm import LLM
from specray.request import RequestOutput
from specray.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "ConfigError"]
__version__ = "0.1.0"
