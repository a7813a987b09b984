/* A small JSON reader (RFC 8259) for frame metadata and the golden vectors (docs/protocol.md
 * rule P-4.5: finite numbers only, unique keys).  Numbers keep their text, so a u64 survives. */
#ifndef FCL_JSON_H
#define FCL_JSON_H

#include <stddef.h>
#include <stdint.h>

enum json_type { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };

typedef struct json {
    enum json_type type;
    int boolean;
    double num;
    char *text;          /* J_STR: the string (UTF-8, NUL-terminated); J_NUM: the number's text */
    char *key;           /* set when this value is a member of an object */
    struct json *child;  /* J_ARR, J_OBJ: first element */
    struct json *next;   /* next sibling */
} json;

/* NULL on error, with a message in err (a static buffer). */
json *json_parse(const char *text, size_t len, const char **err);
void json_free(json *j);
const json *json_get(const json *obj, const char *key);
const json *json_at(const json *arr, size_t i);
size_t json_len(const json *arr);
int json_int(const json *j, int64_t *out);  /* 1 if j is an integer in int64 range */
uint64_t json_u64(const json *j);            /* an unsigned integer's value (0 if none) */
int json_equal(const json *a, const json *b);

#endif
