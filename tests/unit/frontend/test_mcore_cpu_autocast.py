"""megatron-core's tensor-parallel linear under CPU autocast (``--bf16`` with plain DDP on CPU): its autograd
function's backward must run under the autocast state its forward saw (mcore_cpu_compat.CPUAutocastRewrap).

Without the rewrap the backward runs outside CPU autocast and multiplies the bf16 output gradient with the fp32
weight and input: a dtype error (why --bf16 DDP on CPU used to fall back to the project's own GPT). Compared with
torch's ``F.linear`` under the same autocast: the same bf16 matmuls, so bitwise equal gradients.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.training.mcore_cpu_compat import apply_cpu_compat, cuda_absent
from tests import ROOT


def _linear_grads(fn) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x, w, None)  # no bias: megatron-core adds it in fp32 after the matmul, F.linear inside it
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    return x.grad, w.grad


def _mcore_linear(x, w, b):
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    return LinearWithGradAccumulationAndAsyncCommunication.apply(x, w, b, False, False, False, None, 0, None)


@pytest.mark.skipif(not cuda_absent(), reason="the CPU compatibility layer applies only without CUDA")
def test_mcore_linear_backward_under_cpu_autocast():
    apply_cpu_compat()
    for got, want in zip(_linear_grads(_mcore_linear), _linear_grads(F.linear)):
        assert got is not None and torch.equal(got, want)


@pytest.mark.skipif(not cuda_absent(), reason="the CPU compatibility layer applies only without CUDA")
def test_without_the_rewrap_the_backward_fails():
    """The failure the rewrap fixes, in a fresh process where the compatibility layer is not applied."""
    script = (
        "import torch\n"
        "from tests.unit.frontend.test_mcore_cpu_autocast import _linear_grads, _mcore_linear\n"
        "try:\n"
        "    _linear_grads(_mcore_linear)\n"
        "except RuntimeError as e:\n"
        "    print('FAILED', e)\n"
        "else:\n"
        "    print('RAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FAILED" in out.stdout and "RAN" not in out.stdout, out.stdout[-2000:]
