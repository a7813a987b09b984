#ifndef FCL_VECTORS_H
#define FCL_VECTORS_H

#include <stddef.h>
#include <stdint.h>

int check_vectors(const char *dir); /* 0 when every vector in dir passes */
uint8_t *unhex(const char *hex, size_t *n);

#endif
