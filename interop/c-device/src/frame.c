#include "frame.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *KIND_NAMES[10] = {"", "ROUND", "UPDATE", "EVAL", "FINISH", "STATUS", "ACK", "KNOWLEDGE", "REQUEST", "MODEL"};

#define MAX_FRAME (64u << 20)   /* P-4.4 limits */
#define MAX_META (64u << 10)
#define MAX_ELEMENTS (64u << 20)
#define MAX_SCALE_BITS 0x7C010203u /* P-5.7: the largest scale with 127 * scale finite */

uint32_t crc32(const uint8_t *p, size_t n) { /* P-4.6: CRC-32/ISO-HDLC, bit by bit */
    uint32_t c = 0xFFFFFFFFu;
    while (n--) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    }
    return c ^ 0xFFFFFFFFu;
}

typedef struct {
    const uint8_t *p;
    size_t left;
    char *err;
    size_t errlen;
} cursor;

static int bad(cursor *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

static int take(cursor *c, size_t n, const uint8_t **out, const char *what) {
    if (n > c->left) return bad(c, "%s: got %zu bytes left, expected %zu bytes", what, c->left, n);
    *out = c->p;
    c->p += n, c->left -= n;
    return 0;
}

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static int read_uint(cursor *c, int n, uint64_t *out, const char *what) {
    const uint8_t *p = NULL;
    if (take(c, (size_t)n, &p, what)) return -1;
    *out = le(p, n);
    return 0;
}

static int utf8_ok(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int len = s[i] < 0x80 ? 1 : (s[i] >> 5) == 6 ? 2 : (s[i] >> 4) == 14 ? 3 : (s[i] >> 3) == 30 ? 4 : 0;
        if (!len || i + (size_t)len > n) return 0;
        uint32_t cp = len == 1 ? s[i] : s[i] & (0x7F >> len);
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0; /* overlong, surrogate */
        i += (size_t)len;
    }
    return 1;
}

static int read_text(cursor *c, char out[256], const char *what) {
    uint64_t n;
    const uint8_t *p = NULL;
    if (read_uint(c, 1, &n, what) || take(c, n, &p, what)) return -1;
    if (!utf8_ok(p, n)) return bad(c, "%s: got invalid UTF-8, expected valid UTF-8", what);
    memcpy(out, p, n);
    out[n] = 0;
    return 0;
}

static float half_to_float(uint16_t h) {
    int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 0x400), e - 25);
    return h & 0x8000 ? -v : v;
}

static int read_values(cursor *c, tensor *t, const char *where) {
    uint32_t n = t->count;
    const uint8_t *p = NULL;
    if (!(t->values = malloc(sizeof(float) * (n ? n : 1)))) return bad(c, "%s: out of memory", where);
    if (t->dtype == D_INT8) {
        uint64_t block;
        if (read_uint(c, 2, &block, where)) return -1;
        if (block < 1) return bad(c, "%s.block: got 0, expected 1 <= block <= 65535", where);
        uint32_t nb = (uint32_t)((n + block - 1) / block);
        const uint8_t *sp = NULL, *cp = NULL;
        if (take(c, 4 * (size_t)nb, &sp, where) || take(c, n, &cp, where)) return -1;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)le(sp + 4 * (i / block), 4);
            float scale;
            memcpy(&scale, &bits, 4);
            if (bits > MAX_SCALE_BITS) return bad(c, "%s.scales[%u]: got bits 0x%08x, expected [0, MAX_SCALE]", where, (unsigned)(i / block), bits);
            if ((int8_t)cp[i] == -128) return bad(c, "%s.codes[%u]: got -128, expected a code in [-127, 127]", where, i);
            if (bits == 0 && cp[i]) return bad(c, "%s.codes[%u]: got %d, expected 0 (scale 0)", where, i, (int8_t)cp[i]);
            t->values[i] = (float)(int8_t)cp[i] * scale;
        }
        return 0;
    }
    size_t width = t->dtype == D_F32 ? 4 : 2;
    if (take(c, width * n, &p, where)) return -1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)le(p + width * i, (int)width);
        float v;
        if (width == 4) memcpy(&v, &bits, 4);
        else v = half_to_float((uint16_t)bits);
        if (!isfinite(v)) return bad(c, "%s.values: got a non-finite value at flat index %u, expected finite values", where, i);
        t->values[i] = v;
    }
    return 0;
}

static int read_positions(cursor *c, tensor *t, const char *where) {
    uint64_t nnz;
    const uint8_t *p = NULL;
    if (read_uint(c, 4, &nnz, where)) return -1;
    if (nnz > t->numel) return bad(c, "%s.nnz: got %llu, expected <= %llu (numel)", where, (unsigned long long)nnz, (unsigned long long)t->numel);
    t->count = (uint32_t)nnz;
    if (!(t->indices = malloc(sizeof(uint32_t) * (nnz ? nnz : 1)))) return bad(c, "%s: out of memory", where);
    if (t->layout == L_INDEX) {
        int w = t->numel <= 65536 ? 2 : 4; /* P-5.2 */
        if (take(c, (size_t)w * nnz, &p, where)) return -1;
        for (uint32_t i = 0; i < nnz; i++) {
            t->indices[i] = (uint32_t)le(p + (size_t)w * i, w);
            if (t->indices[i] >= t->numel) return bad(c, "%s.indices: got %u, expected 0 <= index < %llu (numel)", where, t->indices[i], (unsigned long long)t->numel);
            if (i && t->indices[i] <= t->indices[i - 1]) return bad(c, "%s.indices[%u]: got %u, expected > %u (strictly increasing)", where, i, t->indices[i], t->indices[i - 1]);
        }
        return 0;
    }
    size_t nbytes = (size_t)((t->numel + 7) / 8);
    if (take(c, nbytes, &p, where)) return -1;
    uint32_t k = 0;
    for (uint64_t i = 0; i < 8 * (uint64_t)nbytes; i++) {
        if (!(p[i / 8] >> (i % 8) & 1)) continue;
        if (i >= t->numel) return bad(c, "%s.bitmap: got bits set beyond element %llu, expected zero padding bits", where, (unsigned long long)t->numel - 1);
        if (k == nnz) return bad(c, "%s.bitmap popcount: got more than %u, expected %u (nnz)", where, k, k);
        t->indices[k++] = (uint32_t)i;
    }
    if (k != nnz) return bad(c, "%s.bitmap popcount: got %u, expected %u (nnz)", where, k, (unsigned)nnz);
    return 0;
}

static int read_tensor(cursor *c, frame *f, int i) {
    tensor *t = &f->tensors[i];
    char where[300];
    const uint8_t *h = NULL;
    if (read_text(c, t->name, "tensor name")) return -1;
    snprintf(where, sizeof where, "tensor[%d] '%s'", i, t->name);
    if (!t->name[0] || frame_tensor(f, t->name) != t) return bad(c, "%s.name: expected a non-empty name not used before", where);
    if (take(c, 3, &h, where)) return -1;
    t->layout = h[0], t->dtype = h[1], t->ndim = h[2];
    if (t->layout > L_BITMAP) return bad(c, "%s.layout: got %d, expected 0, 1 or 2", where, t->layout);
    if (t->dtype < D_F32 || t->dtype > D_INT8 || (t->dtype == D_INT8 && f->version < 2))
        return bad(c, "%s.dtype: got %d, expected 1, 2 (or 3 in a version 2 frame)", where, t->dtype);
    if (t->ndim > MAX_NDIM) return bad(c, "%s.ndim: got %d, expected <= %d", where, t->ndim, MAX_NDIM);
    t->numel = 1;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t dim;
        if (read_uint(c, 4, &dim, where)) return -1;
        if (dim < 1) return bad(c, "%s.dims: got 0, expected every dim >= 1", where);
        t->dims[d] = (uint32_t)dim;
        t->numel *= dim;
        if (t->numel > MAX_ELEMENTS) return bad(c, "%s.numel: got more than %u, expected <= %u", where, MAX_ELEMENTS, MAX_ELEMENTS);
    }
    t->count = (uint32_t)t->numel;
    if (t->layout != L_DENSE && read_positions(c, t, where)) return -1;
    return read_values(c, t, where);
}

int frame_decode(const uint8_t *buf, size_t n, frame *f, char *err, size_t errlen) {
    cursor c = {buf, n >= 4 ? n - 4 : 0, err, errlen};
    uint64_t v = 0, count = 0;
    const uint8_t *h = NULL;
    memset(f, 0, sizeof *f);
    err[0] = 0;
    if (n > MAX_FRAME) return bad(&c, "frame size: got %zu bytes, expected <= %u", n, MAX_FRAME);
    if (n < 4) return bad(&c, "frame size: got %zu bytes, expected >= 4 bytes", n);
    if ((uint32_t)le(buf + n - 4, 4) != crc32(buf, n - 4))
        return bad(&c, "checksum: got 0x%08x, expected 0x%08x", (unsigned)le(buf + n - 4, 4), (unsigned)crc32(buf, n - 4));
    if (take(&c, 24, &h, "header")) return -1;
    if (memcmp(h, "FCLW", 4)) return bad(&c, "header.magic: expected FCLW");
    f->version = h[4], f->kind = h[5];
    if (f->version != 1 && f->version != 2) return bad(&c, "header.version: got %d, expected 1 or 2", f->version);
    if (f->kind < K_ROUND || f->kind > K_MODEL) return bad(&c, "header.kind: got %d, expected 1 to 9", f->kind);
    if (le(h + 6, 2)) return bad(&c, "header.flags: got 0x%04x, expected 0", (unsigned)le(h + 6, 2));
    f->round = (uint32_t)le(h + 8, 4), f->task = (uint32_t)le(h + 12, 4), f->sequence = le(h + 16, 8);
    if (read_text(&c, f->federation, "header.federation") || read_text(&c, f->client, "header.client")) return -1;
    if (read_uint(&c, 4, &v, "meta length") || v > MAX_META || take(&c, v, &h, "meta"))
        return c.err[0] ? -1 : bad(&c, "meta length: got %llu, expected <= %u", (unsigned long long)v, MAX_META);
    const char *jerr = NULL;
    if (!utf8_ok(h, v)) return bad(&c, "meta: got invalid UTF-8, expected valid UTF-8");
    f->meta = json_parse((const char *)h, v, &jerr);
    if (!f->meta || f->meta->type != J_OBJ) return bad(&c, "meta: got %s, expected a JSON object", f->meta ? "another JSON value" : jerr);
    if (read_uint(&c, 2, &count, "tensor count")) return -1;
    if (count > MAX_TENSORS) return bad(&c, "tensor count: got %llu, expected <= %d", (unsigned long long)count, MAX_TENSORS);
    for (f->ntensors = 0; f->ntensors < (int)count; f->ntensors++)
        if (read_tensor(&c, f, f->ntensors)) return f->ntensors++, -1;
    if (c.left) return bad(&c, "trailing bytes: got %zu bytes after the tensor table, expected 0", c.left);
    return 0;
}

void frame_free(frame *f) {
    json_free(f->meta);
    for (int i = 0; i < f->ntensors; i++) free(f->tensors[i].indices), free(f->tensors[i].values);
    f->meta = NULL, f->ntensors = 0;
}

const tensor *frame_tensor(const frame *f, const char *name) { /* (while decoding: up to the one being read) */
    for (int i = 0; i <= f->ntensors && i < MAX_TENSORS; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

static void put(uint8_t **w, uint64_t v, int n) {
    for (int i = 0; i < n; i++) *(*w)++ = (uint8_t)(v >> (8 * i));
}

uint8_t *frame_encode(int kind, uint32_t round, uint32_t task, uint64_t sequence, const char *federation,
                      const char *client, const char *meta, int ntensors, const tensor *tensors, size_t *out_len) {
    size_t size = 24 + 2 + strlen(federation) + strlen(client) + 4 + strlen(meta) + 2 + 4;
    for (int i = 0; i < ntensors; i++) size += 1 + strlen(tensors[i].name) + 3 + 4 * (size_t)tensors[i].ndim + 4 * tensors[i].numel;
    uint8_t *buf = malloc(size), *w = buf;
    if (!buf) return NULL;
    memcpy(w, "FCLW", 4), w += 4;
    put(&w, 1, 1), put(&w, (uint64_t)kind, 1), put(&w, 0, 2);
    put(&w, round, 4), put(&w, task, 4), put(&w, sequence, 8);
    const char *texts[2] = {federation, client};
    for (int i = 0; i < 2; i++) put(&w, strlen(texts[i]), 1), memcpy(w, texts[i], strlen(texts[i])), w += strlen(texts[i]);
    put(&w, strlen(meta), 4), memcpy(w, meta, strlen(meta)), w += strlen(meta);
    put(&w, (uint64_t)ntensors, 2);
    for (int i = 0; i < ntensors; i++) {
        const tensor *t = &tensors[i];
        put(&w, strlen(t->name), 1), memcpy(w, t->name, strlen(t->name)), w += strlen(t->name);
        put(&w, L_DENSE, 1), put(&w, D_F32, 1), put(&w, (uint64_t)t->ndim, 1);
        for (int d = 0; d < t->ndim; d++) put(&w, t->dims[d], 4);
        for (uint64_t k = 0; k < t->numel; k++) {
            uint32_t bits;
            memcpy(&bits, &t->values[k], 4);
            put(&w, bits, 4);
        }
    }
    put(&w, crc32(buf, (size_t)(w - buf)), 4);
    *out_len = (size_t)(w - buf);
    return buf;
}
