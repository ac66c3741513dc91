/* The library as two translation units: build.py compiles this file once with TA_REAL_BITS=32
 * (fp32 arithmetic for fp32, bf16 and fp16 inputs, plus the exported API) and once with
 * TA_REAL_BITS=64. One unit per real type parses the intrinsics headers once and shares one copy
 * of the micro-GEMM between the passes, which keeps the first-use compile to a few seconds.
 */
#if TA_REAL_BITS == 32
#include "api.c"
#include "threads.c"
#endif
#include "backward.c"
#include "decode.c"
#include "forward.c"
