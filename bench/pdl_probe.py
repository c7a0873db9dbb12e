"""Probe: does programmatic dependent launch (``fp8lab.numba_kernels.pdl``) hide the kernel boundary?

A decode-step-like chain in one CUDA graph: per layer, read-only kernels of the four FP8 GEMVs' weight sizes
(128-bit loads, grid-stride, ``4 or 8`` CTAs per SM) and, with ``tiny``, four one-CTA kernels between them (the
norms and the attention's place). Each link reads its predecessor's entry of ``chain`` and writes its own at its
very end, so a replay that left any entry wrong launched a link too early. Modes: 0, plain launches; 1, PDL with
``launch_dependents`` then ``wait`` at the top; 2, PDL with the first four loads before the wait (what the SIMT GEMV
does). Then eager launches on a stream: the host cost per launch of Numba's launch against ``pdl.launch``'s
``cuda.core`` path. Prints one line per variant: the median replay time and whether the chain was right.

    python bench/pdl_probe.py        # on a GPU of sm_90 or later; results in bench/RESULTS.md (fifth session)
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from numba import cuda, int32, uint32  # noqa: E402

import cuda.core as cuda_core  # noqa: E402
from fp8lab.numba_kernels import pdl  # noqa: E402
from fp8lab.numba_kernels.warp import load_u32x4  # noqa: E402

print("cuda.core", cuda_core.__version__, flush=True)
THREADS = 128


def make_read(mode):
    """mode 0: no griddepcontrol; 1: trigger + wait at the top; 2: trigger, first 4 loads, wait."""

    @cuda.jit
    def read(words, chain, i, out):
        if mode >= 1:
            pdl.launch_dependents()
        if mode == 1:
            pdl.wait_for_prior_grids()
        pieces = words.shape[0] // 4
        stride = cuda.gridDim.x * cuda.blockDim.x
        first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        acc = uint32(0)
        p0, p1, p2, p3 = first, first + stride, first + 2 * stride, first + 3 * stride
        a0 = b0 = c0 = d0 = uint32(0)
        if p3 < pieces:
            a0, _, _, _ = load_u32x4(words, uint32(4 * p0))
            b0, _, _, _ = load_u32x4(words, uint32(4 * p1))
            c0, _, _, _ = load_u32x4(words, uint32(4 * p2))
            d0, _, _, _ = load_u32x4(words, uint32(4 * p3))
        if mode == 2:
            pdl.wait_for_prior_grids()
        prev = chain[i]
        acc ^= a0 ^ b0 ^ c0 ^ d0
        for base in range(first + 4 * stride, pieces, stride * 4):
            for j in range(4):
                p = base + j * stride
                if p < pieces:
                    a, b, c, d = load_u32x4(words, uint32(4 * p))
                    acc ^= a ^ b ^ c ^ d
        if acc == uint32(0x9E3779B9):
            out[cuda.blockIdx.x] = acc
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            chain[i + 1] = prev + int32(1)

    return read


def make_tiny(mode):
    @cuda.jit
    def tiny(chain, i):
        if mode >= 1:
            pdl.launch_dependents()
            pdl.wait_for_prior_grids()
        prev = chain[i]
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            chain[i + 1] = prev + int32(1)

    return tiny


LAYERS = {
    "qwen3-8b": (36, [25.2e6, 16.8e6, 100.7e6, 50.3e6]),
    "qwen3-0.6b": (28, [4.2e6, 2.1e6, 6.3e6, 3.1e6]),
}


def build_sequence(shape, with_tiny):
    layers, sizes = LAYERS[shape]
    bufs = [[cuda.device_array(int(s) // 4, np.uint32) for s in sizes] for _ in range(layers)]
    seq = []
    for layer in bufs:
        qkv, o, gu, down = layer
        if with_tiny:
            seq += [None, qkv, None, None, o, None, gu, down]
        else:
            seq += [qkv, o, gu, down]
    return seq


def run_sequence(seq, mode, stream, chain, out, sms, per_sm):
    read, tiny = READ[mode], TINY[mode]
    for i, buf in enumerate(seq):
        if buf is None:
            args = (chain, i)
            grid = 1
            k = tiny
        else:
            args = (buf, chain, i, out)
            grid = min(sms * per_sm, -(-buf.shape[0] * 4 // (16 * THREADS)))
            k = read
        if mode == 0:
            k[grid, THREADS, stream](*args)
        else:
            pdl.launch(k, grid, THREADS, stream, *args)


READ = {m: make_read(m) for m in (0, 1, 2)}
TINY = {m: make_tiny(m) for m in (0, 1, 2)}


def main():
    from cuda.core import Device

    device = Device()
    device.set_current()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    out = cuda.device_array(sms * 16, np.uint32)
    stream = device.create_stream()
    for shape in ("qwen3-0.6b", "qwen3-8b"):
        for with_tiny in (False, True):
            seq = build_sequence(shape, with_tiny)
            chain = cuda.to_device(np.full(len(seq) + 1, -1, np.int32))
            for per_sm in (4, 8):
                for mode in (0, 1, 2):
                    builder = device.create_graph_builder()
                    builder.begin_building()
                    run_sequence(seq, mode, builder, chain, out, sms, per_sm)
                    graph = builder.end_building().complete()
                    # correctness: poison, replay once, check the chain
                    poison = np.full(len(seq) + 1, -1, np.int32)
                    poison[0] = 0
                    chain.copy_to_device(poison)
                    cuda.synchronize()
                    graph.launch(stream)
                    stream.sync()
                    got = chain.copy_to_host()
                    ok = bool(np.array_equal(got, np.arange(len(seq) + 1)))
                    samples = []
                    for _ in range(20):
                        t0 = time.perf_counter()
                        graph.launch(stream)
                        stream.sync()
                        samples.append((time.perf_counter() - t0) * 1e6)
                    med = statistics.median(samples)
                    total_mb = sum(b.shape[0] * 4 for b in seq if b is not None) / 1e6
                    print(f"{shape} tiny={with_tiny} per_sm={per_sm} mode={mode} kernels={len(seq)} "
                          f"step_us={med:.1f} min={min(samples):.1f} TB/s={total_mb / med:.2f} chain_ok={ok}",
                          flush=True)
            del seq
    # eager launches through pdl.launch on a Numba stream: correct, and the host cost per launch
    seq = build_sequence("qwen3-0.6b", True)
    chain = cuda.to_device(np.full(len(seq) + 1, -1, np.int32))
    nstream = cuda.stream()
    for mode in (0, 1):
        poison = np.full(len(seq) + 1, -1, np.int32)
        poison[0] = 0
        chain.copy_to_device(poison)
        cuda.synchronize()
        run_sequence(seq, mode, nstream, chain, out, sms, 4)
        nstream.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            run_sequence(seq, mode, nstream, chain, out, sms, 4)
        host = (time.perf_counter() - t0) / (3 * len(seq)) * 1e6
        nstream.synchronize()
        got = chain.copy_to_host()
        print(f"eager mode={mode} host_us_per_launch={host:.1f} chain_ok={np.array_equal(got, np.arange(len(seq) + 1))}",
              flush=True)


main()
