"""``python -m megatron_fsdp.checkpoint``: the checkpoint command line (``checkpoint.cli``)."""

import sys

from megatron_fsdp.checkpoint.cli import main

sys.exit(main())
