"""The DeepSeek-V4 model side of the engine: the embedded tiny checkpoint and the transformers oracle."""

from engine.model.tiny import (ByteTokenizer, default_checkpoint_dir, load_tokenizer, tiny_config,
                               write_tiny_checkpoint)

__all__ = ["ByteTokenizer", "default_checkpoint_dir", "load_tokenizer", "tiny_config", "write_tiny_checkpoint"]
