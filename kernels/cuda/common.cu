// gradzip: device helpers shared by the kernel files (included by them, not compiled alone;
// named .cu so that the package data that ships the kernels ships it too).
//
// * GZ_FULL_MASK: every lane of a warp, for the *_sync intrinsics.
// * gz_load<KIND>(x, i): element i of x as float, x being float32 (KIND 0), float16 bits (1)
//   or bfloat16 bits (2). Loads go through the read-only data cache (__ldg): every kernel
//   here reads an element of x before anything in the same launch writes it, if anything
//   does (a threshold pass may write its residual over x).

#ifndef GZ_COMMON_CU
#define GZ_COMMON_CU

#define GZ_FULL_MASK 0xffffffffu

template <int KIND>
__device__ __forceinline__ float gz_load(const void* x, long long i) {
    if (KIND == 0) {
        return __ldg(static_cast<const float*>(x) + i);
    }
    unsigned short b = __ldg(static_cast<const unsigned short*>(x) + i);
    if (KIND == 1) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
        return f;
    }
    return __uint_as_float(static_cast<unsigned int>(b) << 16);
}

#endif  // GZ_COMMON_CU
