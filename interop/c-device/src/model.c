#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sha256.h"

void model_free(model *m) {
    for (int i = 0; i < m->ntensors; i++) free(m->tensors[i].values);
    m->ntensors = 0;
}

static tensor *find(model *m, const char *name) {
    for (int i = 0; i < m->ntensors; i++)
        if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
    return NULL;
}

static int same_shape(const tensor *a, const tensor *b) {
    return a->ndim == b->ndim && !memcmp(a->dims, b->dims, sizeof(uint32_t) * (size_t)a->ndim);
}

static int copy_dense(tensor *dst, const tensor *src) {
    *dst = *src;
    dst->indices = NULL;
    dst->count = (uint32_t)src->numel;
    if (!(dst->values = calloc(src->numel, sizeof(float)))) return -1;
    if (!src->indices) memcpy(dst->values, src->values, sizeof(float) * src->numel);
    return 0;
}

static int fail(model *out, char *err, size_t errlen, const char *what, const char *name) {
    snprintf(err, errlen, "%s: %s", name, what);
    model_free(out);
    return -1;
}

int model_apply(const model *m, const frame *f, const json *ref, model *out, char *err, size_t errlen) {
    const json *base = json_get(ref, "base"), *removed = json_get(ref, "removed");
    out->ntensors = 0;
    if (json_len(json_get(ref, "derived"))) return fail(out, err, errlen, "sent as derived values", "model.derived");
    if (!base || base->type == J_NULL) {
        for (int i = 0; i < f->ntensors; i++) {
            if (f->tensors[i].indices) return fail(out, err, errlen, "a full model is dense", f->tensors[i].name);
            if (copy_dense(&out->tensors[out->ntensors++], &f->tensors[i])) return fail(out, err, errlen, "out of memory", "");
        }
        return 0;
    }
    for (int i = 0; i < m->ntensors; i++) {
        int gone = 0;
        for (const json *r = removed ? removed->child : NULL; r; r = r->next) gone |= r->type == J_STR && !strcmp(r->text, m->tensors[i].name);
        if (!gone && copy_dense(&out->tensors[out->ntensors++], &m->tensors[i])) return fail(out, err, errlen, "out of memory", "");
    }
    for (int i = 0; i < f->ntensors; i++) {
        const tensor *t = &f->tensors[i];
        tensor *held = find(out, t->name);
        if (!t->indices) { /* dense: replaces, or is new */
            if (held) free(held->values);
            else if (out->ntensors == MAX_TENSORS) return fail(out, err, errlen, "too many tensors", t->name);
            else held = &out->tensors[out->ntensors++];
            if (copy_dense(held, t)) return fail(out, err, errlen, "out of memory", t->name);
            continue;
        }
        if (!held || !same_shape(held, t)) return fail(out, err, errlen, "a sparse change of a tensor not held in that shape", t->name);
        for (uint32_t k = 0; k < t->count; k++) held->values[t->indices[k]] = t->values[k];
    }
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp((*(const tensor *const *)a)->name, (*(const tensor *const *)b)->name); /* bytes, unsigned */
}

void model_digest(const model *m, char hex[65]) {
    const tensor *order[MAX_TENSORS];
    uint8_t head[5 + 4] = {'F', 'C', 'L', 'M', 2}, out[32], b[4];
    sha256 s;
    for (int i = 0; i < m->ntensors; i++) order[i] = &m->tensors[i];
    qsort(order, (size_t)m->ntensors, sizeof order[0], by_name);
    for (int i = 0; i < 4; i++) head[5 + i] = (uint8_t)((uint32_t)m->ntensors >> (8 * i));
    sha256_init(&s);
    sha256_update(&s, head, sizeof head);
    for (int i = 0; i < m->ntensors; i++) {
        const tensor *t = order[i];
        size_t n = strlen(t->name);
        uint8_t meta[2] = {(uint8_t)n, (uint8_t)(n >> 8)}, codes[2] = {1, (uint8_t)t->ndim};
        sha256_update(&s, meta, 2), sha256_update(&s, t->name, n), sha256_update(&s, codes, 2);
        for (int d = 0; d < t->ndim; d++) {
            for (int k = 0; k < 4; k++) b[k] = (uint8_t)(t->dims[d] >> (8 * k));
            sha256_update(&s, b, 4);
        }
        for (uint64_t k = 0; k < t->numel; k++) {
            uint32_t bits;
            memcpy(&bits, &t->values[k], 4);
            for (int j = 0; j < 4; j++) b[j] = (uint8_t)(bits >> (8 * j));
            sha256_update(&s, b, 4);
        }
    }
    sha256_final(&s, out);
    for (int i = 0; i < 32; i++) sprintf(hex + 2 * i, "%02x", out[i]);
}
