"""An import blocker for megatron-core: with this directory first on ``PYTHONPATH``, every interpreter started
(a test's subprocess and the ranks it spawns) fails ``import megatron.core`` with ImportError, as where
megatron-core is not installed.

megatron-core is an ordinary dependency of the front-end, installed in the test environment; the claim that
the library ``megatron_fsdp/`` needs only torch is proved in processes that carry this blocker
(tests/unit/test_without_megatron_core.py, tests/distributed/mcore/test_mcore_adapter.py), not by keeping
megatron-core out of the environment. ``megatron.training`` (this repository) still imports.
"""

from __future__ import annotations

import importlib.abc
import sys

BLOCKED = "megatron.core"


class MegatronCoreBlocker(importlib.abc.MetaPathFinder):
    """Raises ImportError for ``megatron.core`` and its submodules before any other finder can find them."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 (importlib's protocol)
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ImportError(f"No module named {fullname!r} (blocked by tests/no_megatron_core/sitecustomize.py)",
                              name=fullname)
        return None


def install() -> None:
    """Put the blocker first on ``sys.meta_path`` (once); megatron-core must not be imported already."""
    if any(name == BLOCKED or name.startswith(BLOCKED + ".") for name in sys.modules):
        raise RuntimeError("megatron.core is already imported: the blocker must be installed first")
    if not any(isinstance(f, MegatronCoreBlocker) for f in sys.meta_path):
        sys.meta_path.insert(0, MegatronCoreBlocker())


install()
