/* What the API test programs (pmi_api.c, pmi2_api.c) check with: a call's return code, or a condition, each
 * naming the rank and the line when it fails, and ending the program. */
#ifndef RPMI_TEST_CHECK_H
#define RPMI_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

/* The rank, once the program knows it (-1 before). */
static int rank = -1;

#define CHECK(call, want)                                                                                   \
    do {                                                                                                    \
        int rc_ = (call);                                                                                   \
        if (rc_ != (want)) {                                                                                \
            fprintf(stderr, "rank %d: %s returned %d, not %d (line %d)\n", rank, #call, rc_, (want), __LINE__); \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

#define EXPECT(cond)                                                                                        \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "rank %d: %s does not hold (line %d)\n", rank, #cond, __LINE__);                \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

#endif
