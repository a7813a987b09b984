/* The frame codec of docs/protocol.md, sections 4 to 6: a decoder that checks every rule and
 * an encoder for what this device sends (dense float32 tensors). */
#ifndef FCL_FRAME_H
#define FCL_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "json.h"

enum { K_ROUND = 1, K_UPDATE, K_EVAL, K_FINISH, K_STATUS, K_ACK, K_KNOWLEDGE, K_REQUEST, K_MODEL };
enum { L_DENSE = 0, L_INDEX = 1, L_BITMAP = 2 };
enum { D_F32 = 1, D_F16 = 2, D_INT8 = 3 };
#define MAX_NDIM 8
#define MAX_TENSORS 256

typedef struct {
    char name[256];
    int layout, dtype, ndim;
    uint32_t dims[MAX_NDIM];
    uint64_t numel;
    uint32_t count;    /* values: numel (dense) or nnz (sparse) */
    uint32_t *indices; /* sparse: the nnz flat positions, increasing */
    float *values;     /* count float32 values */
} tensor;

typedef struct {
    int version, kind;
    uint32_t round, task;
    uint64_t sequence;
    char federation[256], client[256];
    json *meta;
    int ntensors;
    tensor tensors[MAX_TENSORS];
} frame;

extern const char *KIND_NAMES[10];

uint32_t crc32(const uint8_t *p, size_t n);
/* 0 and a decoded frame, or -1 and a message naming the field in err (size errlen). */
int frame_decode(const uint8_t *buf, size_t n, frame *f, char *err, size_t errlen);
void frame_free(frame *f);
const tensor *frame_tensor(const frame *f, const char *name);

/* An encoded frame with dense float32 tensors (names[i], ndims[i], dims[i], values[i]);
 * malloc'd, its length in *out_len.  meta: the JSON object's text. */
uint8_t *frame_encode(int kind, uint32_t round, uint32_t task, uint64_t sequence, const char *federation,
                      const char *client, const char *meta, int ntensors, const tensor *tensors, size_t *out_len);

#endif
