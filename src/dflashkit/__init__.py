"""dflashkit: DFlash block-diffusion speculative decoding for Hugging Face targets."""

from .config import DFlashConfig, default_target_layer_ids
from .drafter import DFlashDrafter
from .engine import DFlashEngine, Generation, StepOutput
from .errors import DFlashError
from .sampling import SamplingParams
from .stats import GenerationStats
from .target import Target

__all__ = ["DFlashConfig", "DFlashDrafter", "DFlashEngine", "DFlashError", "Generation", "GenerationStats",
           "SamplingParams", "StepOutput", "Target", "default_target_layer_ids"]
__version__ = "0.1.0"
