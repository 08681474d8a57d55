"""The library's own error type.

Every error that xlstm_kit raises for bad input — a wrong shape or dtype, a corrupt checkpoint,
a missing file, an unusable option — is an `XLSTMKitError` (a `ValueError`, so existing
`except ValueError` code keeps working). The command line turns it into one line and exit
status 2; any other exception is a bug and keeps its traceback.
"""


class XLSTMKitError(ValueError):
    """Bad input to xlstm_kit, explained in one line."""


class MissingFileError(XLSTMKitError, FileNotFoundError):
    """A file or folder that a call needs does not exist. Also a FileNotFoundError, which these
    errors were before they were the library's, so `except FileNotFoundError` still catches them."""


class DataError(XLSTMKitError):
    """Bad data input (unknown corpus or tokenizer, missing path, empty or too small corpus)."""
