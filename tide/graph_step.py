"""A training step's forward and backward captured in one CUDA graph, as torchtitan 0.3's
``CUDAGraphWrapper`` captures it (its default, ``training.disable_cuda_graphs = False``): the first call
runs eagerly on a side stream (FSDP2's lazy init, TIDE's arenas and plans), the second captures the step
on that stream (``capture_error_mode="thread_local"``) and replays it, every later call replays it.
Inputs are copied into static buffers; the optimizer steps outside the graph, between replays, and
gradients are zeroed in place, never set to None, as torchtitan's trainer zeroes them with graphs on.

    step = GraphStep(model, loss_fn)
    for tokens, targets in data:
        loss = step(tokens, targets)   # eager, then captured + replayed, then replayed
        optim.step()
        step.zero_grad(optim)          # zero_grad(set_to_none=False)

The replays accumulate into the gradients that existed at the capture: they must stay the params'
``.grad``. A call that finds another ``.grad`` (``zero_grad(set_to_none=True)`` after the capture) raises
instead of replaying into gradients nobody reads.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class GraphStep:
    """Forward + backward of ``model`` under ``loss_fn(model(tokens), targets)``, captured once.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph`` once captured (None before).
        replays: replays so far.
        capture_s: host seconds the capture took.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.model, self.loss_fn = model, loss_fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replays = 0
        self.capture_s = 0.0
        self._calls = 0
        self._tokens = self._targets = self._loss = None
        self._grads: list = []
        self._stream = torch.cuda.Stream()

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This step's loss (a tensor the next replay overwrites: read it before then)."""
        self._calls += 1
        if self._calls == 1:
            current = torch.cuda.current_stream()
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                loss = self.loss_fn(self.model(tokens), targets)
                loss.backward()
            current.wait_stream(self._stream)
            return loss.detach()
        if self.graph is None:
            self._capture(tokens, targets)
        else:
            self._check_grads()
            self._tokens.copy_(tokens)
            self._targets.copy_(targets)
        self.graph.replay()
        self.replays += 1
        return self._loss

    @staticmethod
    def zero_grad(optim: torch.optim.Optimizer) -> None:
        """The optimizer's ``zero_grad``, in place: the captured step accumulates into these gradients."""
        optim.zero_grad(set_to_none=False)

    def _capture(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        import time

        start = time.perf_counter()
        self._tokens, self._targets = tokens.clone(), targets.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self._stream, capture_error_mode="thread_local"):
            loss = self.loss_fn(self.model(self._tokens), self._targets)
            loss.backward()
            self._loss = loss.detach()
        self._grads = [(p, p.grad) for p in self.model.parameters()]
        self.capture_s = time.perf_counter() - start

    def _check_grads(self) -> None:
        for p, g in self._grads:
            if p.grad is not g:
                raise RuntimeError("tide.GraphStep: a parameter's .grad is no longer the gradient the captured step "
                                   "writes (zero_grad(set_to_none=True) after the capture?); use GraphStep.zero_grad")
