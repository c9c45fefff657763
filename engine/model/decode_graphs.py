"""CUDA graphs of the engine's decode step: one per DecodeKey, captured on its first step, replayed after.

What a graph holds: DeepseekV4Runtime.decode_step over a static input buffer (the step's metadata,
engine.model.decode_metadata): the embeddings, every layer (projections, norms, the window rows'
writes, the compressors and indexer on their state rows with their entries' writes, the attention
with its plans, the MoE) and the head, into a static logits tensor [padded batch, vocab]. A replay
takes the next step of the same key: its metadata copied into the buffer (the step's one
host-to-device copy; the token ids, where the step before chose them on the device, copied there from
the device), one graph launch. Outside the graphs: building the metadata (host), sampling,
the runner's bookkeeping, prefill, and the NextN steps (the verification journals the compressor
state for its rollback; the drafter): those run eagerly, through the same decode_step.

Capturing a key: a warm-up run of the step on a side stream (it compiles the Triton and TileLang
kernels and makes the cuBLAS handles; it also runs the step for real, and a step whose token closes
a window moves that compressor's overlap state, so every compressor state row is saved before it and
restored after; the rows it writes to the stores, the same values again, are rewritten by the
replay), then the capture, into one memory pool shared by all graphs of the runtime (one graph runs at
a time; a graph's intermediates may reuse another's, its buffer and logits stay its own). An error
during a capture is raised: there is no eager fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.decode_metadata import DecodeInputs, DecodeKey


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the step's metadata (DecodeInputs.host's layout) on the device
    logits: torch.Tensor  # [key.batch, vocab] fp32, written by each replay


class DecodeGraphs:
    """The CUDA graphs of one DeepseekV4Runtime's decode steps (runtime.graphs; runtime.decode uses them)."""

    def __init__(self, runtime):
        if runtime.device.type != "cuda":
            raise ValueError(f"runtime: CUDA graphs need a CUDA device, the runtime's stores are on {runtime.device}")
        self.runtime = runtime
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[DecodeKey, _Graph] = {}
        self.replays = 0

    @property
    def keys(self) -> list[DecodeKey]:
        """The keys captured so far, in capture order."""
        return list(self._graphs)

    def run(self, inputs: DecodeInputs, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits [inputs.key.batch, vocab] (the graph's static output: read it, or queue its copy,
        before the next step of the same key); device_ids: the step's token ids on the device (they replace
        the host's after the buffer's copy), or None."""
        graph = self._graphs.get(inputs.key)
        if graph is None:
            graph = self._graphs[inputs.key] = self._capture(inputs, device_ids)
        graph.buffer.copy_(inputs.host.pin_memory(), non_blocking=True)  # the host goes on to the launch
        if device_ids is not None:
            inputs.token_ids(graph.buffer).copy_(device_ids)
        graph.graph.replay()
        self.replays += 1
        return graph.logits

    def _capture(self, inputs: DecodeInputs, device_ids: torch.Tensor | None) -> _Graph:
        runtime = self.runtime
        device = runtime.device
        buffer = inputs.host.to(device)
        if device_ids is not None:  # the warm-up runs the step for real: with its tokens
            inputs.token_ids(buffer).copy_(device_ids)
        states = runtime.compressor_states
        saved = states.save() if states is not None else None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            runtime.decode_step(buffer, inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        if saved is not None:
            states.restore(saved)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits, _ = runtime.decode_step(buffer, inputs)
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture of the decode step {inputs.key} failed: {exc}") from exc
        return _Graph(graph, buffer, logits)
