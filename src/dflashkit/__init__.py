"""dflashkit: DFlash block-diffusion speculative decoding for Hugging Face targets."""

from .backends import TargetModel
from .backends.hf import HFTarget
from .config import DFlashConfig, default_target_layer_ids
from .decode_config import DecodeConfig
from .drafter import DFlashDrafter
from .engine import DFlashEngine, Generation, StepOutput
from .errors import DFlashError
from .lookup import LookupParams
from .sampling import SamplingParams
from .stats import GenerationStats

Target = HFTarget  # the Hugging Face backend under its earlier name

__all__ = ["DFlashConfig", "DFlashDrafter", "DFlashEngine", "DFlashError", "DecodeConfig", "Generation",
           "GenerationStats", "HFTarget", "LookupParams", "SamplingParams", "StepOutput", "Target", "TargetModel",
           "default_target_layer_ids"]
__version__ = "0.1.0"
