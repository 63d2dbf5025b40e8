"""Code that came with a checkpoint never runs unless the user asks by name.

transformers imports Python named by a model directory's `auto_map` when its caller passes
`trust_remote_code=True`, and LeRobot passes it for GR00T's VLM (backbone config, tokenizer,
processors). A downloaded checkpoint could name such a directory, so the exporter:
- resolves every model name a checkpoint gives against the checkpoint's own directory (or the
  Hugging Face cache), never against the current directory ([`resolve`]);
- refuses a directory it hands to transformers whose configs carry an `auto_map`, naming the
  file, the key and the flag ([`check_dir`]);
- and, as a backstop for any path it did not foresee, makes transformers' dynamic-module loader
  refuse for the whole command ([`guard`]).
`--trust-remote-code` lifts all three for one run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import ExportError, read_json

FLAG = "--trust-remote-code"


class RemoteCodeRefused(ExportError):
    """A load would have imported Python that came with a model: never swallowed by a fallback."""


class _State:
    allowed = False


def allowed() -> bool:
    """Whether this command may run a model's own code (`--trust-remote-code`)."""
    return _State.allowed


def resolve(name: str, ckpt_dir: Path) -> Path | None:
    """The directory a checkpoint names: an absolute path as it is, a relative one against the
    checkpoint's directory (never the current one); None when there is no such directory."""
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = ckpt_dir.absolute() / path
    return path if path.is_dir() else None


def _modules(value: Any) -> list[str]:
    """The Python files an `auto_map` value names (`module.Class`, `repo--module.Class`, or a
    list of them, as tokenizers give a slow and a fast class)."""
    if isinstance(value, str):
        module = value.split("--")[-1].rsplit(".", 1)[0]
        return [f"{module}.py"]
    if isinstance(value, list | tuple):
        return [m for v in value if v is not None for m in _modules(v)]
    if isinstance(value, dict):
        return [m for v in value.values() for m in _modules(v)]
    return []


def _auto_map(data: Any, depth: int = 0) -> Any:
    """The first `auto_map` in a config (top level or a nested sub-config), or None."""
    if not isinstance(data, dict) or depth > 3:
        return None
    if "auto_map" in data:
        return data["auto_map"]
    for v in data.values():
        found = _auto_map(v, depth + 1)
        if found is not None:
            return found
    return None


def check_dir(path: Path, what: str) -> None:
    """Refuses `path` (a model directory about to be handed to transformers as `what`) when
    one of its JSON configs has an `auto_map`, unless the run allows remote code."""
    if allowed():
        return
    for file in sorted(path.glob("*.json")):
        try:
            data = read_json(file, "a model config")
        except ExportError:
            continue  # not a config transformers would read either
        found = _auto_map(data)
        if found is None:
            continue
        named = ", ".join(sorted(set(_modules(found)))) or repr(found)
        raise RemoteCodeRefused(
            f"{file}: its `auto_map` names Python code ({named}) that transformers would import "
            f"and run while loading {what}; policyd-export never runs code that came with a "
            f"checkpoint. If {path} is a standard model, remove the `auto_map` key; if you "
            f"trust that code, pass {FLAG}"
        )


def _refuse(*args: Any, **kwargs: Any) -> Any:
    named = next((str(a) for a in args if isinstance(a, str | Path)), "a model")
    raise RemoteCodeRefused(
        f"transformers was about to import Python that came with a model ({named}); "
        f"policyd-export never runs code that came with a checkpoint: pass {FLAG} if you trust "
        "it"
    )


@contextlib.contextmanager
def guard(allow: bool) -> Iterator[None]:
    """For one command: remote code allowed or not (see the module's doc)."""
    _State.allowed = allow
    try:
        if allow:
            yield
            return
        try:
            import transformers.dynamic_module_utils as dmu
        except ImportError:  # no transformers: nothing can import a model's code
            yield
            return
        # Both are looked up as module globals by `get_class_from_dynamic_module` at each call,
        # so replacing them here reaches every Auto class that already imported the latter.
        saved = dmu.get_cached_module_file, dmu.get_class_in_module
        dmu.get_cached_module_file = _refuse
        dmu.get_class_in_module = _refuse
        try:
            yield
        finally:
            dmu.get_cached_module_file, dmu.get_class_in_module = saved
    finally:
        _State.allowed = False
