"""``mypyc_attr`` for modules of the optional compiled build, without a runtime dependency on
mypy_extensions: mypy and mypyc see the real decorator, a running kvroute a no-op.

A class that code outside the compiled modules subclasses needs
``@mypyc_attr(allow_interpreted_subclasses=True)`` (kvroute/buildinfo.py). Such a subclass must
not override the base class's attributes with class-level values: compiled code reads the base's
own slot and would not see them (set them in ``__init__`` instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr
else:
    def mypyc_attr(*_names: Any, **_attrs: Any) -> Any:
        """The decorator mypyc reads at compile time; nothing at run time."""
        return lambda cls: cls
