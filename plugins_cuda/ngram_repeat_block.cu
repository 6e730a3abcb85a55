// n-gram repeat blocking kernel, see ngram_repeat_block.h for the definition.
//
// Layout (after FastSeq's Algorithm 1): one thread block per row; the row's token history is copied
// once into dynamic shared memory because every token is read by up to n windows; each thread then
// checks windows s = threadIdx.x, threadIdx.x + blockDim.x, ... (block-stride loop), so any history
// length works with a fixed block size (no "one thread per window" limit of 1024).  A window whose
// first n-1 tokens equal the row's last n-1 tokens writes -inf at its last token.  Several threads may
// write -inf to the same score; the stores are identical, so the race is harmless.
//
// Rows longer than NGRAM_SHARED_HISTORY_BYTES are read straight from global memory (through the
// read-only cache); the result is the same, only the memory path differs.

#include "ngram_repeat_block.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace
{

constexpr int kMaxThreads = 256;

template <typename ScoreT>
__device__ __forceinline__ ScoreT negativeInfinity();

template <>
__device__ __forceinline__ float negativeInfinity<float>()
{
    return __int_as_float(0xff800000);
}

template <>
__device__ __forceinline__ __half negativeInfinity<__half>()
{
    return __ushort_as_half(static_cast<unsigned short>(0xfc00U));
}

template <typename TokenT, typename ScoreT, bool kShared>
__global__ void ngramRepeatBlockKernel(TokenT const* __restrict__ history, ScoreT* __restrict__ scores, int64_t rows,
    int64_t curLen, int64_t vocab, int32_t n)
{
    extern __shared__ __align__(16) unsigned char sharedBytes[];
    TokenT* sharedTokens = reinterpret_cast<TokenT*>(sharedBytes);

    int64_t const numWindows = curLen - n + 1; // launcher guarantees curLen >= n >= 1
    int64_t const suffixStart = curLen - n + 1;
    ScoreT const ban = negativeInfinity<ScoreT>();

    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x)
    {
        TokenT const* rowGlobal = history + row * curLen;
        TokenT const* tokens = rowGlobal;
        if (kShared)
        {
            for (int64_t i = threadIdx.x; i < curLen; i += blockDim.x)
            {
                sharedTokens[i] = rowGlobal[i];
            }
            __syncthreads();
            tokens = sharedTokens;
        }

        ScoreT* rowScores = scores + row * vocab;
        for (int64_t s = threadIdx.x; s < numWindows; s += blockDim.x)
        {
            bool match = true;
            for (int32_t i = 0; i < n - 1; ++i)
            {
                if (tokens[s + i] != tokens[suffixStart + i])
                {
                    match = false;
                    break;
                }
            }
            if (match)
            {
                int64_t const token = static_cast<int64_t>(tokens[s + n - 1]);
                if (token >= 0 && token < vocab)
                {
                    rowScores[token] = ban;
                }
            }
        }

        if (kShared)
        {
            __syncthreads(); // the next row overwrites the shared history
        }
    }
}

template <typename TokenT, typename ScoreT>
cudaError_t launchTyped(void const* history, void* scores, int64_t rows, int64_t curLen, int64_t vocab, int32_t n,
    int memoryMode, cudaStream_t stream)
{
    int64_t const historyBytes = curLen * static_cast<int64_t>(sizeof(TokenT));
    bool const fits = historyBytes <= NGRAM_SHARED_HISTORY_BYTES;
    bool useShared;
    switch (memoryMode)
    {
    case NGRAM_MEMORY_AUTO: useShared = fits; break;
    case NGRAM_MEMORY_SHARED:
        if (!fits)
        {
            return cudaErrorInvalidValue; // explicit: never truncate the history
        }
        useShared = true;
        break;
    case NGRAM_MEMORY_GLOBAL: useShared = false; break;
    default: return cudaErrorInvalidValue;
    }

    int64_t const numWindows = curLen - n + 1;
    int64_t threads = ((numWindows + 31) / 32) * 32;
    if (threads > kMaxThreads)
    {
        threads = kMaxThreads;
    }
    unsigned int const blocks = static_cast<unsigned int>(rows < INT_MAX ? rows : INT_MAX);
    auto const* tokens = static_cast<TokenT const*>(history);
    auto* out = static_cast<ScoreT*>(scores);
    if (useShared)
    {
        ngramRepeatBlockKernel<TokenT, ScoreT, true><<<blocks, static_cast<unsigned int>(threads),
            static_cast<size_t>(historyBytes), stream>>>(tokens, out, rows, curLen, vocab, n);
    }
    else
    {
        ngramRepeatBlockKernel<TokenT, ScoreT, false>
            <<<blocks, static_cast<unsigned int>(threads), 0, stream>>>(tokens, out, rows, curLen, vocab, n);
    }
    return cudaGetLastError();
}

template <typename TokenT>
cudaError_t dispatchScores(void const* history, int scoreType, void* scores, int64_t rows, int64_t curLen,
    int64_t vocab, int32_t n, int memoryMode, cudaStream_t stream)
{
    switch (scoreType)
    {
    case NGRAM_SCORES_FLOAT32:
        return launchTyped<TokenT, float>(history, scores, rows, curLen, vocab, n, memoryMode, stream);
    case NGRAM_SCORES_FLOAT16:
        return launchTyped<TokenT, __half>(history, scores, rows, curLen, vocab, n, memoryMode, stream);
    default: return cudaErrorInvalidValue;
    }
}

} // namespace

extern "C" ELX_NGRAM_EXPORT int ngramRepeatBlockLaunchMode(void const* history, int tokenType, void* scores,
    int scoreType, int64_t rows, int64_t curLen, int64_t vocab, int32_t ngramSize, int memoryMode, cudaStream_t stream)
{
    if (ngramSize < 1 || rows < 0 || curLen < 0 || vocab < 0)
    {
        return cudaErrorInvalidValue;
    }
    if ((tokenType != NGRAM_TOKENS_INT64 && tokenType != NGRAM_TOKENS_INT32)
        || (scoreType != NGRAM_SCORES_FLOAT32 && scoreType != NGRAM_SCORES_FLOAT16)
        || memoryMode < NGRAM_MEMORY_AUTO || memoryMode > NGRAM_MEMORY_GLOBAL)
    {
        return cudaErrorInvalidValue;
    }
    if (rows == 0 || vocab == 0 || curLen < ngramSize)
    {
        return cudaSuccess; // no complete n-gram (or nothing to write): scores stay as they are
    }
    if (history == nullptr || scores == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (tokenType == NGRAM_TOKENS_INT64)
    {
        return dispatchScores<int64_t>(history, scoreType, scores, rows, curLen, vocab, ngramSize, memoryMode, stream);
    }
    return dispatchScores<int32_t>(history, scoreType, scores, rows, curLen, vocab, ngramSize, memoryMode, stream);
}

extern "C" ELX_NGRAM_EXPORT int ngramRepeatBlockLaunch(void const* history, int tokenType, void* scores, int scoreType,
    int64_t rows, int64_t curLen, int64_t vocab, int32_t ngramSize, cudaStream_t stream)
{
    return ngramRepeatBlockLaunchMode(
        history, tokenType, scores, scoreType, rows, curLen, vocab, ngramSize, NGRAM_MEMORY_AUTO, stream);
}

extern "C" ELX_NGRAM_EXPORT int64_t ngramRepeatBlockMaxSharedTokens(int tokenType)
{
    switch (tokenType)
    {
    case NGRAM_TOKENS_INT64: return NGRAM_SHARED_HISTORY_BYTES / static_cast<int64_t>(sizeof(int64_t));
    case NGRAM_TOKENS_INT32: return NGRAM_SHARED_HISTORY_BYTES / static_cast<int64_t>(sizeof(int32_t));
    default: return -1;
    }
}
