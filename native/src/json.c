/* A small recursive-descent JSON parser (RFC 8259).
 *
 * Numbers are read in the C locale whatever the simulation set with
 * setlocale, so that "0.5" never becomes 0 under a decimal-comma locale.
 * Nesting is limited to MAX_DEPTH so that hostile input cannot exhaust the
 * stack. */
#define _GNU_SOURCE /* newlocale, uselocale */
#include "json.h"

#include <locale.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64

typedef struct {
    const char *at, *end;
    locale_t c_locale;
} parser;

static bool parse_value(parser *p, json_value *out, int depth);

static void skip_space(parser *p) {
    while (p->at < p->end && (*p->at == ' ' || *p->at == '\t' || *p->at == '\n' || *p->at == '\r'))
        p->at++;
}

static bool literal(parser *p, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(p->end - p->at) < n || memcmp(p->at, word, n) != 0)
        return false;
    p->at += n;
    return true;
}

int mdl_hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool read_hex4(parser *p, uint32_t *code) {
    if (p->end - p->at < 4)
        return false;
    *code = 0;
    for (int i = 0; i < 4; i++) {
        int d = mdl_hex_digit(*p->at++);
        if (d < 0)
            return false;
        *code = *code << 4 | (uint32_t)d;
    }
    return true;
}

static size_t put_utf8(char *out, uint32_t code) {
    if (code < 0x80) {
        out[0] = (char)code;
        return 1;
    }
    if (code < 0x800) {
        out[0] = (char)(0xc0 | code >> 6);
        out[1] = (char)(0x80 | (code & 0x3f));
        return 2;
    }
    if (code < 0x10000) {
        out[0] = (char)(0xe0 | code >> 12);
        out[1] = (char)(0x80 | (code >> 6 & 0x3f));
        out[2] = (char)(0x80 | (code & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | code >> 18);
    out[1] = (char)(0x80 | (code >> 12 & 0x3f));
    out[2] = (char)(0x80 | (code >> 6 & 0x3f));
    out[3] = (char)(0x80 | (code & 0x3f));
    return 4;
}

/* A string after its opening quote; escapes never lengthen the text, so the
 * decoded string fits in as many bytes as the raw one. */
static bool parse_string(parser *p, char **out) {
    const char *start = p->at;
    while (p->at < p->end && *p->at != '"')
        p->at += *p->at == '\\' && p->at + 1 < p->end ? 2 : 1;
    if (p->at >= p->end)
        return false;
    const char *stop = p->at++;
    char *text = malloc((size_t)(stop - start) + 1);
    if (text == NULL)
        return false;
    size_t n = 0;
    parser in = {start, stop, p->c_locale};
    while (in.at < in.end) {
        char c = *in.at++;
        if ((unsigned char)c < 0x20)
            goto bad;
        if (c != '\\') {
            text[n++] = c;
            continue;
        }
        char e = *in.at++;
        const char *plain = strchr("\"\\/bfnrt", e);
        if (e != '\0' && plain != NULL) {
            text[n++] = "\"\\/\b\f\n\r\t"[plain - "\"\\/bfnrt"];
            continue;
        }
        uint32_t code, low;
        if (e != 'u' || !read_hex4(&in, &code))
            goto bad;
        if (code >= 0xd800 && code < 0xdc00) { /* a surrogate pair: \uD83D\uDE00 */
            if (!literal(&in, "\\u") || !read_hex4(&in, &low) || low < 0xdc00 || low >= 0xe000)
                goto bad;
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
        } else if (code >= 0xdc00 && code < 0xe000) {
            goto bad;
        }
        n += put_utf8(text + n, code);
    }
    text[n] = '\0';
    *out = text;
    return true;
bad:
    free(text);
    return false;
}

static bool parse_number(parser *p, json_value *out) {
    const char *start = p->at;
    if (p->at < p->end && *p->at == '-')
        p->at++;
    while (p->at < p->end && strchr("0123456789+-.eE", *p->at) != NULL)
        p->at++;
    size_t n = (size_t)(p->at - start);
    char token[64];
    if (n == 0 || n >= sizeof token)
        return false;
    memcpy(token, start, n);
    token[n] = '\0';
    char *stop;
    locale_t previous = uselocale(p->c_locale);
    out->number = strtod(token, &stop);
    uselocale(previous);
    out->type = JSON_NUMBER;
    return stop == token + n;
}

/* Items of an array or object after its opening bracket, up to ``close``. */
static bool parse_items(parser *p, json_value *out, char close, int depth) {
    bool object = close == '}';
    size_t capacity = 0;
    skip_space(p);
    if (p->at < p->end && *p->at == close) {
        p->at++;
        return true;
    }
    for (;;) {
        if (out->size == capacity) {
            capacity = capacity ? 2 * capacity : 4;
            json_value *items = realloc(out->items, capacity * sizeof *items);
            if (items == NULL)
                return false;
            out->items = items;
            if (object) {
                char **keys = realloc(out->keys, capacity * sizeof *keys);
                if (keys == NULL)
                    return false;
                out->keys = keys;
            }
        }
        skip_space(p);
        if (object) {
            if (p->at >= p->end || *p->at++ != '"' || !parse_string(p, &out->keys[out->size]))
                return false;
            skip_space(p);
            if (p->at >= p->end || *p->at++ != ':') {
                free(out->keys[out->size]);
                return false;
            }
        }
        if (!parse_value(p, &out->items[out->size], depth + 1)) {
            if (object)
                free(out->keys[out->size]);
            return false;
        }
        out->size++;
        skip_space(p);
        if (p->at < p->end && *p->at == ',') {
            p->at++;
            continue;
        }
        return p->at < p->end && *p->at++ == close;
    }
}

static bool parse_value(parser *p, json_value *out, int depth) {
    memset(out, 0, sizeof *out);
    skip_space(p);
    if (p->at >= p->end || depth > MAX_DEPTH)
        return false;
    bool ok;
    switch (*p->at) {
    case '{':
    case '[':
        out->type = *p->at == '{' ? JSON_OBJECT : JSON_ARRAY;
        p->at++;
        ok = parse_items(p, out, out->type == JSON_OBJECT ? '}' : ']', depth);
        break;
    case '"':
        p->at++;
        out->type = JSON_STRING;
        ok = parse_string(p, &out->string);
        break;
    case 't':
    case 'f':
        out->type = JSON_BOOL;
        out->boolean = *p->at == 't';
        ok = literal(p, out->boolean ? "true" : "false");
        break;
    case 'n':
        ok = literal(p, "null");
        break;
    default:
        ok = parse_number(p, out);
    }
    if (!ok)
        mdl_json_free(out);
    return ok;
}

bool mdl_json_parse(const char *text, size_t size, json_value *out) {
    parser p = {text, text + size, newlocale(LC_NUMERIC_MASK, "C", (locale_t)0)};
    if (p.c_locale == (locale_t)0) {
        memset(out, 0, sizeof *out);
        return false;
    }
    bool ok = parse_value(&p, out, 0);
    skip_space(&p);
    if (ok && p.at != p.end) {
        mdl_json_free(out);
        ok = false;
    }
    freelocale(p.c_locale);
    return ok;
}

void mdl_json_free(json_value *value) {
    for (size_t i = 0; i < value->size; i++) {
        mdl_json_free(&value->items[i]);
        if (value->keys != NULL)
            free(value->keys[i]);
    }
    free(value->items);
    free(value->keys);
    free(value->string);
    memset(value, 0, sizeof *value);
}

const json_value *mdl_json_get(const json_value *object, const char *key) {
    if (object->type != JSON_OBJECT)
        return NULL;
    for (size_t i = 0; i < object->size; i++)
        if (strcmp(object->keys[i], key) == 0)
            return &object->items[i];
    return NULL;
}
