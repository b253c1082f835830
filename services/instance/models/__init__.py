"""Model folders for the torch engine: tiny random Llamas for tests, and SmolLM2 from GGUF.

Both write a Hugging Face folder (`config.json`, `generation_config.json`,
`model.safetensors` in float32, `tokenizer.json`, `tokenizer_config.json`) that
`transformers` and ferry's engine load alike.
"""

from services.instance.models.smollm2 import import_smollm2
from services.instance.models.tiny import TINY_SHAPES, build_tiny_model

__all__ = ["TINY_SHAPES", "build_tiny_model", "import_smollm2"]
