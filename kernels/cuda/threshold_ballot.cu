// gradzip: fused threshold + error feedback, bitmap packed with warp ballots.
//
// One pass over x (and the residual r): v = x + r; pos = v >= tau; neg = v <= -tau;
// rout = v - (pos * tau - neg * tau); the 2-bit bitmap; per block the number selected
// and max |v| (as float bits with the sign cleared, so NaN wins, as in torch.max).
//
// Bitmap layout (FMT_BITMAP2): element i -> bits 2*(i%16) .. 2*(i%16)+1 of 32-bit word
// i/16, code 1 = +tau, 2 = -tau; the words' little-endian bytes are the wire bytes
// (4 codes per byte). A warp covers 32 consecutive elements: two __ballot_sync masks
// (pos, neg) hold all its codes, and lanes 0 and 1 each interleave 16 bits of them
// into one word. No shared memory, no per-element shifts through memory.
//
// rout may be r or x (the residual written in place): each element is read before it is
// written, by the same thread, so none of the three pointers is __restrict__.
//
// Launch: blockDim.x a multiple of 32 (256), grid = ceil(n / (blockDim.x * ITEMS)).
// Reference: gradzip.kernels.reference.threshold_ef_reference. Compiled by NVRTC
// through cupy.RawModule at run time, and with `nvcc -cubin -arch=sm_90` in the tests.

#include "common.cu"

#define GZ_ITEMS 16

// Spread the low 16 bits of x to the even bit positions of a 32-bit word.
__device__ __forceinline__ unsigned int gz_spread16(unsigned int x) {
    x &= 0xFFFFu;
    x = (x | (x << 8)) & 0x00FF00FFu;
    x = (x | (x << 4)) & 0x0F0F0F0Fu;
    x = (x | (x << 2)) & 0x33333333u;
    x = (x | (x << 1)) & 0x55555555u;
    return x;
}

template <int KIND>
__device__ __forceinline__ void gz_threshold_ef(const void* x, const float* r,
                                                float* rout, unsigned int* __restrict__ words,
                                                int* __restrict__ counts, unsigned int* __restrict__ amax_bits,
                                                long long n, float tau, int has_r, int write_r) {
    __shared__ int s_count;
    __shared__ unsigned int s_amax;
    if (threadIdx.x == 0) {
        s_count = 0;
        s_amax = 0u;
    }
    __syncthreads();
    const unsigned int lane = threadIdx.x & 31u;
    const long long tile = static_cast<long long>(blockDim.x) * GZ_ITEMS;
    const long long base = static_cast<long long>(blockIdx.x) * tile;
    int count = 0;
    unsigned int amax = 0u;
    for (int it = 0; it < GZ_ITEMS; ++it) {
        const long long warp_start = base + static_cast<long long>(it) * blockDim.x + (threadIdx.x & ~31u);
        const long long i = warp_start + lane;
        const bool in = i < n;
        float v = 0.0f;
        if (in) {
            v = gz_load<KIND>(x, i);
            if (has_r) {
                v += __ldg(r + i);
            }
        }
        const bool pos = in && v >= tau;
        const bool neg = in && v <= -tau;
        if (in && write_r) {
            const float sent = (pos ? 1.0f : 0.0f) * tau - (neg ? 1.0f : 0.0f) * tau;
            rout[i] = v - sent;
        }
        if (in) {
            const unsigned int bits = __float_as_uint(v) & 0x7FFFFFFFu;
            amax = bits > amax ? bits : amax;
        }
        const unsigned int bp = __ballot_sync(GZ_FULL_MASK, pos);
        const unsigned int bn = __ballot_sync(GZ_FULL_MASK, neg);
        if (lane < 2u) {
            const long long w = (warp_start >> 4) + lane;
            if (w * 16 < n) {
                const unsigned int sh = 16u * lane;
                words[w] = gz_spread16(bp >> sh) | (gz_spread16(bn >> sh) << 1);
            }
        }
        if (lane == 0u) {
            count += __popc(bp | bn);
        }
    }
    for (int d = 16; d > 0; d >>= 1) {  // warp max (portable: no __reduce_max_sync before sm_80)
        const unsigned int o = __shfl_xor_sync(GZ_FULL_MASK, amax, d);
        amax = o > amax ? o : amax;
    }
    if (lane == 0u) {
        atomicAdd(&s_count, count);
        atomicMax(&s_amax, amax);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        counts[blockIdx.x] = s_count;
        amax_bits[blockIdx.x] = s_amax;
    }
}

extern "C" __global__ void threshold_ef_f32(const float* x, const float* r, float* rout, unsigned int* words,
                                            int* counts, unsigned int* amax_bits, long long n, float tau,
                                            int has_r, int write_r) {
    gz_threshold_ef<0>(x, r, rout, words, counts, amax_bits, n, tau, has_r, write_r);
}

extern "C" __global__ void threshold_ef_f16(const unsigned short* x, const float* r, float* rout,
                                            unsigned int* words, int* counts, unsigned int* amax_bits,
                                            long long n, float tau, int has_r, int write_r) {
    gz_threshold_ef<1>(x, r, rout, words, counts, amax_bits, n, tau, has_r, write_r);
}

extern "C" __global__ void threshold_ef_bf16(const unsigned short* x, const float* r, float* rout,
                                             unsigned int* words, int* counts, unsigned int* amax_bits,
                                             long long n, float tau, int has_r, int write_r) {
    gz_threshold_ef<2>(x, r, rout, words, counts, amax_bits, n, tau, has_r, write_r);
}
