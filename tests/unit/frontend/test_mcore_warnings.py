"""megatron-core's "Transformer Engine and Apex are not installed" warnings: filtered at the front-end's import
(in every rank's process), said once in rank 0's start-up summary instead."""

from __future__ import annotations

import subprocess
import sys

from megatron.training import MCORE_NO_TE_APEX_WARNING
from megatron.training.mcore_model import mcore_fallback_note
from tests import ROOT


def test_front_end_import_filters_megatron_core_warnings():
    """Importing megatron-core after the front-end (as pretrain_gpt.py does) prints none of them, with Python's
    default warning filters; without the front-end first the same import prints them (the filter is needed)."""
    modules = "megatron.core.optimizer, megatron.core.distributed"
    with_front_end = subprocess.run([sys.executable, "-W", "default", "-c",
                                     f"import megatron.training.arguments, {modules}"],
                                    cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert with_front_end.returncode == 0, with_front_end.stderr[-3000:]
    assert MCORE_NO_TE_APEX_WARNING not in with_front_end.stderr, with_front_end.stderr[-3000:]
    alone = subprocess.run([sys.executable, "-W", "default", "-c", f"import {modules}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert MCORE_NO_TE_APEX_WARNING in alone.stderr, "megatron-core no longer warns: the filter can go"



def test_fallback_note_once_megatron_core_is_imported():
    """The summary's line (tests/functional/test_functional.py's main job checks it appears once)."""
    import megatron.core.optimizer  # noqa: F401  (what the front-end imports of megatron-core)

    note = mcore_fallback_note()
    assert note is not None and note.startswith("megatron-core: Transformer Engine and Apex are not installed"), note
