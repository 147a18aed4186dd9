"""Megatron-style training front-end: arguments, model providers, data, loop, checkpoints.

megatron-core warns "Transformer Engine and Apex are not installed" from several modules as it is imported, in
every rank's process; the front-end filters those warnings here, before anything imports megatron-core, and
says it once, on rank 0, in the start-up summary (``mcore_model.mcore_fallback_note``).
"""

import warnings

# The messages' starts as megatron-core 0.16.1 words them (optimizer/, optimizer/clip_grads.py, fsdp's
# mixed_precision.py: "Transformer Engine and Apex are not installed. Falling back to ..."; models/backends.py
# and gpt_layer_specs.py: "Apex is not installed. Falling back to Torch Norm").
MCORE_NO_TE_APEX_WARNING = "Transformer Engine and Apex are not installed"
MCORE_NO_APEX_WARNING = "Apex is not installed"
for _message in (MCORE_NO_TE_APEX_WARNING, MCORE_NO_APEX_WARNING):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning)
