"""torch.compile and activation checkpointing for training: can this machine compile, apply a
TrainConfig's choices to a model, and time the compilation (used by ``xlstm_kit.train``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .errors import XLSTMKitError

if TYPE_CHECKING:
    from .train import TrainConfig


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


def compile_failure(e: BaseException) -> XLSTMKitError:
    """The one-line error for a Dynamo or Inductor failure during a training step."""
    cause = getattr(e, "inner_exception", None) or e  # a backend's own error, when it raised one
    first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
    return XLSTMKitError(f"torch.compile failed: {type(cause).__name__}: {first}. Train without compile "
                         f"(leave out --compile, or TrainConfig(compile=False))")
