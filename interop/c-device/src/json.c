#include "json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p, *end;
    const char *err;
    int depth;
} reader;

static json *parse_value(reader *r);

static json *fail(reader *r, const char *msg) {
    if (!r->err) r->err = msg;
    return NULL;
}

static void skip_ws(reader *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

static json *node(enum json_type t) {
    json *j = calloc(1, sizeof *j);
    if (j) j->type = t;
    return j;
}

static int put_utf8(char *out, unsigned cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static int hex4(reader *r, unsigned *out) {
    if (r->end - r->p < 4) return 0;
    char buf[5] = {0};
    memcpy(buf, r->p, 4);
    char *stop;
    *out = (unsigned)strtoul(buf, &stop, 16);
    r->p += 4;
    return stop == buf + 4;
}

static char *parse_string(reader *r) {
    r->p++; /* the opening quote */
    char *out = malloc((size_t)(r->end - r->p) + 4), *w = out;
    if (!out) return NULL;
    while (r->p < r->end && *r->p != '"') {
        unsigned char c = (unsigned char)*r->p++;
        if (c < 0x20) { free(out); fail(r, "control character in a string"); return NULL; }
        if (c != '\\') { *w++ = (char)c; continue; }
        if (r->p >= r->end) break;
        char e = *r->p++;
        const char *simple = strchr("\"\\/bfnrt", e);
        if (simple && e) { *w++ = "\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"]; continue; }
        unsigned cp, lo;
        if (e != 'u' || !hex4(r, &cp)) { free(out); fail(r, "bad escape"); return NULL; }
        if (cp >= 0xD800 && cp < 0xDC00 && r->end - r->p >= 6 && r->p[0] == '\\' && r->p[1] == 'u') {
            r->p += 2;
            if (!hex4(r, &lo) || lo < 0xDC00 || lo > 0xDFFF) { free(out); fail(r, "bad surrogate"); return NULL; }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        w += put_utf8(w, cp);
    }
    if (r->p >= r->end) { free(out); fail(r, "unterminated string"); return NULL; }
    r->p++;
    *w = 0;
    return out;
}

static json *parse_number(reader *r) {
    const char *start = r->p;
    if (r->p < r->end && *r->p == '-') r->p++;
    while (r->p < r->end && strchr("0123456789.eE+-", *r->p)) r->p++;
    size_t n = (size_t)(r->p - start);
    json *j = node(J_NUM);
    if (!j || !(j->text = malloc(n + 1))) { free(j); return fail(r, "out of memory"); }
    memcpy(j->text, start, n);
    j->text[n] = 0;
    char *stop;
    j->num = strtod(j->text, &stop);
    if (n == 0 || *stop || !isfinite(j->num)) { json_free(j); return fail(r, "number not finite"); }
    return j;
}

static json *parse_container(reader *r, int object) {
    json *j = node(object ? J_OBJ : J_ARR), **tail = &j->child;
    if (!j) return fail(r, "out of memory");
    if (++r->depth > 64) { json_free(j); return fail(r, "nested too deep"); }
    r->p++;
    skip_ws(r);
    if (r->p < r->end && *r->p == (object ? '}' : ']')) { r->p++; r->depth--; return j; }
    for (;;) {
        char *key = NULL;
        skip_ws(r);
        if (object) {
            if (r->p >= r->end || *r->p != '"' || !(key = parse_string(r))) break;
            if (json_get(j, key)) { free(key); fail(r, "duplicate key"); break; }
            skip_ws(r);
            if (r->p >= r->end || *r->p++ != ':') { free(key); fail(r, "expected ':'"); break; }
        }
        json *v = parse_value(r);
        if (!v) { free(key); break; }
        v->key = key;
        *tail = v;
        tail = &v->next;
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') { r->p++; continue; }
        if (r->p < r->end && *r->p == (object ? '}' : ']')) { r->p++; r->depth--; return j; }
        fail(r, "expected ',' or a closing bracket");
        break;
    }
    json_free(j);
    return fail(r, "malformed container");
}

static json *parse_value(reader *r) {
    skip_ws(r);
    if (r->p >= r->end) return fail(r, "unexpected end");
    char c = *r->p;
    if (c == '{' || c == '[') return parse_container(r, c == '{');
    if (c == '"') {
        json *j = node(J_STR);
        if (j && !(j->text = parse_string(r))) { free(j); return fail(r, "bad string"); }
        return j;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number(r);
    static const char *words[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(words[i]);
        if ((size_t)(r->end - r->p) >= n && !memcmp(r->p, words[i], n)) {
            r->p += n;
            json *j = node(i == 2 ? J_NULL : J_BOOL);
            if (j) j->boolean = i == 0;
            return j;
        }
    }
    return fail(r, "not JSON (NaN and Infinity are not numbers)");
}

json *json_parse(const char *text, size_t len, const char **err) {
    reader r = {text, text + len, NULL, 0};
    json *j = parse_value(&r);
    skip_ws(&r);
    if (j && r.p != r.end) { json_free(j); j = fail(&r, "trailing characters"); }
    if (err) *err = r.err;
    return j;
}

void json_free(json *j) {
    while (j) {
        json *next = j->next;
        json_free(j->child);
        free(j->text);
        free(j->key);
        free(j);
        j = next;
    }
}

const json *json_get(const json *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (const json *c = obj->child; c; c = c->next)
        if (c->key && !strcmp(c->key, key)) return c;
    return NULL;
}

const json *json_at(const json *arr, size_t i) {
    const json *c = arr ? arr->child : NULL;
    while (c && i--) c = c->next;
    return c;
}

size_t json_len(const json *arr) {
    size_t n = 0;
    for (const json *c = arr ? arr->child : NULL; c; c = c->next) n++;
    return n;
}

int json_int(const json *j, int64_t *out) {
    if (!j || j->type != J_NUM || strpbrk(j->text, ".eE") || fabs(j->num) > 9.2e18) return 0;
    *out = strtoll(j->text, NULL, 10);
    return 1;
}

uint64_t json_u64(const json *j) {
    return j && j->type == J_NUM && j->text[0] != '-' ? strtoull(j->text, NULL, 10) : 0;
}

int json_equal(const json *a, const json *b) {
    if (!a || !b || a->type != b->type) return a == b;
    switch (a->type) {
    case J_NULL: return 1;
    case J_BOOL: return a->boolean == b->boolean;
    case J_NUM: return a->num == b->num;
    case J_STR: return !strcmp(a->text, b->text);
    case J_ARR:
        for (a = a->child, b = b->child; a && b; a = a->next, b = b->next)
            if (!json_equal(a, b)) return 0;
        return !a && !b;
    case J_OBJ:
        if (json_len(a) != json_len(b)) return 0;
        for (const json *c = a->child; c; c = c->next)
            if (!json_equal(c, json_get(b, c->key))) return 0;
        return 1;
    }
    return 0;
}
