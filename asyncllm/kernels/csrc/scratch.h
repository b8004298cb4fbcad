/* Per-thread scratch memory for the CPU kernels: grown on demand, kept for the thread's next call
 * (OpenMP threads live as long as the process), so the hot loops never allocate. */
#ifndef ASYNCLLM_SCRATCH_H
#define ASYNCLLM_SCRATCH_H

#include <stddef.h>
#include <stdlib.h>

static __thread float *scratch = NULL;
static __thread size_t scratch_len = 0;

/* n floats of this thread's scratch, or NULL when memory runs out. */
static float *scratch_floats(size_t n) {
    if (n > scratch_len) {
        free(scratch);
        scratch = (float *)malloc(n * sizeof(float));
        scratch_len = scratch ? n : 0;
    }
    return scratch;
}

#endif
