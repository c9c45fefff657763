"""Token selection on one Philox stream (greedy, sampled, rejection sampling): the dispatcher and its backends."""

from .dispatch import (BACKENDS, DRAW_DRAFT, DRAW_SAMPLE, LOGIT_DTYPES, MAX_VOCAB, backend_resolution, greedy_sample,
                       rejection_sample, reset_resolution_for_tests, resolve_backend, sample, sampling_scale)

__all__ = ["BACKENDS", "DRAW_DRAFT", "DRAW_SAMPLE", "LOGIT_DTYPES", "MAX_VOCAB", "backend_resolution", "greedy_sample",
           "rejection_sample", "reset_resolution_for_tests", "resolve_backend", "sample", "sampling_scale"]
