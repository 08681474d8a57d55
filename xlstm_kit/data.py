"""Old path of `xlstm_kit.training.data` and `xlstm_kit.io.tokenizers` (the README's
`from xlstm_kit.data import load_data`)."""
from .errors import DataError  # noqa: F401
from .io.tokenizers import TOKENIZERS, get_tokenizer  # noqa: F401
from .training.data import TokenData, load_data  # noqa: F401
