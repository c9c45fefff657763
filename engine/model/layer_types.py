"""DeepSeek-V4's attention layer types (transformers' config.layer_types values)."""

SLIDING = "sliding_attention"  # the sliding window only
CSA = "compressed_sparse_attention"  # window + the indexer's top-k of ratio-4 compressed entries
HCA = "heavily_compressed_attention"  # window + every ratio-128 compressed entry
