// gradzip: stream compaction with warp-aggregated atomics.
//
// Each warp ballots its 32 predicates, one lane claims popc(mask) slots with a single
// atomicAdd on a global 64-bit counter, broadcasts the base with __shfl_sync, and every
// selected lane writes at base + popc(mask & lanemask_lt). One atomic per warp (not per
// element), coalesced-ish writes; order between warps is arbitrary, so the caller sorts
// the (short) result. Writes past `capacity` are dropped and the counter still counts
// them, so the caller can size a buffer and run again.
//
// * bitmap_to_signed_words: the threshold index list (FMT_SIGNED_INDEX words: index in
//   bits 0..30, sign in bit 31) from the 2-bit bitmap written by threshold_ballot.cu.
// * abs_select_{f32,f16,bf16}: int64 indices of |v| >= thr (DGC top-k compaction).
//
// Launch: blockDim.x a multiple of 32, any grid (grid-stride loops, warp-uniform trip
// counts). References: threshold_ef_reference(...).indices(), abs_select_reference.

#include "common.cu"

__device__ __forceinline__ unsigned int gz_lanemask_lt() {
    unsigned int m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// Claim slots for the selected lanes of this warp; returns this lane's slot (valid if sel).
__device__ __forceinline__ unsigned long long gz_warp_claim(bool sel, unsigned int mask,
                                                            unsigned long long* counter) {
    const unsigned int lane = threadIdx.x & 31u;
    const int leader = __ffs(mask) - 1;
    unsigned long long start = 0ull;
    if (static_cast<int>(lane) == leader) {
        start = atomicAdd(counter, static_cast<unsigned long long>(__popc(mask)));
    }
    start = __shfl_sync(GZ_FULL_MASK, start, leader);
    return start + static_cast<unsigned long long>(__popc(mask & gz_lanemask_lt()));
}

extern "C" __global__ void bitmap_to_signed_words(const unsigned int* __restrict__ words, long long n,
                                                  int* __restrict__ out, unsigned long long* counter,
                                                  long long capacity) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long start = static_cast<long long>(blockIdx.x) * blockDim.x; start < n; start += stride) {
        const long long i = start + threadIdx.x;
        unsigned int code = 0u;
        if (i < n) {
            code = (words[i >> 4] >> (2u * static_cast<unsigned int>(i & 15))) & 3u;
        }
        const bool sel = code != 0u;
        const unsigned int mask = __ballot_sync(GZ_FULL_MASK, sel);
        if (mask == 0u) {
            continue;
        }
        const unsigned long long dst = gz_warp_claim(sel, mask, counter);
        if (sel && dst < static_cast<unsigned long long>(capacity)) {
            out[dst] = static_cast<int>(static_cast<unsigned int>(i) | ((code >> 1) << 31));
        }
    }
}

template <int KIND>
__device__ __forceinline__ void gz_abs_select(const void* __restrict__ v, const float* __restrict__ thr,
                                              long long* __restrict__ out, unsigned long long* counter,
                                              long long n, long long capacity) {
    const float t = thr[0];
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long start = static_cast<long long>(blockIdx.x) * blockDim.x; start < n; start += stride) {
        const long long i = start + threadIdx.x;
        const bool sel = i < n && fabsf(gz_load<KIND>(v, i)) >= t;
        const unsigned int mask = __ballot_sync(GZ_FULL_MASK, sel);
        if (mask == 0u) {
            continue;
        }
        const unsigned long long dst = gz_warp_claim(sel, mask, counter);
        if (sel && dst < static_cast<unsigned long long>(capacity)) {
            out[dst] = i;
        }
    }
}

extern "C" __global__ void abs_select_f32(const float* v, const float* thr, long long* out,
                                          unsigned long long* counter, long long n, long long capacity) {
    gz_abs_select<0>(v, thr, out, counter, n, capacity);
}

extern "C" __global__ void abs_select_f16(const unsigned short* v, const float* thr, long long* out,
                                          unsigned long long* counter, long long n, long long capacity) {
    gz_abs_select<1>(v, thr, out, counter, n, capacity);
}

extern "C" __global__ void abs_select_bf16(const unsigned short* v, const float* thr, long long* out,
                                           unsigned long long* counter, long long n, long long capacity) {
    gz_abs_select<2>(v, thr, out, counter, n, capacity);
}
