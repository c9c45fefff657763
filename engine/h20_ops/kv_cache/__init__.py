"""The fp8 KV cache formats (DeepSeek-V4 MODEL1, DeepSeek-V3.2), their torch reference and Triton kernels."""

from .fp8 import (FP8_MAX, LAYOUTS, MODEL1, V32, Fp8KvLayout, block_bytes, dequantize_from_cache_ref, gather_dequant,
                  layout_of, new_fp8_kv_cache, pow2, quantize_into_cache, quantize_into_cache_ref, scale_exponents)

__all__ = ["FP8_MAX", "LAYOUTS", "MODEL1", "V32", "Fp8KvLayout", "block_bytes", "dequantize_from_cache_ref",
           "gather_dequant", "layout_of", "new_fp8_kv_cache", "pow2", "quantize_into_cache", "quantize_into_cache_ref",
           "scale_exponents"]
