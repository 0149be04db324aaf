"""The toolkit's error for bad user input: the CLI shows its message as one line and exits 2.

Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A problem with the user's input (config, data, paths, checkpoints), named in one line."""


class ConfigError(UserError):
    """A configuration problem; the message is one line naming the key and the offending value."""


def everywhere(err: Exception) -> Exception:
    """Mark `err` as raised alike on every rank, after a collective told them all: the CLI shows
    it on rank 0 only, so a job prints its error once."""
    err.everywhere = True  # type: ignore[attr-defined]
    return err
