/* `fcl-c-device --vectors DIR`: decode every golden vector of docs/protocol-vectors/ and
 * compare with its decoded JSON; every invalid frame must be rejected; the model digest and
 * the SplitMix64 streams (P-7.8) must match.  Prints one line per vector; exit status 0 when all pass. */
#include "vectors.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "sha256.h"

static char *read_file(const char *dir, const char *name, size_t *len) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    *len = buf ? fread(buf, 1, (size_t)n, fp) : 0;
    fclose(fp);
    return buf;
}

static json *load(const char *dir, const char *name) {
    size_t len;
    char *text = read_file(dir, name, &len);
    const char *err = NULL;
    json *j = text ? json_parse(text, len, &err) : NULL;
    if (!j) fprintf(stderr, "%s/%s: %s\n", dir, name, text ? err : "cannot read");
    free(text);
    return j;
}

uint8_t *unhex(const char *hex, size_t *n) {
    *n = strlen(hex) / 2;
    uint8_t *out = malloc(*n + 1);
    for (size_t i = 0; out && i < *n; i++) sscanf(hex + 2 * i, "%2hhx", &out[i]);
    return out;
}

static int tensor_matches(const tensor *t, const json *want) {
    static const char *layouts[] = {"dense", "index", "bitmap"}, *dtypes[] = {"", "float32", "float16", "int8"};
    const json *shape = json_get(want, "shape"), *values = json_get(want, "values"), *idx = json_get(want, "indices");
    if (strcmp(json_get(want, "layout")->text, layouts[t->layout]) || strcmp(json_get(want, "dtype")->text, dtypes[t->dtype]))
        return 0;
    if ((int)json_len(shape) != t->ndim || json_len(values) != t->count || (idx != NULL) != (t->indices != NULL)) return 0;
    for (int d = 0; d < t->ndim; d++)
        if (json_u64(json_at(shape, (size_t)d)) != t->dims[d]) return 0;
    size_t k = 0;
    for (const json *v = values->child; v; v = v->next, k++) {
        float f = (float)v->num;
        if (memcmp(&f, &t->values[k], 4)) return 0; /* bit for bit: -0.0 is not 0.0 */
        if (idx && json_u64(json_at(idx, k)) != t->indices[k]) return 0;
    }
    return 1;
}

static int check_frame(const json *v, char *why, size_t whylen) {
    size_t n;
    uint8_t *buf = unhex(json_get(v, "hex")->text, &n), *body = buf;
    const json *key = json_get(v, "key"), *want = json_get(v, "decoded"), *h = json_get(want, "header");
    frame f;
    int ok = 0;
    if (key) { /* P-6.1: FCLS, HMAC-SHA256(key, frame), frame */
        size_t klen;
        uint8_t *k = unhex(key->text, &klen), tag[32];
        hmac_sha256(k, klen, buf + 36, n - 36, tag);
        free(k);
        if (memcmp(buf, "FCLS", 4) || memcmp(tag, buf + 4, 32)) { snprintf(why, whylen, "signature"); free(buf); return 0; }
        body += 36, n -= 36;
    }
    if (frame_decode(body, n, &f, why, whylen)) { frame_free(&f); free(buf); return 0; }
    ok = f.version == (int)json_get(h, "version")->num && !strcmp(KIND_NAMES[f.kind], json_get(h, "kind")->text) &&
         f.round == json_u64(json_get(h, "round")) && f.task == json_u64(json_get(h, "task")) &&
         f.sequence == json_u64(json_get(h, "sequence")) && !strcmp(f.federation, json_get(h, "federation")->text) &&
         !strcmp(f.client, json_get(h, "client")->text);
    if (!ok) snprintf(why, whylen, "header differs");
    if (ok && !(ok = json_equal(f.meta, json_get(want, "meta")))) snprintf(why, whylen, "meta differs");
    const json *tensors = json_get(want, "tensors");
    if (ok && (size_t)f.ntensors != json_len(tensors)) ok = 0, snprintf(why, whylen, "tensor count differs");
    for (const json *t = ok ? tensors->child : NULL; t; t = t->next) {
        const tensor *got = frame_tensor(&f, t->key);
        if (!got || !tensor_matches(got, t)) { ok = 0; snprintf(why, whylen, "tensor %s differs", t->key); break; }
    }
    frame_free(&f);
    free(buf);
    return ok;
}

static int check_digest(const json *doc) {
    model m = {0};
    for (const json *t = json_get(doc, "tensors")->child; t; t = t->next, m.ntensors++) {
        tensor *x = &m.tensors[m.ntensors];
        const json *shape = json_get(t, "shape"), *values = json_get(t, "values");
        snprintf(x->name, sizeof x->name, "%s", t->key);
        x->ndim = (int)json_len(shape);
        for (int d = 0; d < x->ndim; d++) x->dims[d] = (uint32_t)json_u64(json_at(shape, (size_t)d));
        x->numel = x->count = (uint32_t)json_len(values);
        x->values = malloc(sizeof(float) * x->numel);
        size_t k = 0;
        for (const json *v = values->child; v; v = v->next) x->values[k++] = (float)v->num;
    }
    char hex[65];
    model_digest(&m, hex);
    model_free(&m);
    return !strcmp(hex, json_get(doc, "digest")->text);
}

static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

static uint64_t next(uint64_t *state) { return mix(*state += 0x9E3779B97F4A7C15u); }

static uint64_t below(uint64_t *state, uint64_t n) { /* limit = 2^64 - (2^64 mod n) */
    uint64_t rem = (0 - n) % n, x;
    while ((x = next(state)) > UINT64_MAX - rem) {}
    return x % n;
}

static int check_splitmix(const json *c) {
    uint64_t state = mix(json_u64(json_get(c, "seed")) + 0x9E3779B97F4A7C15u), s2;
    for (const json *k = json_get(c, "keys")->child; k; k = k->next) state = mix(state ^ json_u64(k));
    s2 = state;
    for (const json *o = json_get(c, "next")->child; o; o = o->next)
        if (next(&state) != strtoull(o->text, NULL, 16)) return 0;
    for (const json *o = json_get(c, "then_below_10")->child; o; o = o->next)
        if (below(&state, 10) != json_u64(o)) return 0;
    int p[16];
    for (int i = 0; i < 16; i++) p[i] = i;
    for (int i = 15; i > 0; i--) {
        int j = (int)below(&s2, (uint64_t)i + 1), t = p[i];
        p[i] = p[j], p[j] = t;
    }
    for (int i = 0; i < 16; i++)
        if ((uint64_t)p[i] != json_u64(json_at(json_get(c, "permutation_16"), (size_t)i))) return 0;
    return 1;
}

int check_vectors(const char *dir) {
    json *frames = load(dir, "frames.json"), *invalid = load(dir, "invalid.json");
    json *digest = load(dir, "model-digest.json"), *streams = load(dir, "splitmix64.json");
    int failed = !frames || !invalid || !digest || !streams, count = 0;
    char why[512];
    for (const json *v = frames ? frames->child : NULL; v; v = v->next, count++) {
        int ok = check_frame(v, why, sizeof why);
        printf("%s frame %s%s%s\n", ok ? "ok  " : "FAIL", json_get(v, "name")->text, ok ? "" : ": ", ok ? "" : why);
        failed |= !ok;
    }
    for (const json *v = invalid ? invalid->child : NULL; v; v = v->next, count++) {
        size_t n;
        uint8_t *buf = unhex(json_get(v, "hex")->text, &n);
        frame f;
        int rejected = frame_decode(buf, n, &f, why, sizeof why) != 0;
        frame_free(&f);
        free(buf);
        printf("%s invalid %s: %s\n", rejected ? "ok  " : "FAIL", json_get(v, "name")->text, rejected ? why : "accepted");
        failed |= !rejected;
    }
    if (digest) {
        int ok = check_digest(digest);
        printf("%s model-digest\n", ok ? "ok  " : "FAIL");
        failed |= !ok, count++;
    }
    for (const json *c = streams ? streams->child : NULL; c; c = c->next, count++) {
        int ok = check_splitmix(c);
        printf("%s splitmix64 seed %s\n", ok ? "ok  " : "FAIL", json_get(c, "seed")->text);
        failed |= !ok;
    }
    printf("%d vectors, %s\n", count, failed ? "FAILED" : "all passed");
    json_free(frames), json_free(invalid), json_free(digest), json_free(streams);
    return failed;
}
