/*
 * n-gram repeat blocking on the GPU (FastSeq, Yan et al. 2021, section 4.2, Algorithm 1).
 *
 * Semantics are those of transformers' NoRepeatNGramLogitsProcessor and of the CPU reference
 * exporter/plugins/ngram_reference.py: for each row of a token history [rows, curLen], every window
 * history[s : s+n] (0 <= s <= curLen-n) whose first n-1 tokens equal the last n-1 tokens of the row
 * bans its last token, i.e. scores[row, history[s+n-1]] = -inf.  curLen < n bans nothing; n == 1 bans
 * every token seen in the row; banned ids outside [0, vocab) are ignored.
 *
 * The launcher works in place on `scores` (device memory, row-major [rows, vocab]) and only writes
 * -inf; the caller copies the scores first if it needs the original.
 *
 * Plain C interface so that it can be called from the TensorRT plugin and through ctypes/CuPy.
 */
#ifndef ELX_NGRAM_REPEAT_BLOCK_H
#define ELX_NGRAM_REPEAT_BLOCK_H

#include <stdint.h>
#include <cuda_runtime_api.h>

#if defined(_WIN32)
#define ELX_NGRAM_EXPORT __declspec(dllexport)
#else
#define ELX_NGRAM_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of the token history. */
enum NgramTokenType
{
    NGRAM_TOKENS_INT64 = 0,
    NGRAM_TOKENS_INT32 = 1
};

/* Element type of the scores. */
enum NgramScoreType
{
    NGRAM_SCORES_FLOAT32 = 0,
    NGRAM_SCORES_FLOAT16 = 1 /* IEEE half (__half) */
};

/* Where a block reads the row's history from.
 * AUTO: shared memory when the row fits NGRAM_SHARED_HISTORY_BYTES, global memory otherwise.
 * SHARED: always shared memory; returns cudaErrorInvalidValue if the row does not fit (never truncates).
 * GLOBAL: always global memory (any length). */
enum NgramMemoryMode
{
    NGRAM_MEMORY_AUTO = 0,
    NGRAM_MEMORY_SHARED = 1,
    NGRAM_MEMORY_GLOBAL = 2
};

/* Dynamic shared memory a block may use without opting in (48 KiB on every CUDA architecture):
 * 6144 int64 tokens or 12288 int32 tokens.  Longer rows are read from global memory (AUTO mode). */
#define NGRAM_SHARED_HISTORY_BYTES (48 * 1024)

/* Bans repeated n-grams in `scores` in place, asynchronously on `stream`.
 * history: device pointer, [rows, curLen] row-major, tokenType elements.
 * scores:  device pointer, [rows, vocab] row-major, scoreType elements.
 * Returns 0 (cudaSuccess) or a cudaError_t value: cudaErrorInvalidValue for bad arguments
 * (ngramSize < 1, negative sizes, null pointers with non-empty tensors, unknown enum values), or the
 * launch error.  Nothing is launched when rows == 0, vocab == 0 or curLen < ngramSize. */
ELX_NGRAM_EXPORT int ngramRepeatBlockLaunch(void const* history, int tokenType, void* scores, int scoreType,
    int64_t rows, int64_t curLen, int64_t vocab, int32_t ngramSize, cudaStream_t stream);

/* Same with an explicit NgramMemoryMode (used by tests to cover both code paths). */
ELX_NGRAM_EXPORT int ngramRepeatBlockLaunchMode(void const* history, int tokenType, void* scores, int scoreType,
    int64_t rows, int64_t curLen, int64_t vocab, int32_t ngramSize, int memoryMode, cudaStream_t stream);

/* Largest curLen that AUTO mode keeps in shared memory for this token type (-1 for an unknown type). */
ELX_NGRAM_EXPORT int64_t ngramRepeatBlockMaxSharedTokens(int tokenType);

#ifdef __cplusplus
}
#endif

#endif /* ELX_NGRAM_REPEAT_BLOCK_H */
