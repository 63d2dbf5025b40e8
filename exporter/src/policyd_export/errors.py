"""One error type for the exporter: what went wrong and what the user should do about it."""


class ExportError(Exception):
    """A problem with the user's input (checkpoint, bundle, options). The CLI prints the message
    and exits with status 2; nothing is left half-written."""
