// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 as device functions that
// Numba kernels call through cuda.declare_device(..., link=this file).
// Checked: tests/numba_kernels/test_mma_helper.py (compiles to these instructions; its simulator twin
// matches fp8lab/simulators/mma.py bit for bit), and on a GPU through tests/numba_kernels/test_gemm_mma_kernel.py.
//
// One call is one warp-wide D = A @ B + C on a 16x16 A (row-major fragments), a 16x8 B
// (column-major fragments) and a 16x8 float32 C/D. Each lane passes its registers:
//   a0..a3  four 32-bit registers, each two 16-bit values (lower index in the low half),
//   b0..b1  two 32-bit registers, likewise,
//   c0..c3  four float32 accumulators,
// in the fragment layout of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point
// type"), which fp8lab/simulators/mma.py writes out as A_COORDS, B_COORDS and C_COORDS.
//
// Numba's calling convention for foreign device functions: the result goes through the first
// pointer argument and the int return value is a status (0 = success).
// Checked against: fp8lab.simulators.mma.mma_registers (the simulator twin in fp8lab/numba_kernels/mma.py) and,
// on a GPU, exactly on integer-valued fragments (tests/test_mma_helper.py).

struct F4 {
    float x, y, z, w;
};

extern "C" __device__ int mma_m16n8k16_bf16(F4 *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                            unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d->x), "=f"(d->y), "=f"(d->z), "=f"(d->w)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
    return 0;
}

extern "C" __device__ int mma_m16n8k16_f16(F4 *d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           unsigned b0, unsigned b1, float c0, float c1, float c2, float c3) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d->x), "=f"(d->y), "=f"(d->z), "=f"(d->w)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
    return 0;
}
