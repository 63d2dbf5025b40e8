"""One error type for the exporter: what went wrong and what the user should do about it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ExportError(Exception):
    """A problem with the user's input (checkpoint, bundle, options). The CLI prints the message
    and exits with status 2; nothing is left half-written."""


#: The largest JSON file the exporter reads (a config or statistics file is kilobytes).
MAX_JSON_BYTES = 64 << 20


def read_json(path: Path, what: str) -> Any:
    """A JSON file a checkpoint or bundle holds, every failure an ExportError naming it: missing,
    too large, not UTF-8, not JSON, or nested past Python's recursion limit."""
    import json

    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ExportError(f"{path}: {size} bytes; {what} is at most {MAX_JSON_BYTES} bytes")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path}: missing ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ExportError(f"{path}: nested too deeply to be {what}") from None
    except OSError as e:
        raise ExportError(f"{path}: cannot be read ({e})") from None
