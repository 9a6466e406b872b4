"""Which trace file a scenario or ``--workload`` names, and its format: the bundled traces'
folder (``shared/data/traces`` beside the repository, or ``KVROUTE_TRACES``), paths relative to
it, and the kind detected from a file's first line. Errors are :class:`ScenarioError` lines
naming the file, the line and the formats allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvroute.errors import ConfigError
from kvroute.workload.traces import TraceError, check_trace_file

# bundled traces live in shared/ beside the repository; KVROUTE_TRACES overrides
DATA_DIR = Path(os.environ.get("KVROUTE_TRACES",
                               Path(__file__).resolve().parents[3].parent / "shared" / "data" / "traces"))
WORKLOAD_KINDS = ("chat", "tot", "mixed", "chat-poisson", "mooncake", "azure", "openai")


class ScenarioError(ConfigError):
    """An invalid scenario; the message names file:line, the key and what is allowed."""


def resolve_trace(path: str | None, kind: str) -> str:
    """The trace file to read: the bundled Mooncake/Azure trace when ``path`` is None, a path under the traces
    folder when it only exists there, else ``path`` as given."""
    if path is None:
        bundled = {"mooncake": DATA_DIR / "mooncake" / "conversation_trace.jsonl",
                   "azure": DATA_DIR / "azure-2023" / "AzureLLMInferenceTrace_code.csv"}.get(kind)
        if bundled is None:
            raise ScenarioError(f"workload.path is required for kind {kind!r}")
        return str(bundled)
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (DATA_DIR / path).exists():
        p = DATA_DIR / path
    return str(p)


TRACE_FORMATS = "Mooncake JSONL (timestamp, input_length, output_length, hash_ids), OpenAI-messages JSONL, Azure CSV"


def workload_flag(value: str) -> tuple[str, str | None]:
    """``--workload``: a kind, or a trace file whose kind is detected → ``(kind, path)``."""
    if value in WORKLOAD_KINDS:
        return value, None
    p = Path(value)
    if not p.exists() and not p.is_absolute() and (DATA_DIR / value).exists():
        p = DATA_DIR / value
    if not p.exists():
        raise ScenarioError(f"--workload {value!r}: not a workload kind nor an existing file; kinds: "
                            f"{', '.join(WORKLOAD_KINDS)}; or a trace file ({TRACE_FORMATS})")
    if p.suffix in (".yaml", ".yml"):
        raise ScenarioError(f"--workload {value!r}: a YAML file is a scenario, not a trace; run it as "
                            f"`kvroute simulate {value}`")
    return detect_trace_kind(str(p)), str(p)


def detect_trace_kind(path: str) -> str:
    """Trace kind from a file: .csv → azure; JSONL with hash_ids/input_length → mooncake;
    JSONL with messages → openai."""
    try:
        p = check_trace_file(path)
    except TraceError as exc:
        raise ScenarioError(str(exc)) from None
    if p.suffix == ".csv":
        return "azure"
    with p.open("rb") as raw:
        for lineno, data in enumerate(raw, 1):
            try:
                line = data.decode()
            except UnicodeDecodeError:
                raise ScenarioError(f"{path}:{lineno}: not UTF-8 text — is this a binary file? A trace is "
                                    f"one of: {TRACE_FORMATS}") from None
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ScenarioError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                if isinstance(obj, dict) and ("input_length" in obj or "hash_ids" in obj):
                    return "mooncake"
                if isinstance(obj, dict) and "messages" in obj:
                    return "openai"
                raise ScenarioError(f"{path}:{lineno}: not a Mooncake line (input_length, "
                                    "output_length, hash_ids) nor an OpenAI conversation (messages)")
    raise ScenarioError(f"{path}: empty trace")
