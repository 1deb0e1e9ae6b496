"""CUDA checks of the window's devices, transfers and memory (skipped without CUDA).

Run them on a GPU machine with ``examples/gpu_check.sh``. What they pin down:

* a CPU window serving CUDA params (``history_device="cpu"``) gives bit for bit the results
  of the same run on the CPU, also while the GPU is busy -- the device-to-host copies are
  asynchronous into page-locked memory, and reading them before they land would show;
* only O(n) crosses devices per step (every cross-device copy is counted);
* a CUDA window agrees with a CPU window (the float64 solve is the same algorithm; only the
  summation order of the passes differs);
* GPU memory: the window is ``history_depth`` parameter-sized buffers (bf16 halves the
  differences) and an in-place step allocates at most ~6 parameter-sized temporaries; a CPU
  window costs the GPU nothing but the step's own O(n) buffers.
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aadl_func as aa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")


def quadratic_problem(n: int, dtype: torch.dtype, seed: int = 0):
    """A diagonal quadratic: grad(x) = h * (x - target), so SGD is a linear contraction."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.rand(n, generator=generator, dtype=torch.float64).to(dtype) + 0.5
    target = torch.randn(n, generator=generator, dtype=torch.float64).to(dtype)
    x0 = torch.randn(n, generator=generator, dtype=torch.float64).to(dtype)
    return h, target, x0


def trajectory(
    device,
    history_device,
    n=50_000,
    steps=25,
    dtype=torch.float32,
    busy=False,
    history_dtype=None,
    layout=None,
    inplace=True,
):
    h, target, x0 = quadratic_problem(n, dtype)
    h, target = h.to(device), target.to(device)
    params = {"x": x0.to(device)}
    if layout is not None:
        params["conv"] = (
            torch.linspace(-1, 1, 2 * 8 * 6 * 6, dtype=dtype).reshape(2, 8, 6, 6).to(device)
        ).contiguous(memory_format=layout)
    opt = aa.anderson(
        aa.sgd(0.1),
        history_depth=6,
        relaxation=0.5,
        history_device=history_device,
        history_dtype=history_dtype,
    )
    state = opt.init(params)
    noise = torch.randn(64, 64, device=device)
    for _ in range(steps):
        grads = {"x": h * (params["x"] - target)}
        if "conv" in params:
            grads["conv"] = 0.1 * params["conv"]
        if busy:
            # Keep the stream busy so that an unsynchronised copy would be read too early.
            for _ in range(20):
                noise = torch.tanh(noise @ noise)
        params, state = opt.update(state, params, grads, inplace=inplace)
    return params, state


@pytest.mark.parametrize("inplace", [True, False])
def test_cpu_window_for_cuda_params_is_bitwise_the_cpu_run(inplace):
    expected, _ = trajectory("cpu", None, layout=torch.channels_last, inplace=inplace)
    got, state = trajectory(CUDA, "cpu", busy=True, layout=torch.channels_last, inplace=inplace)
    for key in expected:
        assert got[key].is_cuda
        assert got[key].stride() == expected[key].stride()
        assert torch.equal(got[key].cpu(), expected[key]), key
    assert int(state.num_mixed) > 0
    for leaf in optree.tree_leaves(state.residuals):
        assert leaf.device.type == "cpu"
    if inplace:
        assert all(a.is_pinned() for a in optree.tree_leaves(state.anchor))


@pytest.mark.parametrize(
    "dtype,history_dtype,rtol",
    [
        (torch.float64, None, 1e-10),
        (torch.float32, None, 1e-4),
        (torch.float32, torch.bfloat16, 1e-3),
    ],
)
def test_cuda_window_agrees_with_cpu_window(dtype, history_dtype, rtol):
    expected, cpu_state = trajectory(
        "cpu", None, dtype=dtype, history_dtype=history_dtype, steps=12
    )
    got, state = trajectory(CUDA, None, dtype=dtype, history_dtype=history_dtype, steps=12)
    assert state.gram.is_cuda and state.gram.dtype == torch.float64
    x, x_ref = got["x"].cpu().double(), expected["x"].double()
    assert (x - x_ref).norm() <= rtol * x_ref.norm()
    # The GPU's float64 Gram is the Gram of the slots it stores (computed here on the CPU).
    slots = torch.stack(
        [
            torch.cat([t.double().cpu().reshape(-1) for t in optree.tree_leaves(r)])
            for r in state.residuals
        ]
    )
    torch.testing.assert_close(state.gram.cpu(), slots @ slots.T, rtol=1e-12, atol=1e-12)
    assert int(state.num_mixed) == int(cpu_state.num_mixed) > 0


class CrossDeviceBytes(TorchDispatchMode):
    """Counts the bytes of every copy whose source and destination devices differ."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device != src.device:
                self.bytes += src.numel() * src.element_size()
        elif func is torch.ops.aten._to_copy.default:
            src = args[0]
            if out.device != src.device:
                self.bytes += src.numel() * src.element_size()
        return out


def test_only_o_n_crosses_devices_per_step():
    n, depth = 1 << 20, 10
    opt = aa.anderson(aa.sgd(0.01), history_depth=depth, history_device="cpu")
    params = torch.randn(n, device=CUDA)
    state = opt.init(params)
    for _ in range(depth + 2):
        params, state = opt.update(state, params, 0.01 * torch.randn(n, device=CUDA), inplace=True)
    grads = 0.01 * torch.randn(n, device=CUDA)
    with CrossDeviceBytes() as counter:
        params, state = opt.update(state, params, grads, inplace=True)
    torch.cuda.synchronize()
    # y to the window, the mix back: two parameter-sized copies plus O(depth) scalars.
    assert counter.bytes <= 2 * n * 4 + 4096, counter.bytes / (n * 4)
    assert counter.bytes >= 2 * n * 4  # the counter does see the two transfers


def test_cuda_window_memory_and_step_temporaries():
    n, depth = 1 << 22, 10
    param_bytes = n * 4
    torch.cuda.synchronize()
    params = torch.randn(n, device=CUDA)
    for history_dtype, ring_bytes in ((None, 4), (torch.bfloat16, 2)):
        opt = aa.anderson(aa.sgd(0.01), history_depth=depth, history_dtype=history_dtype)
        before = torch.cuda.memory_allocated()
        state = opt.init(params)
        window = torch.cuda.memory_allocated() - before
        # Anchor + ring, plus the Gram and a step counter (rounded up by the allocator).
        expected = param_bytes + (depth - 1) * n * ring_bytes
        assert expected <= window <= expected + 65536, window - expected
        for _ in range(depth + 2):
            params, state = opt.update(
                state, params, 0.01 * torch.randn(n, device=CUDA), inplace=True
            )
        grads = 0.01 * torch.randn(n, device=CUDA)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        params, state = opt.update(state, params, grads, inplace=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= 6 * param_bytes, peak / param_bytes
        del state, grads


def test_cpu_window_adds_only_step_buffers_to_gpu_memory():
    n, depth = 1 << 22, 10
    params = torch.randn(n, device=CUDA)
    opt = aa.anderson(aa.sgd(0.01), history_depth=depth, history_device="cpu")
    before = torch.cuda.memory_allocated()
    state = opt.init(params)
    # The window is on the host; the GPU holds the inner optimizer's step counter only.
    assert torch.cuda.memory_allocated() - before <= 65536
    for _ in range(depth + 2):
        params, state = opt.update(state, params, 0.01 * torch.randn(n, device=CUDA), inplace=True)
    grads = 0.01 * torch.randn(n, device=CUDA)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    params, state = opt.update(state, params, grads, inplace=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 3 * n * 4
