/* The little JSON the client needs: parse the handshake reply,
 * MELISSA_PARAMETERS and MELISSA_PARAMETER_NAMES (and number variables) into
 * a tree. */
#ifndef MELISSA_DL_JSON_H
#define MELISSA_DL_JSON_H

#include <stdbool.h>
#include <stddef.h>

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_type;

typedef struct json_value {
    json_type type;
    bool boolean;
    double number;
    char *string;               /* JSON_STRING: UTF-8, NUL-terminated */
    size_t size;                /* JSON_ARRAY, JSON_OBJECT: number of items */
    char **keys;                /* JSON_OBJECT: the items' keys */
    struct json_value *items;
} json_value;

/* Parse ``size`` bytes of ``text`` into ``*out``; false (and ``*out`` empty) if
 * it is not one well-formed JSON value or memory ran out. */
bool mdl_json_parse(const char *text, size_t size, json_value *out);
void mdl_json_free(json_value *value);
/* The value of a hexadecimal digit, or -1. */
int mdl_hex_digit(char c);
/* The member ``key`` of an object, or NULL. */
const json_value *mdl_json_get(const json_value *object, const char *key);

#endif
