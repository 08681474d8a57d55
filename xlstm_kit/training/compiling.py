"""torch.compile and activation checkpointing for training: can this machine compile, apply a
TrainConfig's choices to a model, and time the compilation (used by ``xlstm_kit.training.loop``);
:class:`CompiledLoss`, a model's forward and loss compiled as one region, with CUDA graphs on
CUDA (used by the synthetic experiments, ``xlstm_kit.experiments.experiment``)."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from ..errors import XLSTMKitError
from .config import TrainConfig


@dataclass
class CompileEvent:
    """With ``TrainConfig.compile``: the time the first step of this run spent compiling,
    estimated as its wall time minus the second step's (the whole first step in a one-step run)."""

    step: int  # the step at which the estimate became known
    compile_s: float
    first_step_s: float
    step_s: float | None  # the second step's wall time (None in a one-step run)


def compile_unavailable(device: torch.device | str) -> str | None:
    """Why torch.compile (Inductor) cannot compile for ``device`` here, or None when it can:
    an unsupported Python, no C++ compiler (Inductor builds its CPU kernels with one; it looks
    for ``$CXX`` or g++), or no Triton for CUDA."""
    device = torch.device(device)
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except RuntimeError as e:
        return str(e)
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception:  # InvalidCxxCompiler, or a failing search
            return ("Inductor compiles CPU code with a C++ compiler and found none (install g++, or "
                    "point the CXX environment variable at one)")
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Inductor generates Triton kernels for CUDA and the 'triton' package does not import"
    return None


class SlowCompileWarning(UserWarning):
    """torch.compile for the CPU: minutes of compilation before the first step."""


CPU_COMPILE_NOTE = ("torch.compile on the CPU compiles for minutes before the first step (862 s for the tiny "
                    "preset on a 2-core machine), then each step is faster: worth it for long runs only")


def prepare_model(model: nn.Module, config: "TrainConfig", device: torch.device | str) -> None:
    """Apply ``config.activation_checkpointing`` and ``config.compile`` to ``model`` (in place;
    both stay set after training). XLSTMKitError when either cannot be done here."""
    if config.activation_checkpointing != "none":
        if not hasattr(model, "set_activation_checkpointing"):
            raise XLSTMKitError(f"activation_checkpointing={config.activation_checkpointing!r} needs a model with "
                                f"set_activation_checkpointing (XLSTMLanguageModel); {type(model).__name__} has none")
        model.set_activation_checkpointing(config.activation_checkpointing)
    if config.compile:
        reason = compile_unavailable(device)
        if reason is not None:
            raise XLSTMKitError(f"cannot torch.compile the model: {reason}. Train without compile "
                                f"(leave out --compile, or TrainConfig(compile=False))")
        if torch.device(device).type == "cpu":
            warnings.warn(CPU_COMPILE_NOTE, SlowCompileWarning, stacklevel=4)
        if hasattr(model, "compile_blocks"):
            if not model.is_compiled:  # a second train() call keeps the graphs it has
                model.compile_blocks()
        else:
            model.compile()


class CompileClock:
    """Times the first two steps of a compiled run: the first one's extra time is compilation."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.times: list[float] = []

    def event(self, step: int, dt: float, last: bool) -> "CompileEvent | None":
        if not self.enabled or len(self.times) >= 2:
            return None
        self.times.append(dt)
        if len(self.times) == 2:
            first, then = self.times
            return CompileEvent(step, max(0.0, first - then), first, then)
        if last:
            return CompileEvent(step, dt, dt, None)
        return None


TRAIN_WITHOUT_COMPILE = "Train without compile (leave out --compile, or TrainConfig(compile=False))"


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "inner_exception", None) or e  # a backend's own error, when it raised one
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {first}"


def compile_failure(e: BaseException, hint: str = TRAIN_WITHOUT_COMPILE) -> XLSTMKitError:
    """The one-line error for a Dynamo or Inductor failure during a training step."""
    return XLSTMKitError(f"torch.compile failed: {_first_line(e)}. {hint}")


TRAINING_COMPILE_TRIES: dict[str, tuple[dict[str, Any], ...]] = {
    "cuda": ({"mode": "reduce-overhead"}, {}),
}
"""torch.compile options :class:`CompiledLoss` tries in order, per device type (others: Inductor
alone). On CUDA first Inductor with CUDA graphs (cudagraph trees: the forward and the backward
each replay as one graph, where a small model's eager step launches hundreds of kernels and
waits on the host), then Inductor alone."""


def training_compile_tries(device: torch.device | str) -> tuple[dict[str, Any], ...]:
    return TRAINING_COMPILE_TRIES.get(torch.device(device).type, ({},))


class _ForwardLoss(nn.Module):
    # The region that is compiled: the model is a submodule, so its own state_dict keeps its
    # keys (no "_orig_mod." prefix) and its plain forward stays eager for evaluation.
    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, pair: tuple[torch.Tensor, Any]) -> torch.Tensor:
        inputs, target = pair
        return self.loss_fn(self.model(inputs), target)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg not in self.messages:
            self.messages.append(msg)


def _cudagraph_log() -> logging.Logger | None:
    # where Inductor says why it runs a graph without CUDA graphs (it does not raise)
    try:
        from torch._inductor import cudagraph_utils
    except ImportError:
        return None
    return getattr(cudagraph_utils, "cudagraphs_log", None)


R = TypeVar("R")


class CompiledLoss:
    """``loss_fn(model(inputs), target)`` as one torch.compile'd module for training: Dynamo
    traces forward and loss together, AOTAutograd compiles the backward with them, and on CUDA
    both run as CUDA graphs where Inductor can record them (it leaves a graph out by itself when
    it cannot). The optimizer, clipping and learning rate stay outside (``train.train_step``):
    nothing per-step is baked into a graph. Inputs must keep one shape (``dynamic=False``).

    ``run(step)`` calls ``step(self.module)`` (``module((inputs, target))`` gives the loss).
    Should one of the first ``SETTLE_CALLS`` steps fail (compilation, graph recording), the step
    is undone with ``undo()`` and retried with the next options of ``training_compile_tries``
    (noted in ``fallbacks``); when none is left the failure is an XLSTMKitError. Later, a Dynamo
    failure (a recompilation) becomes an XLSTMKitError and other errors pass as they are.

    Dynamo's caches are process-wide and hold one entry per model it has seen: the constructor
    and ``close()`` clear them (``torch._dynamo.reset``), so that a process that trains one
    model after another (a sweep's worker) never reaches Dynamo's recompile limit, past which
    it would silently run eagerly. Other compiled functions of the process are cleared too.
    ``cudagraph_skips``: Inductor's reasons for graphs it ran without CUDA graphs (it skips
    them silently, e.g. for a CPU tensor in the graph), collected until ``close()``."""

    SETTLE_CALLS = 3
    """CUDA graph trees record at a graph's second call: failures show up by the second step."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
                 device: torch.device | str, *, hint: str = TRAIN_WITHOUT_COMPILE) -> None:
        reason = compile_unavailable(device)
        if reason is not None:
            raise XLSTMKitError(f"cannot torch.compile the model: {reason}. {hint}")
        self.hint = hint
        self.region = _ForwardLoss(model, loss_fn)
        self.tries = list(training_compile_tries(device))
        self.fallbacks: list[str] = []
        self.calls = 0
        self._skips, self._log = _Messages(), _cudagraph_log()
        if self._log is not None:
            self._log.addHandler(self._skips)
        self._next()

    def _next(self) -> None:
        torch._dynamo.reset()
        self.options = self.tries.pop(0)
        self.module = torch.compile(self.region, dynamic=False, **self.options)

    @property
    def description(self) -> str:
        """The options in use, e.g. "inductor, mode=reduce-overhead"."""
        opts = dict(self.options)
        backend = opts.pop("backend", "inductor")
        return ", ".join([backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")]
                         + [f"{k}={v}" for k, v in sorted(opts.items())])

    def run(self, step: Callable[[nn.Module], R], undo: Callable[[], None] = lambda: None) -> R:
        while True:
            if self.options.get("mode") == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are free
            try:
                out = step(self.module)
            except XLSTMKitError:
                raise
            except Exception as e:
                if self.calls >= self.SETTLE_CALLS:
                    if isinstance(e, torch._dynamo.exc.TorchDynamoException):
                        raise compile_failure(e, self.hint) from e
                    raise
                self.fallbacks.append(f"{self.description}: {_first_line(e)}")
                if not self.tries:
                    tried = "; ".join(self.fallbacks)
                    raise XLSTMKitError(f"torch.compile failed ({tried}). {self.hint}") from e
                undo()
                self._next()
                continue
            self.calls += 1
            return out

    @property
    def cudagraph_skips(self) -> list[str]:
        return list(self._skips.messages)

    def summary(self) -> dict[str, Any]:
        """What a run records: the options that trained, the ones given up, CUDA graph skips."""
        return {"options": self.description, "fallbacks": list(self.fallbacks), "cudagraph_skips": self.cudagraph_skips}

    def close(self) -> None:
        """Clear Dynamo's caches (and CUDA graph trees' memory pool) of this run."""
        if self._log is not None:
            self._log.removeHandler(self._skips)
        torch._dynamo.reset()
