"""Old path of `xlstm_kit.generation` (the README's `xlstm_kit.generate.complete_texts`)."""
from .generation.generate import Completion, complete_texts, generate, generate_text  # noqa: F401
