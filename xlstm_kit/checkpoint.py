"""Old path of `xlstm_kit.io.checkpoint` (model format, training state, run folders, `atomic_write`)."""
from .io.checkpoint import *  # noqa: F401,F403
