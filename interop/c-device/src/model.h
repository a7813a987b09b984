/* The device's copy of the global model (docs/protocol.md section 7): named dense float32
 * tensors, changed by the frames that carry meta.model and checked by the protocol 2 digest. */
#ifndef FCL_MODEL_H
#define FCL_MODEL_H

#include "frame.h"

typedef struct {
    int ntensors;
    tensor tensors[MAX_TENSORS]; /* dense: indices NULL, count == numel */
} model;

void model_free(model *m);
/* Apply a frame's tensors (P-7.2) to *m as described by ref (meta.model) into *out (a new
 * model; *m unchanged).  0, or -1 with a message: the caller then fetches the full model.
 * Derived tensors are refused: this device does not derive positions (P-7.7). */
int model_apply(const model *m, const frame *f, const json *ref, model *out, char *err, size_t errlen);
void model_digest(const model *m, char hex[65]); /* P-7.6 */

#endif
