/* stg.trace._chakra: the compiled fast path of the trace reader (see stg/trace/decode.py).
 *
 * One streaming decoder for Chakra rank files (v0.0.4 and v0.0.1 protobuf, feeder JSON). It
 * reads varint-framed records from a Python binary stream through a bounded buffer and turns
 * them into stg.core.workload.Node objects (exactly what the pure-Python reference decoder of
 * stg/trace/reader.py builds), or into columns of only the fields a caller needs, or drains
 * them through a compiled copy of the ETFeeder protocol (stg feed's statistics).
 *
 * The decoder handles the canonical encodings. Whenever a record holds anything whose meaning
 * the reference decides in a way this code does not reproduce (unknown fields, wire types
 * other than the schema's, repeated singular sub-messages, invalid UTF-8, malformed varints,
 * values the reference rejects), it stops *before* that record and reports it as "unusual":
 * the caller then hands that record, or the whole file, to the reference decoder. Framing
 * errors (truncated or empty records) are raised as TraceError with the reference's exact
 * message. So the fast path either returns what the reference returns or defers to it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ABI_VERSION 6

/* ------------------------------------------------------------------------------------------ */
/* Module state (set once by setup()).                                                         */

enum {
    NF_ID, NF_NAME, NF_TYPE, NF_DATA, NF_CTRL, NF_NUM_OPS, NF_TENSOR, NF_COMM_TYPE, NF_COMM_SIZE,
    NF_GROUP, NF_SRC, NF_DST, NF_TAG, NF_RUNTIME, NF_CPU, NF_DTYPE, NF_ATTRS, NF_COUNT
};

static PyTypeObject *g_node_type = NULL;
static PyTypeObject *g_attrs_type = NULL;
static Py_ssize_t g_node_off[NF_COUNT];
static Py_ssize_t *g_extra_off = NULL;   /* further Node slots (fields added later) */
static PyObject **g_extra_def = NULL;    /* and their default values */
static Py_ssize_t g_nextra = 0;
static Py_ssize_t g_attrs_off[4];        /* kinds, docs, extras, field_kinds */
static PyObject *g_node_types[8];
static PyObject *g_collectives[10];
static PyObject *g_trace_error = NULL;
static PyObject *g_kind_names[33];       /* AttributeProto field number -> "int64_val", ... */
static PyObject *g_empty_tuple = NULL;
static int g_ready = 0;

/* interned names */
static PyObject *s_is_cpu_op, *s_num_ops, *s_tensor_size, *s_comm_type, *s_comm_size, *s_comm_src,
    *s_comm_dst, *s_comm_tag, *s_dtype, *s_pg_name, *s_start, *s_inputs, *s_outputs,
    *s_tensor_loc, *s_input_tensor_loc, *s_input_tensor_size, *s_output_tensor_loc,
    *s_output_tensor_size, *s_comm_priority, *s_involved_dim, *s_v001_invalid, *s_read, *s_readinto, *s_phase, *s_op,
    *s_string_val, *s_int32_val, *s_uint64_val, *s_bool_list;

/* ------------------------------------------------------------------------------------------ */
/* Small helpers                                                                               */

typedef struct { int64_t *v; Py_ssize_t n, cap; } I64Vec;
typedef struct { int32_t *v; Py_ssize_t n, cap; } I32Vec;
typedef struct { uint8_t *v; Py_ssize_t n, cap; } U8Vec;

static int grow(void **ptr, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *p = PyMem_Realloc(*ptr, (size_t)c * item);
    if (!p) { PyErr_NoMemory(); return -1; }
    *ptr = p;
    *cap = c;
    return 0;
}
#define VEC_PUSH(vec, x) \
    (((vec).n < (vec).cap || grow((void **)&(vec).v, &(vec).cap, (vec).n + 1, sizeof(*(vec).v)) == 0) \
         ? ((vec).v[(vec).n++] = (x), 0) : -1)
#define VEC_FREE(vec) do { PyMem_Free((vec).v); (vec).v = NULL; (vec).n = (vec).cap = 0; } while (0)

/* Varint: 0 ok, -1 runs past the end, -2 unusual (longer than 10 bytes, or a 10th byte > 1). */
static inline int get_varint(const uint8_t **pp, const uint8_t *end, uint64_t *out) {
    const uint8_t *p = *pp;
    if (p < end && !(*p & 0x80)) { *out = *p; *pp = p + 1; return 0; }
    uint64_t v = 0;
    int shift = 0;
    for (int i = 0; i < 10; i++) {
        if (p >= end) return -1;
        uint8_t b = *p++;
        if (i == 9 && b > 1) return -2;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) { *pp = p; *out = v; return 0; }
        shift += 7;
    }
    return -2;
}

/* Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF): what both upb and
 * Python accept. */
static int utf8_ok(const uint8_t *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        /* ASCII, 8 bytes at a time: most names and shapes are */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL) break;
            i += 8;
        }
        if (i >= n) break;
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n) return 0;
            uint8_t c1 = s[i + 1], c2 = s[i + 2];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && c1 < 0xA0) return 0;
            if (c == 0xED && c1 >= 0xA0) return 0;
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n) return 0;
            uint8_t c1 = s[i + 1], c2 = s[i + 2], c3 = s[i + 3];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80 || (c3 & 0xC0) != 0x80) return 0;
            if (c == 0xF0 && c1 < 0x90) return 0;
            if (c == 0xF4 && c1 >= 0x90) return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static inline int name_is(const uint8_t *s, Py_ssize_t n, const char *lit, Py_ssize_t litn) {
    return n == litn && memcmp(s, lit, (size_t)n) == 0;
}
#define NAME_IS(s, n, lit) name_is((s), (n), (lit), (Py_ssize_t)(sizeof(lit) - 1))

/* A Python int from a signed 128-bit value. */
static PyObject *long_from_i128(__int128 v) {
    if (v >= INT64_MIN && v <= INT64_MAX) return PyLong_FromLongLong((long long)v);
    int neg = v < 0;
    unsigned __int128 u = neg ? (unsigned __int128)(-v) : (unsigned __int128)v;
    PyObject *hi = PyLong_FromUnsignedLongLong((unsigned long long)(u >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)u);
    PyObject *sh = PyLong_FromLong(64);
    PyObject *res = NULL, *t = NULL;
    if (hi && lo && sh && (t = PyNumber_Lshift(hi, sh))) res = PyNumber_Or(t, lo);
    Py_XDECREF(t); Py_XDECREF(hi); Py_XDECREF(lo); Py_XDECREF(sh);
    if (res && neg) { PyObject *n = PyNumber_Negative(res); Py_DECREF(res); res = n; }
    return res;
}

/* A 128-bit streaming hash (two independent 64-bit lanes), for rank fingerprints. */
typedef struct { uint64_t a, b; } H128;
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline void h_word(H128 *h, uint64_t w) {
    h->a ^= w;
    h->a *= 0x9E3779B97F4A7C15ULL;
    h->a ^= h->a >> 29;
    h->b += w ^ 0x5bd1e9955bd1e995ULL;
    h->b *= 0xC2B2AE3D27D4EB4FULL;
    h->b = rotl64(h->b, 31);
}
static void h_bytes(H128 *h, const uint8_t *p, Py_ssize_t n) {
    h_word(h, (uint64_t)n ^ 0xA5A5A5A5ULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h_word(h, w);
        p += 8;
        n -= 8;
    }
    if (n) {
        uint64_t w = 0;
        memcpy(&w, p, (size_t)n);
        h_word(h, w ^ ((uint64_t)n << 56));
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Decoded records                                                                             */

/* AttributeProto value kinds are their field numbers: 3 double_val, 4 double_list, ...,
 * 31 bytes_val, 32 bytes_list. */
#define K_DOUBLE 3
#define K_FLOAT 5
#define K_INT32 7
#define K_INT64 9
#define K_UINT32 11
#define K_UINT64 13
#define K_SINT32 15
#define K_SINT64 17
#define K_FIXED32 19
#define K_FIXED64 21
#define K_SFIXED32 23
#define K_SFIXED64 25
#define K_BOOL 27
#define K_STRING 29
#define K_BYTES 31

static int kind_wire(int scalar_kind) {
    switch (scalar_kind) {
    case K_DOUBLE: case K_FIXED64: case K_SFIXED64: return 1;
    case K_FLOAT: case K_FIXED32: case K_SFIXED32: return 5;
    case K_STRING: case K_BYTES: return 2;
    default: return 0;
    }
}
static inline int is_int_kind(int k) {
    return k >= K_INT32 && k <= K_SFIXED64 && (k & 1);
}

typedef struct {
    const uint8_t *name; Py_ssize_t name_len;
    const uint8_t *doc; Py_ssize_t doc_len;
    int kind;                              /* 0 = no value */
    int nval;                              /* value fields seen */
    uint64_t raw;                          /* scalar bits */
    const uint8_t *pay; Py_ssize_t pay_len;  /* string, bytes or list payload */
    Py_ssize_t list_n;                     /* elements of a list */
} Attr;

typedef struct {
    int fmt;                               /* 4 = v0.0.4, 1 = v0.0.1, 2 = json */
    uint64_t id;
    const uint8_t *name; Py_ssize_t name_len; int name_esc;  /* JSON: name has escapes */
    int64_t type;                          /* NodeType (v0.0.4 numbering) */
    I64Vec data, ctrl;
    uint64_t start, dur;
    int io_has[2];
    const uint8_t *io[2][3]; Py_ssize_t io_len[2][3]; int io_esc[2][3];
    Attr *attrs; int nattrs, attrs_cap;
    /* resolved node fields */
    int has_cpu; int cpu; int cpu_kind;
    int wk_has[8]; int wk_kind[8]; int64_t wk_val[8]; int wk_big[8]; uint64_t wk_uval[8];
    int wk_bool[8];
    int comm_type;                         /* -1 = none */
    int has_group; int64_t group; const uint8_t *group_str; Py_ssize_t group_len; int group_big;
    int has_dtype; const uint8_t *dtype; Py_ssize_t dtype_len; int dtype_esc;
    uint8_t *disp; int disp_cap;           /* per attr: 0 field, 1 attrs */
    int special;                           /* validate: a kind or pg_name rule may fire */
    /* v0.0.1 */
    int v1_has[21]; uint64_t v1_val[21];
    I64Vec bools;                          /* involved_dim */
    /* json */
    int js_cpu_given;
} Rec;

/* well-known integer fields, in Rec.wk_* order */
enum { WK_NUM_OPS, WK_TENSOR, WK_COMM_SIZE, WK_SRC, WK_DST, WK_TAG, WK_PRIO, WK_N };

static void rec_free(Rec *r) {
    VEC_FREE(r->data);
    VEC_FREE(r->ctrl);
    VEC_FREE(r->bools);
    PyMem_Free(r->attrs);
    r->attrs = NULL;
    r->attrs_cap = 0;
    PyMem_Free(r->disp);
    r->disp = NULL;
    r->disp_cap = 0;
}

static void rec_reset(Rec *r) {
    r->id = 0; r->name = NULL; r->name_len = 0; r->name_esc = 0; r->type = 0;
    r->data.n = 0; r->ctrl.n = 0; r->bools.n = 0;
    r->start = 0; r->dur = 0;
    r->io_has[0] = r->io_has[1] = 0;
    r->nattrs = 0;
    r->has_cpu = 0; r->cpu = 0; r->cpu_kind = 0;
    memset(r->wk_has, 0, sizeof(r->wk_has));
    memset(r->wk_big, 0, sizeof(r->wk_big));
    memset(r->wk_bool, 0, sizeof(r->wk_bool));
    memset(r->wk_val, 0, sizeof(r->wk_val));
    r->comm_type = -1;
    r->has_group = 0; r->group = 0; r->group_big = 0;
    r->has_dtype = 0; r->dtype_esc = 0;
    r->special = 0;
    r->js_cpu_given = 0;
}

static Attr *rec_new_attr(Rec *r) {
    if (r->nattrs == r->attrs_cap) {
        Py_ssize_t cap = r->attrs_cap;
        if (grow((void **)&r->attrs, &cap, r->nattrs + 1, sizeof(Attr)) < 0) return NULL;
        r->attrs_cap = (int)cap;
    }
    Attr *a = &r->attrs[r->nattrs++];
    memset(a, 0, sizeof(*a));
    return a;
}

/* status codes of the decoders */
#define OK 0
#define UNUSUAL 1
#define FAIL (-1)   /* Python exception set */

/* "y#" of Py_BuildValue turns a NULL pointer into None: empty arrays need a real pointer */
#define PTR(p) ((p) ? (const char *)(p) : "")

/* ------------------------------------------------------------------------------------------ */
/* Protobuf: AttributeProto, IOInfo, Node (v0.0.4)                                             */

static int skip_list(int kind, const uint8_t *p, const uint8_t *end, Py_ssize_t *count) {
    int elem = kind - 1;
    int wire = kind_wire(elem);
    Py_ssize_t n = 0;
    while (p < end) {
        uint64_t key, v;
        if (get_varint(&p, end, &key)) return UNUSUAL;
        if ((key >> 3) != 1) return UNUSUAL;
        int wt = (int)(key & 7);
        if (wt == 2 && wire != 2) { /* packed */
            uint64_t len;
            if (get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            const uint8_t *q = p, *qe = p + len;
            if (wire == 0) {
                while (q < qe) { if (get_varint(&q, qe, &v)) return UNUSUAL; n++; }
            } else {
                Py_ssize_t size = wire == 1 ? 8 : 4;
                if (len % (uint64_t)size) return UNUSUAL;
                n += (Py_ssize_t)(len / (uint64_t)size);
            }
            p = qe;
            continue;
        }
        if (wt != wire) return UNUSUAL;
        if (wire == 0) { if (get_varint(&p, end, &v)) return UNUSUAL; }
        else if (wire == 1) { if (end - p < 8) return UNUSUAL; p += 8; }
        else if (wire == 5) { if (end - p < 4) return UNUSUAL; p += 4; }
        else {
            uint64_t len;
            if (get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            if (elem == K_STRING && !utf8_ok(p, (Py_ssize_t)len)) return UNUSUAL;
            p += len;
        }
        n++;
    }
    *count = n;
    return OK;
}

static int parse_attr(const uint8_t *p, const uint8_t *end, Attr *a) {
    while (p < end) {
        uint64_t key, len;
        if (get_varint(&p, end, &key)) return UNUSUAL;
        int field = (int)(key >> 3), wt = (int)(key & 7);
        if (field == 1 || field == 2) {
            if (wt != 2 || get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            if (!utf8_ok(p, (Py_ssize_t)len)) return UNUSUAL;
            if (field == 1) { a->name = p; a->name_len = (Py_ssize_t)len; }
            else { a->doc = p; a->doc_len = (Py_ssize_t)len; }
            p += len;
            continue;
        }
        if (field < 3 || field > 32) return UNUSUAL;
        int wire = (field & 1) ? kind_wire(field) : 2;
        if (wt != wire) return UNUSUAL;
        a->nval++;
        a->kind = field;
        if (wire == 0) {
            if (get_varint(&p, end, &a->raw)) return UNUSUAL;
        } else if (wire == 1) {
            if (end - p < 8) return UNUSUAL;
            memcpy(&a->raw, p, 8);
            p += 8;
        } else if (wire == 5) {
            uint32_t w;
            if (end - p < 4) return UNUSUAL;
            memcpy(&w, p, 4);
            a->raw = w;
            p += 4;
        } else {
            if (get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            a->pay = p;
            a->pay_len = (Py_ssize_t)len;
            if (field == K_STRING && !utf8_ok(p, (Py_ssize_t)len)) return UNUSUAL;
            if (!(field & 1) && skip_list(field, p, p + len, &a->list_n) != OK) return UNUSUAL;
            p += len;
        }
    }
    return a->nval == 1 ? OK : UNUSUAL;
}

static int parse_io(Rec *r, int which, const uint8_t *p, const uint8_t *end) {
    if (r->io_has[which]) return UNUSUAL; /* a second IOInfo merges into the first */
    r->io_has[which] = 1;
    for (int i = 0; i < 3; i++) { r->io[which][i] = NULL; r->io_len[which][i] = 0; r->io_esc[which][i] = 0; }
    while (p < end) {
        uint64_t key, len;
        if (get_varint(&p, end, &key)) return UNUSUAL;
        int field = (int)(key >> 3);
        if ((key & 7) != 2 || field < 1 || field > 3) return UNUSUAL;
        if (get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
        if (!utf8_ok(p, (Py_ssize_t)len)) return UNUSUAL;
        r->io[which][field - 1] = p;
        r->io_len[which][field - 1] = (Py_ssize_t)len;
        p += len;
    }
    return OK;
}

static int push_deps(I64Vec *vec, int wt, const uint8_t **pp, const uint8_t *end) {
    uint64_t v;
    if (wt == 0) {
        if (get_varint(pp, end, &v)) return UNUSUAL;
        return VEC_PUSH(*vec, (int64_t)v) < 0 ? FAIL : OK;
    }
    if (wt != 2) return UNUSUAL;
    uint64_t len;
    if (get_varint(pp, end, &len) || len > (uint64_t)(end - *pp)) return UNUSUAL;
    const uint8_t *q = *pp, *qe = q + len;
    while (q < qe) {
        if (get_varint(&q, qe, &v)) return UNUSUAL;
        if (VEC_PUSH(*vec, (int64_t)v) < 0) return FAIL;
    }
    *pp = qe;
    return OK;
}

/* Parse one v0.0.4 Node record. With h, feed the record (less the values of pg_name, comm_src
 * and comm_dst) into the rank's fingerprint. */
static int parse_v004(Rec *r, const uint8_t *p, const uint8_t *end, H128 *h) {
    rec_reset(r);
    r->fmt = 4;
    int rc;
    while (p < end) {
        const uint8_t *fstart = p;
        uint64_t key, v, len;
        if (get_varint(&p, end, &key)) return UNUSUAL;
        int field = (int)(key >> 3), wt = (int)(key & 7);
        switch (field) {
        case 1: case 3: case 6: case 7:
            if (wt != 0 || get_varint(&p, end, &v)) return UNUSUAL;
            if (field == 1) r->id = v;
            else if (field == 3) r->type = (int64_t)(int32_t)(uint32_t)v;
            else if (field == 6) r->start = v;
            else r->dur = v;
            break;
        case 2:
            if (wt != 2 || get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            if (!utf8_ok(p, (Py_ssize_t)len)) return UNUSUAL;
            r->name = p;
            r->name_len = (Py_ssize_t)len;
            p += len;
            break;
        case 4: case 5:
            rc = push_deps(field == 4 ? &r->ctrl : &r->data, wt, &p, end);
            if (rc != OK) return rc;
            break;
        case 8: case 9:
            if (wt != 2 || get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            if (parse_io(r, field - 8, p, p + len) != OK) return UNUSUAL;
            p += len;
            break;
        case 10: {
            if (wt != 2 || get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            Attr *a = rec_new_attr(r);
            if (!a) return FAIL;
            if (parse_attr(p, p + len, a) != OK) return UNUSUAL;
            p += len;
            if (h && (NAME_IS(a->name, a->name_len, "pg_name") ||
                      NAME_IS(a->name, a->name_len, "comm_src") ||
                      NAME_IS(a->name, a->name_len, "comm_dst"))) {
                h_word(h, 0xC0FFEEULL + (uint64_t)a->kind);
                h_bytes(h, a->name, a->name_len);
                continue;
            }
            break;
        }
        default:
            return UNUSUAL;
        }
        if (h) h_bytes(h, fstart, p - fstart);
    }
    if (h) h_word(h, 0x7265636F7264ULL); /* record separator */
    return OK;
}

/* Python value of an integer-kind scalar: signed value, or unsigned above INT64_MAX (big). */
static void int_value(int kind, uint64_t raw, int64_t *sv, uint64_t *uv, int *big) {
    *big = 0;
    switch (kind) {
    case K_INT32: case K_SFIXED32: *sv = (int32_t)(uint32_t)raw; break;
    case K_UINT32: case K_FIXED32: *sv = (int64_t)(uint32_t)raw; break;
    case K_SINT32: {
        uint32_t n = (uint32_t)raw;
        *sv = (int32_t)((n >> 1) ^ (uint32_t)(-(int32_t)(n & 1)));
        break;
    }
    case K_SINT64: *sv = (int64_t)((raw >> 1) ^ (uint64_t)(-(int64_t)(raw & 1))); break;
    case K_UINT64: case K_FIXED64:
        if (raw > (uint64_t)INT64_MAX) { *big = 1; *uv = raw; *sv = 0; }
        else *sv = (int64_t)raw;
        break;
    case K_BOOL: *sv = raw != 0; break;
    default: *sv = (int64_t)raw; break; /* int64, sfixed64 */
    }
}

/* The node fields of a v0.0.4 record (the attribute mapping of reader._node_from_v004).
 * UNUSUAL where the reference raises. */
static int resolve_v004(Rec *r) {
    if (r->type < 0 || r->type > 7) return UNUSUAL;
    if (r->nattrs > 256) return UNUSUAL;
    if (r->disp_cap < r->nattrs) {
        Py_ssize_t cap = r->disp_cap;
        if (grow((void **)&r->disp, &cap, r->nattrs, 1) < 0) return FAIL;
        r->disp_cap = (int)cap;
    }
    for (int i = 0; i < r->nattrs; i++) {
        Attr *a = &r->attrs[i];
        for (int j = 0; j < i; j++) {
            if (r->attrs[j].name_len == a->name_len &&
                memcmp(r->attrs[j].name, a->name, (size_t)a->name_len) == 0)
                return UNUSUAL; /* repeats an attribute */
        }
        const uint8_t *nm = a->name;
        Py_ssize_t nl = a->name_len;
        int k = a->kind;
        int wk = -1;
        int cpu = 0, ctype = 0;
        if (NAME_IS(nm, nl, "is_cpu_op")) cpu = 1;
        else if (NAME_IS(nm, nl, "comm_type")) ctype = 1;
        else if (NAME_IS(nm, nl, "num_ops")) wk = WK_NUM_OPS;
        else if (NAME_IS(nm, nl, "tensor_size")) wk = WK_TENSOR;
        else if (NAME_IS(nm, nl, "comm_size")) wk = WK_COMM_SIZE;
        else if (NAME_IS(nm, nl, "comm_src")) wk = WK_SRC;
        else if (NAME_IS(nm, nl, "comm_dst")) wk = WK_DST;
        else if (NAME_IS(nm, nl, "comm_tag")) wk = WK_TAG;
        if (cpu || ctype || wk >= 0) {
            if (!is_int_kind(k) && k != K_BOOL) return UNUSUAL;
            int64_t sv; uint64_t uv; int big;
            int_value(k, a->raw, &sv, &uv, &big);
            r->disp[i] = 0;
            if (cpu) {
                r->has_cpu = 1;
                r->cpu = big ? 1 : sv != 0;
                r->cpu_kind = k;
                if (k != K_BOOL) r->special = 1;
            } else if (ctype) {
                if (big || sv < 0 || sv > 9) return UNUSUAL;
                r->comm_type = (int)sv;
                if (k != K_INT64) r->special = 1;
            } else {
                r->wk_has[wk] = 1;
                r->wk_kind[wk] = k;
                r->wk_val[wk] = sv;
                r->wk_uval[wk] = uv;
                r->wk_big[wk] = big;
                r->wk_bool[wk] = k == K_BOOL;
                int expected = wk == WK_TENSOR ? K_UINT64
                               : (wk == WK_NUM_OPS || wk == WK_COMM_SIZE) ? K_INT64 : K_INT32;
                if (k != expected) r->special = 1;
            }
            continue;
        }
        if (NAME_IS(nm, nl, "dtype") && k == K_STRING) {
            r->disp[i] = 0;
            r->has_dtype = 1;
            r->dtype = a->pay;
            r->dtype_len = a->pay_len;
            continue;
        }
        if (NAME_IS(nm, nl, "pg_name") && k == K_STRING && a->pay_len > 0) {
            int digits = 1;
            for (Py_ssize_t j = 0; j < a->pay_len; j++)
                if (a->pay[j] < '0' || a->pay[j] > '9') { digits = 0; break; }
            if (digits) {
                r->disp[i] = 0;
                r->has_group = 1;
                r->group_str = a->pay;
                r->group_len = a->pay_len;
                /* leading zeros do not count towards the size */
                Py_ssize_t j = 0;
                while (j < a->pay_len - 1 && a->pay[j] == '0') j++;
                if (a->pay_len - j > 18) { r->group_big = 1; r->group = 0; }
                else {
                    int64_t g = 0;
                    for (; j < a->pay_len; j++) g = g * 10 + (a->pay[j] - '0');
                    r->group = g;
                }
                continue;
            }
        }
        r->disp[i] = 1;
        if (NAME_IS(nm, nl, "pg_name")) r->special = 1;
        else if (NAME_IS(nm, nl, "comm_priority") && k != K_INT32) r->special = 1;
        else if (NAME_IS(nm, nl, "involved_dim") && k != K_BOOL + 1) r->special = 1;
    }
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Protobuf: Node (v0.0.1, proto2)                                                             */

/* field -> 0 not a field, 1 uint64, 2 uint32, 3 enum (max in v1_enum_max), 4 string,
 * 5 repeated uint64, 6 repeated bool */
static const int v1_field_kind[21] = {0, 1, 4, 3, 5, 3, 1, 1, 3, 1, 3, 1, 1, 3, 6, 2, 2, 2, 1, 2, 2};
static const int v1_enum_max[21] = {0, 0, 0, 6, 0, 2, 0, 0, 2, 0, 2, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0};
static const int v1_types[7] = {0, 2, 3, 4, 5, 6, 7};          /* v0.0.1 -> v0.0.4 NodeType */
static const int v1_colls[5] = {-1, 0, 6, 2, 7};               /* v0.0.1 -> CollectiveType */

static int parse_v001(Rec *r, const uint8_t *p, const uint8_t *end, H128 *h) {
    rec_reset(r);
    r->fmt = 1;
    memset(r->v1_has, 0, sizeof(r->v1_has));
    memset(r->v1_val, 0, sizeof(r->v1_val));
    while (p < end) {
        const uint8_t *fstart = p;
        uint64_t key, v, len;
        if (get_varint(&p, end, &key)) return UNUSUAL;
        uint64_t f = key >> 3;
        int wt = (int)(key & 7);
        if (f < 1 || f > 20) return UNUSUAL;
        int field = (int)f, kind = v1_field_kind[field];
        int hashed_value = !(field == 15 || field == 16 || field == 17);
        if (kind == 4) {
            if (wt != 2 || get_varint(&p, end, &len) || len > (uint64_t)(end - p)) return UNUSUAL;
            if (!utf8_ok(p, (Py_ssize_t)len)) return UNUSUAL;
            r->name = p;
            r->name_len = (Py_ssize_t)len;
            p += len;
        } else if (kind == 5 || kind == 6) {
            I64Vec *vec = kind == 5 ? &r->data : &r->bools;
            int rc = push_deps(vec, wt, &p, end);
            if (rc != OK) return rc;
        } else {
            if (wt != 0 || get_varint(&p, end, &v)) return UNUSUAL;
            if (kind == 3 && v > (uint64_t)v1_enum_max[field]) return UNUSUAL;
            if (kind == 2) v = (uint32_t)v;
            r->v1_val[field] = v;
        }
        r->v1_has[field] = 1;
        if (h) {
            if (hashed_value) h_bytes(h, fstart, p - fstart);
            else h_word(h, 0xC0FFEEULL + (uint64_t)field);
        }
    }
    if (h) h_word(h, 0x7265636F7264ULL);
    if (!r->v1_has[1] || !r->v1_has[2]) return UNUSUAL; /* required fields */
    r->id = r->v1_val[1];
    r->type = v1_types[r->v1_val[3]];
    r->dur = r->v1_val[7];
    if (r->v1_has[13]) r->comm_type = v1_colls[r->v1_val[13]];
    r->wk_has[WK_NUM_OPS] = 1; r->wk_val[WK_NUM_OPS] = (int64_t)r->v1_val[12];
    r->wk_big[WK_NUM_OPS] = r->v1_val[12] > (uint64_t)INT64_MAX; r->wk_uval[WK_NUM_OPS] = r->v1_val[12];
    r->wk_has[WK_TENSOR] = 1; r->wk_val[WK_TENSOR] = (int64_t)r->v1_val[6];
    r->wk_big[WK_TENSOR] = r->v1_val[6] > (uint64_t)INT64_MAX; r->wk_uval[WK_TENSOR] = r->v1_val[6];
    r->wk_has[WK_COMM_SIZE] = 1; r->wk_val[WK_COMM_SIZE] = (int64_t)r->v1_val[18];
    r->wk_big[WK_COMM_SIZE] = r->v1_val[18] > (uint64_t)INT64_MAX; r->wk_uval[WK_COMM_SIZE] = r->v1_val[18];
    if (r->v1_has[15]) { r->has_group = 1; r->group = (int64_t)r->v1_val[15]; }
    r->wk_has[WK_SRC] = r->v1_has[16]; r->wk_val[WK_SRC] = (int64_t)r->v1_val[16];
    r->wk_has[WK_DST] = r->v1_has[17]; r->wk_val[WK_DST] = (int64_t)r->v1_val[17];
    r->wk_has[WK_TAG] = r->v1_has[19]; r->wk_val[WK_TAG] = (int64_t)r->v1_val[19];
    if (r->dur > (uint64_t)INT64_MAX || r->id > (uint64_t)INT64_MAX) { /* fine for objects */ }
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Building Python objects                                                                     */

static inline void set_slot(PyObject *obj, Py_ssize_t off, PyObject *value) {
    /* value: a new reference, stolen */
    PyObject **slot = (PyObject **)((char *)obj + off);
    PyObject *old = *slot;
    *slot = value;
    Py_XDECREF(old);
}

static PyObject *new_attrs(void) {
    PyObject *attrs = PyDict_Type.tp_new(g_attrs_type, g_empty_tuple, NULL);
    if (!attrs) return NULL;
    for (int i = 0; i < 4; i++) {
        PyObject *d = PyDict_New();
        if (!d) { Py_DECREF(attrs); return NULL; }
        set_slot(attrs, g_attrs_off[i], d);
    }
    return attrs;
}
#define ATTRS_KINDS(a) (*(PyObject **)((char *)(a) + g_attrs_off[0]))
#define ATTRS_DOCS(a) (*(PyObject **)((char *)(a) + g_attrs_off[1]))
#define ATTRS_EXTRAS(a) (*(PyObject **)((char *)(a) + g_attrs_off[2]))
#define ATTRS_FIELD_KINDS(a) (*(PyObject **)((char *)(a) + g_attrs_off[3]))

static int dict_set_steal(PyObject *d, PyObject *k, PyObject *v) {
    if (!v) return -1;
    int rc = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    return rc;
}

/* Tuples of ints, floats, strings and bytes cannot be part of a reference cycle: untrack them
 * at once (what CPython's collector does to them later anyway), so that decoding millions of
 * nodes does not make the cyclic collector run over them. */
static inline PyObject *untracked(PyObject *t) {
    if (t && PyObject_GC_IsTracked(t)) PyObject_GC_UnTrack(t);
    return t;
}

static PyObject *deps_tuple(const I64Vec *vec, int is_unsigned) {
    if (vec->n == 0) { Py_INCREF(g_empty_tuple); return g_empty_tuple; }
    PyObject *t = PyTuple_New(vec->n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < vec->n; i++) {
        PyObject *x = is_unsigned ? PyLong_FromUnsignedLongLong((uint64_t)vec->v[i])
                                  : PyLong_FromLongLong(vec->v[i]);
        if (!x) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, x);
    }
    return untracked(t);
}

/* Attribute names, decoded once: a small direct-mapped cache of str objects by their bytes. */
#define NAME_CACHE 512
static struct { Py_ssize_t n; char bytes[48]; PyObject *obj; } g_names[NAME_CACHE];

static PyObject *name_obj(const uint8_t *p, Py_ssize_t n) {
    if (n > 48) return PyUnicode_DecodeUTF8((const char *)p, n, NULL);
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    size_t slot = (size_t)(h ^ (h >> 29)) & (NAME_CACHE - 1);
    if (g_names[slot].obj && g_names[slot].n == n && !memcmp(g_names[slot].bytes, p, (size_t)n)) {
        Py_INCREF(g_names[slot].obj);
        return g_names[slot].obj;
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, NULL);
    if (!s) return NULL;
    Py_XSETREF(g_names[slot].obj, s);
    Py_INCREF(s);
    g_names[slot].n = n;
    memcpy(g_names[slot].bytes, p, (size_t)n);
    return s;
}

static PyObject *str_from(const uint8_t *p, Py_ssize_t n) {
    return PyUnicode_DecodeUTF8((const char *)p, n, NULL);
}

static PyObject *scalar_value(int kind, uint64_t raw, const uint8_t *pay, Py_ssize_t pay_len) {
    switch (kind) {
    case K_DOUBLE: { double d; memcpy(&d, &raw, 8); return PyFloat_FromDouble(d); }
    case K_FLOAT: { uint32_t w = (uint32_t)raw; float f; memcpy(&f, &w, 4); return PyFloat_FromDouble((double)f); }
    case K_BOOL: return PyBool_FromLong(raw != 0);
    case K_STRING: return str_from(pay, pay_len);
    case K_BYTES: return PyBytes_FromStringAndSize((const char *)pay, pay_len);
    default: {
        int64_t sv; uint64_t uv; int big;
        int_value(kind, raw, &sv, &uv, &big);
        return big ? PyLong_FromUnsignedLongLong(uv) : PyLong_FromLongLong(sv);
    }
    }
}

static PyObject *list_value(int kind, const uint8_t *p, const uint8_t *end, Py_ssize_t n) {
    int elem = kind - 1, wire = kind_wire(elem);
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    Py_ssize_t i = 0;
    while (p < end) {
        uint64_t key = 0, v = 0, len = 0;
        get_varint(&p, end, &key);
        int wt = (int)(key & 7);
        if (wt == 2 && wire != 2) {
            get_varint(&p, end, &len);
            const uint8_t *q = p, *qe = p + len;
            while (q < qe) {
                if (wire == 0) get_varint(&q, qe, &v);
                else if (wire == 1) { memcpy(&v, q, 8); q += 8; }
                else { uint32_t w; memcpy(&w, q, 4); v = w; q += 4; }
                PyObject *x = scalar_value(elem, v, NULL, 0);
                if (!x) { Py_DECREF(t); return NULL; }
                PyTuple_SET_ITEM(t, i++, x);
            }
            p = qe;
            continue;
        }
        PyObject *x;
        if (wire == 0) { get_varint(&p, end, &v); x = scalar_value(elem, v, NULL, 0); }
        else if (wire == 1) { memcpy(&v, p, 8); p += 8; x = scalar_value(elem, v, NULL, 0); }
        else if (wire == 5) { uint32_t w; memcpy(&w, p, 4); p += 4; x = scalar_value(elem, w, NULL, 0); }
        else { get_varint(&p, end, &len); x = scalar_value(elem, 0, p, (Py_ssize_t)len); p += len; }
        if (!x) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i++, x);
    }
    return t;
}

static PyObject *attr_value(const Attr *a) {
    if (a->kind & 1) return scalar_value(a->kind, a->raw, a->pay, a->pay_len);
    return untracked(list_value(a->kind, a->pay, a->pay + a->pay_len, a->list_n));
}

static PyObject *int_obj(const Rec *r, int wk) {
    if (r->wk_bool[wk]) return PyBool_FromLong(r->wk_val[wk] != 0);
    if (r->wk_big[wk]) return PyLong_FromUnsignedLongLong(r->wk_uval[wk]);
    return PyLong_FromLongLong(r->wk_val[wk]);
}

static PyObject *opt_int(const Rec *r, int wk) {
    if (!r->wk_has[wk]) Py_RETURN_NONE;
    return int_obj(r, wk);
}

static PyObject *io_tuple(const Rec *r, int which) {
    PyObject *t = PyTuple_New(3);
    if (!t) return NULL;
    for (int i = 0; i < 3; i++) {
        PyObject *s = str_from(r->io[which][i] ? r->io[which][i] : (const uint8_t *)"", r->io_len[which][i]);
        if (!s) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, s);
    }
    return untracked(t);
}

/* reader._imply_op: a node with an integer phase attribute and no op attribute runs the op
 * named after the last '/' of its name (the writers leave that op out). */
static int imply_op(PyObject *attrs, PyObject *name) {
    if (!name) return 0; /* the caller fails on the missing name */
    PyObject *phase = PyDict_GetItemWithError(attrs, s_phase);
    if (!phase) return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_CheckExact(phase)) return 0;
    int has = PyDict_Contains(attrs, s_op);
    if (has != 0) return has < 0 ? -1 : 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);
    Py_ssize_t slash = PyUnicode_FindChar(name, '/', 0, n, -1);
    if (slash == -2) return -1;
    if (dict_set_steal(attrs, s_op, PyUnicode_Substring(name, slash + 1, n)) < 0) return -1;
    return PyDict_SetItem(ATTRS_KINDS(attrs), s_op, s_string_val);
}

static PyObject *make_node(PyObject *vals[NF_COUNT]) {
    /* vals: new references, stolen (also on failure) */
    PyObject *node = g_node_type->tp_alloc(g_node_type, 0);
    if (!node) {
        for (int i = 0; i < NF_COUNT; i++) Py_XDECREF(vals[i]);
        return NULL;
    }
    for (int i = 0; i < NF_COUNT; i++) set_slot(node, g_node_off[i], vals[i]);
    for (Py_ssize_t i = 0; i < g_nextra; i++) {
        Py_INCREF(g_extra_def[i]);
        set_slot(node, g_extra_off[i], g_extra_def[i]);
    }
    return node;
}

static PyObject *node_v004(Rec *r) {
    PyObject *vals[NF_COUNT] = {0};
    PyObject *attrs = new_attrs();
    if (!attrs) return NULL;
    PyObject *fk = ATTRS_FIELD_KINDS(attrs), *kinds = ATTRS_KINDS(attrs), *docs = ATTRS_DOCS(attrs);
    for (int i = 0; i < r->nattrs; i++) {
        Attr *a = &r->attrs[i];
        PyObject *name = name_obj(a->name, a->name_len);
        if (!name) goto fail;
        int rc;
        if (r->disp[i] == 0) {
            rc = PyDict_SetItem(fk, name, g_kind_names[a->kind]);
        } else {
            rc = dict_set_steal(attrs, name, attr_value(a));
            if (rc == 0) rc = PyDict_SetItem(kinds, name, g_kind_names[a->kind]);
            if (rc == 0 && a->doc_len) rc = dict_set_steal(docs, name, str_from(a->doc, a->doc_len));
        }
        Py_DECREF(name);
        if (rc < 0) goto fail;
    }
    PyObject *extras = ATTRS_EXTRAS(attrs);
    if (r->start && dict_set_steal(extras, s_start, PyLong_FromUnsignedLongLong(r->start)) < 0) goto fail;
    if (r->io_has[0] && dict_set_steal(extras, s_inputs, io_tuple(r, 0)) < 0) goto fail;
    if (r->io_has[1] && dict_set_steal(extras, s_outputs, io_tuple(r, 1)) < 0) goto fail;
    vals[NF_ID] = PyLong_FromUnsignedLongLong(r->id);
    vals[NF_NAME] = str_from(r->name ? r->name : (const uint8_t *)"", r->name_len);
    Py_INCREF(g_node_types[r->type]);
    vals[NF_TYPE] = g_node_types[r->type];
    vals[NF_DATA] = deps_tuple(&r->data, 1);
    vals[NF_CTRL] = deps_tuple(&r->ctrl, 1);
    vals[NF_NUM_OPS] = r->wk_has[WK_NUM_OPS] ? int_obj(r, WK_NUM_OPS) : PyLong_FromLong(0);
    vals[NF_TENSOR] = r->wk_has[WK_TENSOR] ? int_obj(r, WK_TENSOR) : PyLong_FromLong(0);
    if (r->comm_type >= 0) { Py_INCREF(g_collectives[r->comm_type]); vals[NF_COMM_TYPE] = g_collectives[r->comm_type]; }
    else { Py_INCREF(Py_None); vals[NF_COMM_TYPE] = Py_None; }
    vals[NF_COMM_SIZE] = r->wk_has[WK_COMM_SIZE] ? int_obj(r, WK_COMM_SIZE) : PyLong_FromLong(0);
    if (r->has_group) {
        if (r->group_big) {
            PyObject *s = PyUnicode_FromStringAndSize((const char *)r->group_str, r->group_len);
            vals[NF_GROUP] = s ? PyLong_FromUnicodeObject(s, 10) : NULL;
            Py_XDECREF(s);
        } else {
            vals[NF_GROUP] = PyLong_FromLongLong(r->group);
        }
    } else { Py_INCREF(Py_None); vals[NF_GROUP] = Py_None; }
    vals[NF_SRC] = opt_int(r, WK_SRC);
    vals[NF_DST] = opt_int(r, WK_DST);
    vals[NF_TAG] = opt_int(r, WK_TAG);
    vals[NF_RUNTIME] = PyLong_FromUnsignedLongLong(r->dur);
    vals[NF_CPU] = PyBool_FromLong(r->cpu);
    if (r->has_dtype) vals[NF_DTYPE] = str_from(r->dtype, r->dtype_len);
    else { Py_INCREF(Py_None); vals[NF_DTYPE] = Py_None; }
    vals[NF_ATTRS] = attrs;
    if (imply_op(attrs, vals[NF_NAME]) < 0) {
        for (int j = 0; j < NF_COUNT; j++) Py_XDECREF(vals[j]);
        return NULL;
    }
    for (int i = 0; i < NF_COUNT; i++) {
        if (!vals[i]) {
            for (int j = 0; j < NF_COUNT; j++) Py_XDECREF(vals[j]);
            return NULL;
        }
    }
    return make_node(vals);
fail:
    Py_DECREF(attrs);
    return NULL;
}

static const int v1_extra_fields[6] = {5, 8, 9, 10, 11, 20};

static PyObject *node_v001(Rec *r) {
    PyObject *vals[NF_COUNT] = {0};
    PyObject *attrs = new_attrs();
    if (!attrs) return NULL;
    PyObject *kinds = ATTRS_KINDS(attrs);
    PyObject *names[6] = {s_tensor_loc, s_input_tensor_loc, s_input_tensor_size,
                          s_output_tensor_loc, s_output_tensor_size, s_comm_priority};
    for (int i = 0; i < 6; i++) {
        int f = v1_extra_fields[i];
        if (!r->v1_has[f]) continue;
        if (dict_set_steal(attrs, names[i], PyLong_FromUnsignedLongLong(r->v1_val[f])) < 0) goto fail;
        PyObject *kind = (f == 9 || f == 11) ? s_uint64_val : s_int32_val;
        if (PyDict_SetItem(kinds, names[i], kind) < 0) goto fail;
    }
    if (r->bools.n) {
        PyObject *t = PyTuple_New(r->bools.n);
        if (!t) goto fail;
        for (Py_ssize_t i = 0; i < r->bools.n; i++) {
            PyObject *b = PyBool_FromLong(r->bools.v[i] != 0);
            PyTuple_SET_ITEM(t, i, b);
        }
        if (dict_set_steal(attrs, s_involved_dim, untracked(t)) < 0) goto fail;
        if (PyDict_SetItem(kinds, s_involved_dim, s_bool_list) < 0) goto fail;
    }
    if (r->v1_has[13] && r->comm_type < 0) {
        if (PyDict_SetItem(ATTRS_EXTRAS(attrs), s_v001_invalid, Py_True) < 0) goto fail;
    }
    vals[NF_ID] = PyLong_FromUnsignedLongLong(r->id);
    vals[NF_NAME] = str_from(r->name, r->name_len);
    Py_INCREF(g_node_types[r->type]);
    vals[NF_TYPE] = g_node_types[r->type];
    vals[NF_DATA] = deps_tuple(&r->data, 1);
    Py_INCREF(g_empty_tuple);
    vals[NF_CTRL] = g_empty_tuple;
    vals[NF_NUM_OPS] = PyLong_FromUnsignedLongLong(r->v1_val[12]);
    vals[NF_TENSOR] = PyLong_FromUnsignedLongLong(r->v1_val[6]);
    if (r->comm_type >= 0) { Py_INCREF(g_collectives[r->comm_type]); vals[NF_COMM_TYPE] = g_collectives[r->comm_type]; }
    else { Py_INCREF(Py_None); vals[NF_COMM_TYPE] = Py_None; }
    vals[NF_COMM_SIZE] = PyLong_FromUnsignedLongLong(r->v1_val[18]);
    if (r->v1_has[15]) vals[NF_GROUP] = PyLong_FromUnsignedLongLong(r->v1_val[15]);
    else { Py_INCREF(Py_None); vals[NF_GROUP] = Py_None; }
    vals[NF_SRC] = opt_int(r, WK_SRC);
    vals[NF_DST] = opt_int(r, WK_DST);
    vals[NF_TAG] = opt_int(r, WK_TAG);
    vals[NF_RUNTIME] = PyLong_FromUnsignedLongLong(r->dur);
    Py_INCREF(Py_False);
    vals[NF_CPU] = Py_False;
    Py_INCREF(Py_None);
    vals[NF_DTYPE] = Py_None;
    vals[NF_ATTRS] = attrs;
    for (int i = 0; i < NF_COUNT; i++) {
        if (!vals[i]) {
            for (int j = 0; j < NF_COUNT; j++) Py_XDECREF(vals[j]);
            return NULL;
        }
    }
    return make_node(vals);
fail:
    Py_DECREF(attrs);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Feeder JSON ({"workload_graph": [...]})                                                     */

static inline void js_ws(const uint8_t **pp, const uint8_t *end) {
    const uint8_t *p = *pp;
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    *pp = p;
}

static inline int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A JSON string at *pp (which points at the opening quote): its raw body and whether it holds
 * escapes. Rejects (UNUSUAL) what Python's json rejects or what we do not decode: control
 * characters, invalid escapes, invalid UTF-8. */
static int js_string(const uint8_t **pp, const uint8_t *end, const uint8_t **s, Py_ssize_t *n,
                     int *esc) {
    const uint8_t *p = *pp;
    if (p >= end || *p != '"') return UNUSUAL;
    p++;
    const uint8_t *start = p;
    int e = 0, ascii = 1;
    while (1) {
        /* 8 bytes at a time past plain ASCII (no quote, backslash, control or high byte) */
        while (end - p >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
            uint64_t q = w ^ (ones * '"'), b = w ^ (ones * '\\');
            uint64_t hit = ((q - ones) & ~q) | ((b - ones) & ~b) | (w - ones * 0x20) | w;
            if (hit & high) break;
            p += 8;
        }
        if (p >= end) return UNUSUAL;
        uint8_t c = *p;
        if (c == '"') break;
        if (c < 0x20) return UNUSUAL;
        if (c == '\\') {
            e = 1;
            if (p + 1 >= end) return UNUSUAL;
            uint8_t d = p[1];
            if (d == 'u') {
                if (p + 6 > end) return UNUSUAL;
                for (int i = 2; i < 6; i++) if (hexval(p[i]) < 0) return UNUSUAL;
                uint32_t cp = (uint32_t)((hexval(p[2]) << 12) | (hexval(p[3]) << 8) |
                                         (hexval(p[4]) << 4) | hexval(p[5]));
                p += 6;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return UNUSUAL; /* a lone low surrogate */
                if (cp >= 0xD800 && cp <= 0xDBFF) {               /* needs its low half */
                    if (p + 6 > end || p[0] != '\\' || p[1] != 'u') return UNUSUAL;
                    for (int i = 2; i < 6; i++) if (hexval(p[i]) < 0) return UNUSUAL;
                    uint32_t lo = (uint32_t)((hexval(p[2]) << 12) | (hexval(p[3]) << 8) |
                                             (hexval(p[4]) << 4) | hexval(p[5]));
                    if (lo < 0xDC00 || lo > 0xDFFF) return UNUSUAL;
                    p += 6;
                }
            } else if (d == '"' || d == '\\' || d == '/' || d == 'b' || d == 'f' || d == 'n' ||
                       d == 'r' || d == 't') {
                p += 2;
            } else {
                return UNUSUAL;
            }
            continue;
        }
        if (c >= 0x80) ascii = 0;
        p++;
    }
    if (!ascii && !utf8_ok(start, p - start)) return UNUSUAL;
    *s = start;
    *n = p - start;
    *esc = e;
    *pp = p + 1;
    return OK;
}

/* The Python str of a JSON string body with escapes (lone surrogates: UNUSUAL via NULL with no
 * exception set). */
static PyObject *js_unescape(const uint8_t *s, Py_ssize_t n, int esc) {
    if (!esc) return str_from(s, n);
    uint8_t *out = PyMem_Malloc((size_t)n + 4);
    if (!out) return PyErr_NoMemory();
    Py_ssize_t o = 0, i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c != '\\') { out[o++] = c; i++; continue; }
        uint8_t d = s[i + 1];
        if (d != 'u') {
            out[o++] = d == 'b' ? '\b' : d == 'f' ? '\f' : d == 'n' ? '\n' : d == 'r' ? '\r'
                       : d == 't' ? '\t' : d;
            i += 2;
            continue;
        }
        uint32_t cp = (uint32_t)((hexval(s[i + 2]) << 12) | (hexval(s[i + 3]) << 8) |
                                 (hexval(s[i + 4]) << 4) | hexval(s[i + 5]));
        i += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF && i + 6 <= n && s[i] == '\\' && s[i + 1] == 'u') {
            uint32_t lo = (uint32_t)((hexval(s[i + 2]) << 12) | (hexval(s[i + 3]) << 8) |
                                     (hexval(s[i + 4]) << 4) | hexval(s[i + 5]));
            if (lo >= 0xDC00 && lo <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            }
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) { PyMem_Free(out); return NULL; } /* lone surrogate */
        if (cp < 0x80) out[o++] = (uint8_t)cp;
        else if (cp < 0x800) { out[o++] = (uint8_t)(0xC0 | (cp >> 6)); out[o++] = (uint8_t)(0x80 | (cp & 0x3F)); }
        else if (cp < 0x10000) {
            out[o++] = (uint8_t)(0xE0 | (cp >> 12)); out[o++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
            out[o++] = (uint8_t)(0x80 | (cp & 0x3F));
        } else {
            out[o++] = (uint8_t)(0xF0 | (cp >> 18)); out[o++] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
            out[o++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); out[o++] = (uint8_t)(0x80 | (cp & 0x3F));
        }
    }
    PyObject *res = str_from(out, o);
    PyMem_Free(out);
    return res;
}

/* A JSON number: is_int (no fraction or exponent) with its int64 value (fits = 0 when it does
 * not fit), else a double. UNUSUAL on a malformed number. */
static int js_number(const uint8_t **pp, const uint8_t *end, int *is_int, int64_t *iv, int *fits,
                     double *dv) {
    const uint8_t *p = *pp, *start = p;
    int neg = 0;
    if (p < end && *p == '-') { neg = 1; p++; }
    if (p >= end || *p < '0' || *p > '9') return UNUSUAL;
    if (*p == '0') p++;
    else while (p < end && *p >= '0' && *p <= '9') p++;
    const uint8_t *int_end = p;
    int frac = 0;
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9') return UNUSUAL;
        while (p < end && *p >= '0' && *p <= '9') p++;
        frac = 1;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return UNUSUAL;
        while (p < end && *p >= '0' && *p <= '9') p++;
        frac = 1;
    }
    *is_int = !frac;
    *fits = 0;
    if (!frac) {
        const uint8_t *d = start + neg;
        if (int_end - d <= 18) {
            int64_t v = 0;
            for (; d < int_end; d++) v = v * 10 + (*d - '0');
            *iv = neg ? -v : v;
            *fits = 1;
        }
    } else {
        char tmp[64];
        Py_ssize_t n = p - start;
        if (n >= (Py_ssize_t)sizeof(tmp)) return UNUSUAL;
        memcpy(tmp, start, (size_t)n);
        tmp[n] = 0;
        char *e;
        *dv = PyOS_string_to_double(tmp, &e, NULL);
        if (*dv == -1.0 && PyErr_Occurred()) { PyErr_Clear(); return UNUSUAL; }
    }
    *pp = p;
    return OK;
}

static int js_skip(const uint8_t **pp, const uint8_t *end, int depth) {
    if (depth > 400) return UNUSUAL;
    const uint8_t *p = *pp;
    js_ws(&p, end);
    if (p >= end) return UNUSUAL;
    uint8_t c = *p;
    if (c == '"') {
        const uint8_t *s; Py_ssize_t n; int esc;
        if (js_string(&p, end, &s, &n, &esc)) return UNUSUAL;
    } else if (c == '{' || c == '[') {
        uint8_t close = c == '{' ? '}' : ']';
        p++;
        js_ws(&p, end);
        if (p < end && *p == close) { p++; *pp = p; return OK; }
        while (1) {
            if (c == '{') {
                const uint8_t *s; Py_ssize_t n; int esc;
                js_ws(&p, end);
                if (js_string(&p, end, &s, &n, &esc)) return UNUSUAL;
                js_ws(&p, end);
                if (p >= end || *p != ':') return UNUSUAL;
                p++;
            }
            if (js_skip(&p, end, depth + 1)) return UNUSUAL;
            js_ws(&p, end);
            if (p >= end) return UNUSUAL;
            if (*p == ',') { p++; continue; }
            if (*p == close) { p++; break; }
            return UNUSUAL;
        }
    } else if (c == 't' && end - p >= 4 && !memcmp(p, "true", 4)) p += 4;
    else if (c == 'f' && end - p >= 5 && !memcmp(p, "false", 5)) p += 5;
    else if (c == 'n' && end - p >= 4 && !memcmp(p, "null", 4)) p += 4;
    else {
        int is_int, fits; int64_t iv; double dv;
        if (js_number(&p, end, &is_int, &iv, &fits, &dv)) return UNUSUAL;
    }
    *pp = p;
    return OK;
}

static int js_int(const uint8_t **pp, const uint8_t *end, int64_t *v) {
    int is_int, fits; double dv;
    if (js_number(pp, end, &is_int, v, &fits, &dv)) return UNUSUAL;
    return (is_int && fits) ? OK : UNUSUAL;
}

static int js_int_list(const uint8_t **pp, const uint8_t *end, I64Vec *vec) {
    const uint8_t *p = *pp;
    if (p >= end || *p != '[') return UNUSUAL;
    p++;
    js_ws(&p, end);
    if (p < end && *p == ']') { *pp = p + 1; return OK; }
    while (1) {
        int64_t v;
        js_ws(&p, end);
        if (js_int(&p, end, &v)) return UNUSUAL;
        if (VEC_PUSH(*vec, v) < 0) return FAIL;
        js_ws(&p, end);
        if (p >= end) return UNUSUAL;
        if (*p == ',') { p++; continue; }
        if (*p == ']') { p++; break; }
        return UNUSUAL;
    }
    *pp = p;
    return OK;
}

static const char *const kind_text[33] = {
    NULL, NULL, NULL, "double_val", "double_list", "float_val", "float_list", "int32_val",
    "int32_list", "int64_val", "int64_list", "uint32_val", "uint32_list", "uint64_val",
    "uint64_list", "sint32_val", "sint32_list", "sint64_val", "sint64_list", "fixed32_val",
    "fixed32_list", "fixed64_val", "fixed64_list", "sfixed32_val", "sfixed32_list",
    "sfixed64_val", "sfixed64_list", "bool_val", "bool_list", "string_val", "string_list",
    "bytes_val", "bytes_list"};

static int kind_of_name(const uint8_t *s, Py_ssize_t n) {
    for (int k = 3; k <= 32; k++)
        if ((Py_ssize_t)strlen(kind_text[k]) == n && !memcmp(kind_text[k], s, (size_t)n)) return k;
    return 0;
}

/* Check one scalar JSON value of an attribute kind (no bytes: UNUSUAL). */
static int js_attr_scalar(int kind, const uint8_t **pp, const uint8_t *end) {
    const uint8_t *p = *pp;
    js_ws(&p, end);
    if (p >= end) return UNUSUAL;
    if (kind == K_BYTES) return UNUSUAL;
    if (kind == K_BOOL) {
        if (end - p >= 4 && !memcmp(p, "true", 4)) p += 4;
        else if (end - p >= 5 && !memcmp(p, "false", 5)) p += 5;
        else return UNUSUAL;
    } else if (kind == K_STRING) {
        const uint8_t *s; Py_ssize_t n; int esc;
        if (js_string(&p, end, &s, &n, &esc)) return UNUSUAL;
    } else {
        int is_int, fits; int64_t iv; double dv;
        if (js_number(&p, end, &is_int, &iv, &fits, &dv)) return UNUSUAL;
        if (is_int && !fits) return UNUSUAL;
        if (!is_int && kind != K_DOUBLE && kind != K_FLOAT) return UNUSUAL;
    }
    *pp = p;
    return OK;
}

static PyObject *js_scalar_obj(int kind, const uint8_t **pp, const uint8_t *end) {
    const uint8_t *p = *pp;
    js_ws(&p, end);
    PyObject *res;
    if (kind == K_BOOL) {
        int t = *p == 't';
        p += t ? 4 : 5;
        res = PyBool_FromLong(t);
    } else if (kind == K_STRING) {
        const uint8_t *s; Py_ssize_t n; int esc;
        js_string(&p, end, &s, &n, &esc);
        res = js_unescape(s, n, esc);
    } else {
        int is_int, fits; int64_t iv; double dv;
        js_number(&p, end, &is_int, &iv, &fits, &dv);
        if (kind == K_DOUBLE || kind == K_FLOAT) res = PyFloat_FromDouble(is_int ? (double)iv : dv);
        else res = PyLong_FromLongLong(iv);
    }
    *pp = p;
    return res;
}

/* The attribute value text at pay (checked by js_entry) as a Python object. */
static PyObject *js_attr_obj(const Attr *a) {
    const uint8_t *p = a->pay, *end = a->pay + a->pay_len;
    if (a->kind & 1) return js_scalar_obj(a->kind, &p, end);
    int elem = a->kind - 1;
    PyObject *t = PyTuple_New(a->list_n);
    if (!t) return NULL;
    js_ws(&p, end);
    p++; /* [ */
    for (Py_ssize_t i = 0; i < a->list_n; i++) {
        js_ws(&p, end);
        if (*p == ',') p++;
        PyObject *x = js_scalar_obj(elem, &p, end);
        if (!x) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* One "attr" list of an entry. */
static int js_attrs(Rec *r, const uint8_t **pp, const uint8_t *end) {
    const uint8_t *p = *pp;
    if (p >= end || *p != '[') return UNUSUAL;
    p++;
    js_ws(&p, end);
    if (p < end && *p == ']') { *pp = p + 1; return OK; }
    while (1) {
        js_ws(&p, end);
        if (p >= end || *p != '{') return UNUSUAL;
        p++;
        Attr *a = rec_new_attr(r);
        if (!a) return FAIL;
        int has_name = 0, has_doc = 0;
        js_ws(&p, end);
        if (p < end && *p == '}') return UNUSUAL;
        while (1) {
            const uint8_t *s; Py_ssize_t n; int esc;
            js_ws(&p, end);
            if (js_string(&p, end, &s, &n, &esc) || esc) return UNUSUAL;
            js_ws(&p, end);
            if (p >= end || *p != ':') return UNUSUAL;
            p++;
            js_ws(&p, end);
            if (NAME_IS(s, n, "name")) {
                int e2;
                if (has_name) return UNUSUAL;
                if (js_string(&p, end, &a->name, &a->name_len, &e2) || e2) return UNUSUAL;
                has_name = 1;
            } else if (NAME_IS(s, n, "doc_string")) {
                int e2;
                if (has_doc) return UNUSUAL;
                if (js_string(&p, end, &a->doc, &a->doc_len, &e2) || e2) return UNUSUAL;
                has_doc = 1;
            } else {
                int k = kind_of_name(s, n);
                if (!k || a->nval) return UNUSUAL;
                a->kind = k;
                a->nval = 1;
                a->pay = p;
                if (k & 1) {
                    if (js_attr_scalar(k, &p, end)) return UNUSUAL;
                } else {
                    if (*p != '[') return UNUSUAL;
                    p++;
                    js_ws(&p, end);
                    Py_ssize_t cnt = 0;
                    if (p < end && *p == ']') p++;
                    else {
                        while (1) {
                            if (js_attr_scalar(k - 1, &p, end)) return UNUSUAL;
                            cnt++;
                            js_ws(&p, end);
                            if (p >= end) return UNUSUAL;
                            if (*p == ',') { p++; continue; }
                            if (*p == ']') { p++; break; }
                            return UNUSUAL;
                        }
                    }
                    a->list_n = cnt;
                }
                a->pay_len = p - a->pay;
            }
            js_ws(&p, end);
            if (p >= end) return UNUSUAL;
            if (*p == ',') { p++; continue; }
            if (*p == '}') { p++; break; }
            return UNUSUAL;
        }
        if (!has_name || !a->nval) return UNUSUAL;
        js_ws(&p, end);
        if (p >= end) return UNUSUAL;
        if (*p == ',') { p++; continue; }
        if (*p == ']') { p++; break; }
        return UNUSUAL;
    }
    *pp = p;
    return OK;
}

/* JSON keys of an entry */
enum {
    JK_ID, JK_NAME, JK_TYPE, JK_CPU, JK_RUNTIME, JK_DATA, JK_CTRL, JK_CTRL2, JK_NUM_OPS,
    JK_TENSOR, JK_CTYPE, JK_PRIO, JK_CSIZE, JK_SRC, JK_DST, JK_TAG, JK_PG, JK_DTYPE, JK_ATTR,
    JK_START, JK_INPUTS, JK_OUTPUTS, JK_UNSET, JK_N
};
static const char *const jk_names[JK_N] = {
    "Id", "Name", "NodeType", "is_cpu_op", "runtime", "data_deps", "ctrl_deps", "ctrlDeps",
    "num_ops", "tensor_size", "comm_type", "comm_priority", "comm_size", "comm_src", "comm_dst",
    "comm_tag", "pg_name", "dtype", "attr", "start_time_micros", "inputs", "outputs",
    "stg_unset"};

static Py_ssize_t jk_len[JK_N];  /* strlen of jk_names, filled at import */

static int js_key(const uint8_t *s, Py_ssize_t n) {
    for (int k = 0; k < JK_N; k++)
        if (jk_len[k] == n && jk_names[k][0] == s[0] && !memcmp(jk_names[k], s, (size_t)n))
            return k;
    return -1;
}

/* per-entry JSON extras kept in the Rec */
typedef struct {
    int seen[JK_N];
    int64_t start;
    int pg_attr;            /* pg_name stays an attribute (not decimal) */
    const uint8_t *pg; Py_ssize_t pg_len; int pg_esc;
    int unset_mask;         /* opt keys listed in stg_unset: bit per JK_ */
    int64_t prio; int prio_has;
    I64Vec ctrl2;           /* ctrlDeps when ctrl_deps also given */
} JsExtra;

/* Parse one workload_graph entry at *pp into r (fmt 2). With h, hash it up to the values of
 * pg_name, comm_src and comm_dst. */
static int js_entry(Rec *r, JsExtra *x, const uint8_t **pp, const uint8_t *end, H128 *h) {
    rec_reset(r);
    r->fmt = 2;
    memset(x->seen, 0, sizeof(x->seen));
    x->start = 0; x->pg_attr = 0; x->unset_mask = 0; x->prio_has = 0; x->ctrl2.n = 0;
    const uint8_t *p = *pp;
    js_ws(&p, end);
    if (p >= end || *p != '{') return UNUSUAL;
    p++;
    js_ws(&p, end);
    if (p < end && *p == '}') return UNUSUAL;
    int64_t opt_val[JK_N];
    int opt_has[JK_N];
    memset(opt_has, 0, sizeof(opt_has));
    while (1) {
        const uint8_t *s, *kstart; Py_ssize_t n; int esc, rc;
        js_ws(&p, end);
        kstart = p;
        if (js_string(&p, end, &s, &n, &esc) || esc) return UNUSUAL;
        int k = js_key(s, n);
        js_ws(&p, end);
        if (p >= end || *p != ':') return UNUSUAL;
        p++;
        js_ws(&p, end);
        const uint8_t *vstart = p;
        if (k >= 0) {
            if (x->seen[k]) return UNUSUAL; /* a repeated key: the last one would count */
            x->seen[k] = 1;
        }
        switch (k) {
        case JK_ID: {
            int64_t v;
            if (js_int(&p, end, &v)) return UNUSUAL;
            r->id = (uint64_t)v;
            break;
        }
        case JK_NAME: {
            if (js_string(&p, end, &r->name, &r->name_len, &r->name_esc)) return UNUSUAL;
            break;
        }
        case JK_TYPE: {
            int64_t v;
            if (js_int(&p, end, &v) || v < 0 || v > 7) return UNUSUAL;
            r->type = v;
            break;
        }
        case JK_CPU:
            if (end - p >= 4 && !memcmp(p, "true", 4)) { r->cpu = 1; p += 4; }
            else if (end - p >= 5 && !memcmp(p, "false", 5)) { r->cpu = 0; p += 5; }
            else return UNUSUAL;
            break;
        case JK_RUNTIME: case JK_NUM_OPS: case JK_TENSOR: case JK_CSIZE: case JK_START: {
            int64_t v;
            if (js_int(&p, end, &v)) return UNUSUAL;
            if (k == JK_RUNTIME) r->dur = (uint64_t)v;
            else if (k == JK_START) x->start = v;
            else {
                int wk = k == JK_NUM_OPS ? WK_NUM_OPS : k == JK_TENSOR ? WK_TENSOR : WK_COMM_SIZE;
                r->wk_val[wk] = v;
            }
            break;
        }
        case JK_CTYPE: case JK_PRIO: case JK_SRC: case JK_DST: case JK_TAG: {
            if (end - p >= 4 && !memcmp(p, "null", 4)) { p += 4; break; }
            int64_t v;
            if (js_int(&p, end, &v)) return UNUSUAL;
            opt_has[k] = 1;
            opt_val[k] = v;
            break;
        }
        case JK_DATA:
            rc = js_int_list(&p, end, &r->data);
            if (rc) return rc;
            break;
        case JK_CTRL: case JK_CTRL2:
            rc = js_int_list(&p, end, k == JK_CTRL ? &r->ctrl : &x->ctrl2);
            if (rc) return rc;
            break;
        case JK_PG: {
            if (end - p >= 4 && !memcmp(p, "null", 4)) { p += 4; break; }
            const uint8_t *gs; Py_ssize_t gn; int ge;
            if (js_string(&p, end, &gs, &gn, &ge)) return UNUSUAL;
            if (ge) return UNUSUAL; /* an escaped pg_name: decimal or not after decoding */
            int digits = gn > 0;
            for (Py_ssize_t j = 0; digits && j < gn; j++)
                if (gs[j] < '0' || gs[j] > '9') digits = 0;
            if (digits) {
                Py_ssize_t j = 0;
                while (j < gn - 1 && gs[j] == '0') j++;
                if (gn - j > 18) return UNUSUAL;
                int64_t g = 0;
                for (; j < gn; j++) g = g * 10 + (gs[j] - '0');
                r->has_group = 1;
                r->group = g;
            } else {
                x->pg_attr = 1; x->pg = gs; x->pg_len = gn; x->pg_esc = ge;
                r->special = 1;
            }
            break;
        }
        case JK_DTYPE: {
            if (end - p >= 4 && !memcmp(p, "null", 4)) { p += 4; break; }
            if (js_string(&p, end, &r->dtype, &r->dtype_len, &r->dtype_esc)) return UNUSUAL;
            r->has_dtype = 1;
            break;
        }
        case JK_ATTR:
            rc = js_attrs(r, &p, end);
            if (rc) return rc;
            break;
        case JK_INPUTS: case JK_OUTPUTS: {
            int which = k == JK_OUTPUTS;
            if (*p != '{') return UNUSUAL;
            p++;
            r->io_has[which] = 1;
            for (int i = 0; i < 3; i++) { r->io[which][i] = NULL; r->io_len[which][i] = 0; r->io_esc[which][i] = 0; }
            int got[3] = {0, 0, 0};
            js_ws(&p, end);
            if (p < end && *p == '}') { p++; break; }
            while (1) {
                const uint8_t *ks; Py_ssize_t kn; int ke;
                js_ws(&p, end);
                if (js_string(&p, end, &ks, &kn, &ke) || ke) return UNUSUAL;
                js_ws(&p, end);
                if (p >= end || *p != ':') return UNUSUAL;
                p++;
                js_ws(&p, end);
                int which_key = NAME_IS(ks, kn, "values") ? 0 : NAME_IS(ks, kn, "shapes") ? 1
                                : NAME_IS(ks, kn, "types") ? 2 : -1;
                if (which_key >= 0) {
                    if (got[which_key]) return UNUSUAL;
                    got[which_key] = 1;
                    if (js_string(&p, end, &r->io[which][which_key], &r->io_len[which][which_key],
                                  &r->io_esc[which][which_key]))
                        return UNUSUAL;
                } else if (js_skip(&p, end, 3)) {
                    return UNUSUAL;
                }
                js_ws(&p, end);
                if (p >= end) return UNUSUAL;
                if (*p == ',') { p++; continue; }
                if (*p == '}') { p++; break; }
                return UNUSUAL;
            }
            break;
        }
        case JK_UNSET: {
            if (*p != '[') return UNUSUAL;
            p++;
            js_ws(&p, end);
            if (p < end && *p == ']') { p++; break; }
            while (1) {
                js_ws(&p, end);
                if (p < end && *p == '"') {
                    const uint8_t *us; Py_ssize_t un; int ue;
                    if (js_string(&p, end, &us, &un, &ue) || ue) return UNUSUAL;
                    int uk = js_key(us, un);
                    if (uk >= 0) x->unset_mask |= 1 << uk;
                } else if (js_skip(&p, end, 3)) {
                    return UNUSUAL;
                }
                js_ws(&p, end);
                if (p >= end) return UNUSUAL;
                if (*p == ',') { p++; continue; }
                if (*p == ']') { p++; break; }
                return UNUSUAL;
            }
            break;
        }
        default:
            if (js_skip(&p, end, 2)) return UNUSUAL;
        }
        if (h) {
            if (k == JK_PG || k == JK_SRC || k == JK_DST) h_bytes(h, s, n);
            else h_bytes(h, kstart, p - kstart);
        }
        js_ws(&p, end);
        if (p >= end) return UNUSUAL;
        if (*p == ',') { p++; continue; }
        if (*p == '}') { p++; break; }
        return UNUSUAL;
        (void)vstart;
    }
    if (h) h_word(h, 0x7265636F7264ULL);
    if (!x->seen[JK_ID] || !x->seen[JK_NAME] || !x->seen[JK_TYPE]) return UNUSUAL;
    /* ctrl deps come from "ctrl_deps" when given, else "ctrlDeps" */
    if (!x->seen[JK_CTRL] && x->seen[JK_CTRL2]) {
        I64Vec t = r->ctrl; r->ctrl = x->ctrl2; x->ctrl2 = t;
    }
    /* stg_unset turns given optional keys back into None */
    int opt_keys[5] = {JK_CTYPE, JK_PRIO, JK_SRC, JK_DST, JK_TAG};
    for (int i = 0; i < 5; i++) {
        int k = opt_keys[i];
        if (x->unset_mask & (1 << k)) opt_has[k] = 0;
    }
    if (opt_has[JK_CTYPE]) {
        if (opt_val[JK_CTYPE] < 0 || opt_val[JK_CTYPE] > 9) return UNUSUAL;
        r->comm_type = (int)opt_val[JK_CTYPE];
    }
    if (opt_has[JK_PRIO]) { x->prio_has = 1; x->prio = opt_val[JK_PRIO]; }
    r->wk_has[WK_NUM_OPS] = r->wk_has[WK_TENSOR] = r->wk_has[WK_COMM_SIZE] = 1;
    r->wk_has[WK_SRC] = opt_has[JK_SRC]; r->wk_val[WK_SRC] = opt_has[JK_SRC] ? opt_val[JK_SRC] : 0;
    r->wk_has[WK_DST] = opt_has[JK_DST]; r->wk_val[WK_DST] = opt_has[JK_DST] ? opt_val[JK_DST] : 0;
    r->wk_has[WK_TAG] = opt_has[JK_TAG]; r->wk_val[WK_TAG] = opt_has[JK_TAG] ? opt_val[JK_TAG] : 0;
    /* attribute names must not repeat (nor repeat pg_name / comm_priority set above) */
    for (int i = 0; i < r->nattrs; i++) {
        Attr *a = &r->attrs[i];
        if ((x->pg_attr && NAME_IS(a->name, a->name_len, "pg_name")) ||
            (x->prio_has && NAME_IS(a->name, a->name_len, "comm_priority")))
            return UNUSUAL;
        for (int j = 0; j < i; j++)
            if (r->attrs[j].name_len == a->name_len && !memcmp(r->attrs[j].name, a->name, (size_t)a->name_len))
                return UNUSUAL;
        if (NAME_IS(a->name, a->name_len, "pg_name")) r->special = 1;
        else if (NAME_IS(a->name, a->name_len, "comm_priority") && a->kind != K_INT32) r->special = 1;
        else if (NAME_IS(a->name, a->name_len, "involved_dim") && a->kind != K_BOOL + 1) r->special = 1;
    }
    *pp = p;
    return OK;
}

static PyObject *node_json(Rec *r, JsExtra *x) {
    PyObject *vals[NF_COUNT] = {0};
    PyObject *attrs = new_attrs();
    if (!attrs) return NULL;
    PyObject *kinds = ATTRS_KINDS(attrs), *docs = ATTRS_DOCS(attrs), *extras = ATTRS_EXTRAS(attrs);
    if (x->pg_attr) {
        PyObject *v = js_unescape(x->pg, x->pg_len, x->pg_esc);
        if (!v) goto fail;
        if (dict_set_steal(attrs, s_pg_name, v) < 0) goto fail;
        if (PyDict_SetItem(kinds, s_pg_name, s_string_val) < 0) goto fail;
    }
    if (x->prio_has) {
        if (dict_set_steal(attrs, s_comm_priority, PyLong_FromLongLong(x->prio)) < 0) goto fail;
        if (PyDict_SetItem(kinds, s_comm_priority, s_int32_val) < 0) goto fail;
    }
    for (int i = 0; i < r->nattrs; i++) {
        Attr *a = &r->attrs[i];
        PyObject *name = name_obj(a->name, a->name_len);
        if (!name) goto fail;
        int rc = dict_set_steal(attrs, name, untracked(js_attr_obj(a)));
        if (rc == 0) rc = PyDict_SetItem(kinds, name, g_kind_names[a->kind]);
        if (rc == 0 && a->doc_len) rc = dict_set_steal(docs, name, str_from(a->doc, a->doc_len));
        Py_DECREF(name);
        if (rc < 0) goto fail;
    }
    if (x->seen[JK_START] && dict_set_steal(extras, s_start, PyLong_FromLongLong(x->start)) < 0) goto fail;
    for (int which = 0; which < 2; which++) {
        if (!r->io_has[which]) continue;
        PyObject *t = PyTuple_New(3);
        if (!t) goto fail;
        for (int i = 0; i < 3; i++) {
            PyObject *s = r->io[which][i] ? js_unescape(r->io[which][i], r->io_len[which][i], r->io_esc[which][i])
                                          : PyUnicode_FromStringAndSize("", 0);
            if (!s) { Py_DECREF(t); goto fail; }
            PyTuple_SET_ITEM(t, i, s);
        }
        if (dict_set_steal(extras, which ? s_outputs : s_inputs, untracked(t)) < 0) goto fail;
    }
    vals[NF_ID] = PyLong_FromLongLong((int64_t)r->id);
    vals[NF_NAME] = js_unescape(r->name, r->name_len, r->name_esc);
    Py_INCREF(g_node_types[r->type]);
    vals[NF_TYPE] = g_node_types[r->type];
    vals[NF_DATA] = deps_tuple(&r->data, 0);
    vals[NF_CTRL] = deps_tuple(&r->ctrl, 0);
    vals[NF_NUM_OPS] = PyLong_FromLongLong(r->wk_val[WK_NUM_OPS]);
    vals[NF_TENSOR] = PyLong_FromLongLong(r->wk_val[WK_TENSOR]);
    if (r->comm_type >= 0) { Py_INCREF(g_collectives[r->comm_type]); vals[NF_COMM_TYPE] = g_collectives[r->comm_type]; }
    else { Py_INCREF(Py_None); vals[NF_COMM_TYPE] = Py_None; }
    vals[NF_COMM_SIZE] = PyLong_FromLongLong(r->wk_val[WK_COMM_SIZE]);
    if (r->has_group) vals[NF_GROUP] = PyLong_FromLongLong(r->group);
    else { Py_INCREF(Py_None); vals[NF_GROUP] = Py_None; }
    vals[NF_SRC] = opt_int(r, WK_SRC);
    vals[NF_DST] = opt_int(r, WK_DST);
    vals[NF_TAG] = opt_int(r, WK_TAG);
    vals[NF_RUNTIME] = PyLong_FromLongLong((int64_t)r->dur);
    vals[NF_CPU] = PyBool_FromLong(r->cpu);
    if (r->has_dtype) vals[NF_DTYPE] = js_unescape(r->dtype, r->dtype_len, r->dtype_esc);
    else { Py_INCREF(Py_None); vals[NF_DTYPE] = Py_None; }
    vals[NF_ATTRS] = attrs;
    if (imply_op(attrs, vals[NF_NAME]) < 0) {
        for (int j = 0; j < NF_COUNT; j++) Py_XDECREF(vals[j]);
        return NULL;
    }
    for (int i = 0; i < NF_COUNT; i++) {
        if (!vals[i]) {
            for (int j = 0; j < NF_COUNT; j++) Py_XDECREF(vals[j]);
            return NULL;
        }
    }
    return make_node(vals);
fail:
    Py_DECREF(attrs);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Columns                                                                                     */

#define M_IDS 1
#define M_FLAGS 2
#define M_SIZES 4
#define M_COMM 8
#define M_DEPS 16

#define F_HAS_CPU 1
#define F_CPU 2
#define F_CTYPE 4
#define F_GROUP 8
#define F_SRC 16
#define F_DST 32
#define F_TAG 64
#define F_SPECIAL 128

typedef struct {
    I64Vec id, num_ops, tensor, csize, runtime, group, src, dst, tag, data_off, data, ctrl_off, ctrl;
    U8Vec type, ctype;
    I32Vec flags;
    Py_ssize_t n;
} Cols;

static void cols_free(Cols *c) {
    VEC_FREE(c->id); VEC_FREE(c->num_ops); VEC_FREE(c->tensor); VEC_FREE(c->csize);
    VEC_FREE(c->runtime); VEC_FREE(c->group); VEC_FREE(c->src); VEC_FREE(c->dst); VEC_FREE(c->tag);
    VEC_FREE(c->data_off); VEC_FREE(c->data); VEC_FREE(c->ctrl_off); VEC_FREE(c->ctrl);
    VEC_FREE(c->type); VEC_FREE(c->ctype); VEC_FREE(c->flags);
    c->n = 0;
}

/* Whether the record's numbers fit the int64 columns (else the caller defers to the reference). */
static int rec_fits(const Rec *r) {
    if (r->fmt == 2) return 1; /* JSON values are parsed as int64 already */
    if (r->id > (uint64_t)INT64_MAX || r->dur > (uint64_t)INT64_MAX || r->group_big) return 0;
    for (int i = 0; i < WK_N; i++) if (r->wk_has[i] && r->wk_big[i]) return 0;
    for (Py_ssize_t i = 0; i < r->data.n; i++) if (r->data.v[i] < 0) return 0;
    for (Py_ssize_t i = 0; i < r->ctrl.n; i++) if (r->ctrl.v[i] < 0) return 0;
    return 1;
}

static int cols_add(Cols *c, const Rec *r, int mask) {
    int err = 0;
    err |= VEC_PUSH(c->type, (uint8_t)r->type);
    if (mask & M_IDS) err |= VEC_PUSH(c->id, (int64_t)r->id);
    if (mask & M_FLAGS) {
        int32_t f = 0;
        if (r->fmt == 4 && r->has_cpu) f |= F_HAS_CPU;
        if (r->cpu) f |= F_CPU;
        if (r->comm_type >= 0) f |= F_CTYPE;
        if (r->has_group) f |= F_GROUP;
        if (r->wk_has[WK_SRC]) f |= F_SRC;
        if (r->wk_has[WK_DST]) f |= F_DST;
        if (r->wk_has[WK_TAG]) f |= F_TAG;
        if (r->special) f |= F_SPECIAL;
        err |= VEC_PUSH(c->flags, f);
    }
    if (mask & M_SIZES) {
        err |= VEC_PUSH(c->num_ops, r->wk_has[WK_NUM_OPS] ? r->wk_val[WK_NUM_OPS] : 0);
        err |= VEC_PUSH(c->tensor, r->wk_has[WK_TENSOR] ? r->wk_val[WK_TENSOR] : 0);
        err |= VEC_PUSH(c->csize, r->wk_has[WK_COMM_SIZE] ? r->wk_val[WK_COMM_SIZE] : 0);
        err |= VEC_PUSH(c->runtime, (int64_t)r->dur);
    }
    if (mask & M_COMM) {
        err |= VEC_PUSH(c->ctype, (uint8_t)(int8_t)r->comm_type);
        err |= VEC_PUSH(c->group, r->has_group ? r->group : 0);
        err |= VEC_PUSH(c->src, r->wk_has[WK_SRC] ? r->wk_val[WK_SRC] : 0);
        err |= VEC_PUSH(c->dst, r->wk_has[WK_DST] ? r->wk_val[WK_DST] : 0);
        err |= VEC_PUSH(c->tag, r->wk_has[WK_TAG] ? r->wk_val[WK_TAG] : 0);
    }
    if (mask & M_DEPS) {
        if (c->data_off.n == 0) { err |= VEC_PUSH(c->data_off, 0); err |= VEC_PUSH(c->ctrl_off, 0); }
        for (Py_ssize_t i = 0; i < r->data.n; i++) err |= VEC_PUSH(c->data, r->data.v[i]);
        for (Py_ssize_t i = 0; i < r->ctrl.n; i++) err |= VEC_PUSH(c->ctrl, r->ctrl.v[i]);
        err |= VEC_PUSH(c->data_off, (int64_t)c->data.n);
        err |= VEC_PUSH(c->ctrl_off, (int64_t)c->ctrl.n);
    }
    c->n++;
    return err ? FAIL : OK;
}

static int put_bytes(PyObject *d, const char *key, const void *p, Py_ssize_t n) {
    PyObject *b = PyBytes_FromStringAndSize((const char *)p, n);
    if (!b) return -1;
    int rc = PyDict_SetItemString(d, key, b);
    Py_DECREF(b);
    return rc;
}

static PyObject *cols_take(Cols *c, int mask) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    int err = 0;
    err |= put_bytes(d, "type", c->type.v, c->type.n);
#define PUT64(key, vec) err |= put_bytes(d, key, (vec).v, (vec).n * 8)
    if (mask & M_IDS) PUT64("id", c->id);
    if (mask & M_FLAGS) err |= put_bytes(d, "flags", c->flags.v, c->flags.n * 4);
    if (mask & M_SIZES) { PUT64("num_ops", c->num_ops); PUT64("tensor_size", c->tensor); PUT64("comm_size", c->csize); PUT64("runtime", c->runtime); }
    if (mask & M_COMM) {
        err |= put_bytes(d, "comm_type", c->ctype.v, c->ctype.n);
        PUT64("comm_group", c->group); PUT64("comm_src", c->src); PUT64("comm_dst", c->dst); PUT64("comm_tag", c->tag);
    }
    if (mask & M_DEPS) {
        if (c->data_off.n == 0) { int64_t z = 0; err |= put_bytes(d, "data_off", &z, 8); err |= put_bytes(d, "ctrl_off", &z, 8); }
        else { PUT64("data_off", c->data_off); PUT64("ctrl_off", c->ctrl_off); }
        PUT64("data", c->data); PUT64("ctrl", c->ctrl);
    }
#undef PUT64
    cols_free(c);
    if (err) { Py_DECREF(d); return NULL; }
    return d;
}

/* ------------------------------------------------------------------------------------------ */
/* The Reader                                                                                  */

#define ST_MORE 0
#define ST_EOF 1
#define ST_UNUSUAL 2
#define ST_ERROR 3

static PyObject *g_read_errors = NULL;   /* (EOFError, OSError, zlib.error) */
static long long g_max_record = 1LL << 30;

typedef struct {
    PyObject_HEAD
    PyObject *stream, *name;
    int fmt;
    uint8_t *buf; Py_ssize_t cap, len, pos;
    long long base, index;
    int eof, readinto;
    Py_ssize_t chunk;
    Rec rec;
    JsExtra jx;
    int status;
    PyObject *etype, *evalue, *etb;
    long long u_index, u_offset;
    PyObject *u_data;
    int hashing;
    H128 hash;
    long long count;
    int js_state;                          /* 0 not scanned, 1 in the array, 2 done */
    long long js_pos;                      /* index of the next workload_graph entry */
    Cols cols;
} Reader;

/* One spare read buffer, handed from a finished Reader to the next (the GIL guards it): a
 * process reading many rank files does not fault in fresh pages for each. */
static uint8_t *g_spare_buf = NULL;
static Py_ssize_t g_spare_cap = 0;
#define SPARE_MAX (Py_ssize_t)(16 << 20)

static void rd_read_error(Reader *r) {
    if (PyErr_ExceptionMatches(g_read_errors)) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        PyErr_Format(g_trace_error, "%U: unreadable compressed data near byte %lld: %S",
                     r->name, r->base + (long long)r->len, v ? v : Py_None);
        Py_XDECREF(t); Py_XDECREF(v); Py_XDECREF(tb);
    }
}

/* Read into the buffer until need bytes are unconsumed: 1, 0 at the end of the stream, -1
 * error. Streams with readinto fill the buffer in place (no bytes object, no copy). */
static int rd_fill(Reader *r, Py_ssize_t need) {
    while (r->len - r->pos < need && !r->eof) {
        Py_ssize_t want = r->chunk, missing = need - (r->len - r->pos);
        if (missing > want) want = missing;
        if (r->pos) {
            memmove(r->buf, r->buf + r->pos, (size_t)(r->len - r->pos));
            r->len -= r->pos;
            r->base += r->pos;
            r->pos = 0;
        }
        if (grow((void **)&r->buf, &r->cap, r->len + want, 1) < 0) return -1;
        if (r->readinto) {
            PyObject *view = PyMemoryView_FromMemory((char *)r->buf + r->len, want, PyBUF_WRITE);
            if (!view) return -1;
            PyObject *res = PyObject_CallMethodOneArg(r->stream, s_readinto, view);
            Py_DECREF(view);
            if (!res) { rd_read_error(r); return -1; }
            Py_ssize_t got = res == Py_None ? 0 : PyLong_AsSsize_t(res);
            Py_DECREF(res);
            if (got < 0 || got > want) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_OSError, "%U: readinto returned %zd", r->name, got);
                return -1;
            }
            if (got == 0) r->eof = 1;
            r->len += got;
            continue;
        }
        PyObject *chunk = PyObject_CallMethod(r->stream, "read", "n", want);
        if (!chunk) { rd_read_error(r); return -1; }
        Py_buffer view;
        if (PyObject_GetBuffer(chunk, &view, PyBUF_SIMPLE) < 0) { Py_DECREF(chunk); return -1; }
        if (view.len == 0) {
            r->eof = 1;
        } else {
            if (grow((void **)&r->buf, &r->cap, r->len + view.len, 1) < 0) {
                PyBuffer_Release(&view); Py_DECREF(chunk); return -1;
            }
            memcpy(r->buf + r->len, view.buf, (size_t)view.len);
            r->len += view.len;
        }
        PyBuffer_Release(&view);
        Py_DECREF(chunk);
    }
    return r->len - r->pos >= need;
}

/* One varint-framed record: 1, 0 at the end of the stream, -1 with TraceError set. */
static int rd_record(Reader *r, const uint8_t **data, Py_ssize_t *dlen, long long *offset) {
    int f = rd_fill(r, 1);
    if (f <= 0) return f;
    *offset = r->base + r->pos;
    unsigned __int128 length = 0;
    int shift = 0;
    Py_ssize_t p = r->pos;
    while (1) {
        if (p >= r->len) {
            Py_ssize_t consumed = p - r->pos;
            f = rd_fill(r, consumed + 1);
            if (f < 0) return -1;
            if (!f) {
                PyErr_Format(g_trace_error, "%U: truncated length varint at byte %lld (record %lld)",
                             r->name, *offset, r->index);
                return -1;
            }
            p = r->pos + consumed;
        }
        uint8_t b = r->buf[p++];
        length |= (unsigned __int128)(b & 0x7F) << shift;
        if (!(b & 0x80)) break;
        shift += 7;
        if (shift > 63) {
            PyErr_Format(g_trace_error, "%U: malformed length varint at byte %lld (record %lld)",
                         r->name, *offset, r->index);
            return -1;
        }
    }
    Py_ssize_t header = p - r->pos;
    if (length == 0) {
        PyErr_Format(g_trace_error, "%U: empty (zero-length) record at byte %lld (record %lld)",
                     r->name, *offset, r->index);
        return -1;
    }
    if (length > (unsigned __int128)g_max_record) {
        PyObject *n = long_from_i128((__int128)length);
        if (n) {
            PyErr_Format(g_trace_error, "%U: record %lld at byte %lld claims %S bytes; not a trace file",
                         r->name, r->index, *offset, n);
            Py_DECREF(n);
        }
        return -1;
    }
    f = rd_fill(r, header + (Py_ssize_t)length);
    if (f < 0) return -1;
    if (!f) {
        PyErr_Format(g_trace_error, "%U: truncated record %lld at byte %lld: %lld bytes announced, %lld present",
                     r->name, r->index, *offset, (long long)length,
                     (long long)(r->len - r->pos - header));
        return -1;
    }
    *data = r->buf + r->pos + header;
    *dlen = (Py_ssize_t)length;
    r->pos += header + (Py_ssize_t)length;
    r->index++;
    return 1;
}

static void rd_set_unusual(Reader *r, long long index, long long offset, const uint8_t *data, Py_ssize_t n) {
    r->u_index = index;
    r->u_offset = offset;
    Py_XDECREF(r->u_data);
    r->u_data = PyBytes_FromStringAndSize((const char *)data, n);
    r->status = ST_UNUSUAL;
}

/* Streaming JSON. The document is read twice through the bounded buffer, one value at a time
 * (a workload_graph entry, or another top-level value): js_scan checks the whole document as
 * the reference's json.load would accept it and finds the workload_graph array; the stream is
 * then rewound there and rd_next decodes the entries. So memory stays that of the largest
 * entry (or other top-level value), and a document the reference rejects yields no node. */

/* Read more of the stream (at least a chunk, at least doubling what is buffered): 1, 0 at
 * the end of the stream, -1 error. */
static int js_more(Reader *r) {
    Py_ssize_t have = r->len - r->pos;
    Py_ssize_t extra = have > r->chunk ? have : r->chunk;
    if (rd_fill(r, have + extra) < 0) return -1;
    return r->len - r->pos > have;
}

/* The next non-blank byte at r->pos (blanks consumed), -1 at the end, -2 error. */
static int js_peek(Reader *r) {
    while (1) {
        while (r->pos < r->len) {
            uint8_t c = r->buf[r->pos];
            if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return c;
            r->pos++;
        }
        int m = js_more(r);
        if (m < 0) return -2;
        if (m == 0) return -1;
    }
}

/* Consume one whole value at r->pos (key: a string only) with its own buffer refills: OK,
 * UNUSUAL (the reference must judge the document), FAIL. *esc: the key holds escapes. */
static int js_unit(Reader *r, int depth, int key, int *esc, const uint8_t **ks, Py_ssize_t *kn) {
    while (1) {
        const uint8_t *p = r->buf + r->pos, *q = p, *end = r->buf + r->len;
        int rc = key ? js_string(&q, end, ks, kn, esc) : js_skip(&q, end, depth);
        if (rc == OK) {
            const uint8_t *t = q;
            js_ws(&t, end);
            /* a number may go on in the next chunk: the byte after the value must be here */
            if (t < end || r->eof) {
                r->pos += q - p;
                return OK;
            }
        } else if (r->eof) {
            return UNUSUAL;
        }
        int m = js_more(r);
        if (m < 0) return FAIL;
        if (m == 0 && rc != OK) return UNUSUAL;
    }
}

/* Check the document and leave r->js_arr at the stream offset just after the '[' of its
 * workload_graph: OK, UNUSUAL (the reference reads the document), FAIL. */
static int js_scan(Reader *r, long long *arr, U8Vec *meta) {
    int c = js_peek(r), found = 0;
    if (c == -2) return FAIL;
    if (c != '{') return UNUSUAL;
    r->pos++;
    c = js_peek(r);
    if (c == -2) return FAIL;
    if (c == '}') return UNUSUAL; /* no workload_graph */
    while (1) {
        const uint8_t *ks; Py_ssize_t kn; int esc = 0, rc;
        c = js_peek(r);
        if (c == -2) return FAIL;
        if (c != '"') return UNUSUAL;
        rc = js_unit(r, 0, 1, &esc, &ks, &kn);
        if (rc != OK) return rc;
        /* an escaped spelling of workload_graph would count: do not guess */
        if (esc) return UNUSUAL;
        int is_graph = NAME_IS(ks, kn, "workload_graph");
        if (meta && !is_graph) { /* "key": (no escapes in keys here; ks dies with a refill) */
            if (meta->n > 1 && VEC_PUSH(*meta, ',') < 0) return FAIL;
            if (VEC_PUSH(*meta, '"') < 0) return FAIL;
            for (Py_ssize_t i = 0; i < kn; i++) if (VEC_PUSH(*meta, ks[i]) < 0) return FAIL;
            if (VEC_PUSH(*meta, '"') < 0 || VEC_PUSH(*meta, ':') < 0) return FAIL;
        }
        c = js_peek(r);
        if (c == -2) return FAIL;
        if (c != ':') return UNUSUAL;
        r->pos++;
        c = js_peek(r);
        if (c == -2) return FAIL;
        if (is_graph) {
            if (found || c != '[') return UNUSUAL;
            found = 1;
            r->pos++;
            *arr = r->base + (long long)r->pos;
            c = js_peek(r);
            if (c == -2) return FAIL;
            if (c == ']') return UNUSUAL; /* an empty workload_graph */
            while (1) {
                rc = js_unit(r, 2, 0, NULL, NULL, NULL);
                if (rc != OK) return rc;
                c = js_peek(r);
                if (c == -2) return FAIL;
                if (c == ',') { r->pos++; continue; }
                if (c == ']') { r->pos++; break; }
                return UNUSUAL;
            }
        } else {
            long long vstart = r->base + (long long)r->pos;
            rc = js_unit(r, 1, 0, NULL, NULL, NULL);
            if (rc != OK) return rc;
            if (meta) { /* the value's bytes: js_unit kept them from vstart on */
                const uint8_t *v = r->buf + (vstart - r->base);
                Py_ssize_t vn = (Py_ssize_t)(r->base + (long long)r->pos - vstart);
                for (Py_ssize_t i = 0; i < vn; i++) if (VEC_PUSH(*meta, v[i]) < 0) return FAIL;
            }
        }
        c = js_peek(r);
        if (c == -2) return FAIL;
        if (c == ',') { r->pos++; continue; }
        if (c == '}') { r->pos++; break; }
        return UNUSUAL;
    }
    c = js_peek(r);
    if (c == -2) return FAIL;
    return c == -1 && found ? OK : UNUSUAL;
}

/* Scan the document, then rewind the stream to its workload_graph: OK or UNUSUAL (read
 * errors too: the reference reports unreadable JSON its own way). */
static int js_load(Reader *r) {
    long long arr = 0;
    int rc = js_scan(r, &arr, NULL);
    if (rc == FAIL) { PyErr_Clear(); return UNUSUAL; }
    if (rc != OK) return UNUSUAL;
    if (arr >= r->base) {
        /* the array is still in the buffer (a document smaller than a read): no rewind */
        r->pos = (Py_ssize_t)(arr - r->base);
    } else {
        PyObject *res = PyObject_CallMethod(r->stream, "seek", "L", arr);
        if (!res) { PyErr_Clear(); return UNUSUAL; }
        Py_DECREF(res);
        r->len = r->pos = 0;
        r->base = arr;
        r->eof = 0;
    }
    r->js_pos = 0;
    r->js_state = 1;
    return OK;
}

/* The next node into r->rec: 1, 0 at the end, 2 unusual (r->status set), -1 error. */
static int rd_next(Reader *r) {
    Rec *rec = &r->rec;
    H128 *h = r->hashing ? &r->hash : NULL;
    if (r->fmt == 2) {
        if (r->js_state == 0) {
            int rc = js_load(r);
            if (rc == UNUSUAL) { r->u_index = -1; r->status = ST_UNUSUAL; return 2; }
        }
        if (r->js_state == 2) return 0;
        int c = js_peek(r);
        if (c == -2) return -1;
        if (r->js_pos > 0 && c == ',') {
            r->pos++;
            c = js_peek(r);
            if (c == -2) return -1;
        }
        if (c == ']' || c == -1) { r->js_state = 2; return 0; }
        while (1) {
            const uint8_t *start = r->buf + r->pos, *end = r->buf + r->len, *p = start;
            H128 saved = r->hash;
            int rc = js_entry(rec, &r->jx, &p, end, h);
            if (rc == FAIL) return -1;
            if (rc == OK) {
                r->pos += p - start;
                r->js_pos++;
                return 1;
            }
            r->hash = saved;
            const uint8_t *q = start;
            if (js_skip(&q, end, 2) == OK) { /* whole, but for the reference */
                rd_set_unusual(r, r->js_pos, -1, start, q - start);
                r->pos += q - start;
                r->js_pos++;
                return 2;
            }
            int m = js_more(r); /* the entry goes on in the next chunk */
            if (m < 0) return -1;
            if (m == 0) {
                PyErr_Format(g_trace_error, "%U: the file changed while it was being read",
                             r->name);
                return -1;
            }
        }
    }
    const uint8_t *data;
    Py_ssize_t n;
    long long offset, index = r->index;
    int rc = rd_record(r, &data, &n, &offset);
    if (rc <= 0) return rc;
    rc = r->fmt == 4 ? parse_v004(rec, data, data + n, h) : parse_v001(rec, data, data + n, h);
    if (rc == OK && r->fmt == 4) rc = resolve_v004(rec);
    if (rc == FAIL) return -1;
    if (rc != OK) { rd_set_unusual(r, index, offset, data, n); return 2; }
    return 1;
}

static void rd_store_error(Reader *r) {
    Py_CLEAR(r->etype); Py_CLEAR(r->evalue); Py_CLEAR(r->etb);
    PyErr_Fetch(&r->etype, &r->evalue, &r->etb);
    r->status = ST_ERROR;
}

static PyObject *Reader_nodes(Reader *r, PyObject *args) {
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "n", &limit)) return NULL;
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    r->status = ST_MORE;
    while (PyList_GET_SIZE(list) < limit) {
        int rc = rd_next(r);
        if (rc < 0) {
            if (PyList_GET_SIZE(list) == 0) { Py_DECREF(list); return NULL; }
            rd_store_error(r);
            break;
        }
        if (rc == 0) { r->status = ST_EOF; break; }
        if (rc == 2) break;
        PyObject *node = r->fmt == 4 ? node_v004(&r->rec)
                         : r->fmt == 1 ? node_v001(&r->rec) : node_json(&r->rec, &r->jx);
        if (!node || PyList_Append(list, node) < 0) {
            Py_XDECREF(node);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(node);
        r->count++;
    }
    return list;
}

static PyObject *Reader_columns(Reader *r, PyObject *args) {
    int mask;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "in", &mask, &limit)) return NULL;
    r->status = ST_MORE;
    Py_ssize_t added = 0;
    while (limit < 0 || added < limit) {
        int rc = rd_next(r);
        if (rc < 0) {
            if (!PyErr_ExceptionMatches(g_trace_error)) { cols_free(&r->cols); return NULL; }
            rd_store_error(r);
            break;
        }
        if (rc == 0) { r->status = ST_EOF; break; }
        if (rc == 2) break;
        if (!rec_fits(&r->rec)) { r->u_index = -1; r->status = ST_UNUSUAL; break; }
        if (cols_add(&r->cols, &r->rec, mask) < 0) { cols_free(&r->cols); return NULL; }
        added++;
        r->count++;
    }
    return cols_take(&r->cols, mask);
}

static PyObject *Reader_record(Reader *r, PyObject *unused) {
    const uint8_t *data;
    Py_ssize_t n;
    long long offset, index = r->index;
    int rc = rd_record(r, &data, &n, &offset);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return Py_BuildValue("(LLy#)", index, offset, PTR(data), n);
}

/* A JSON document without its workload_graph: the text of an object holding its other
 * top-level members in order, read through the bounded buffer; None where the reference must
 * read the document. */
static PyObject *Reader_json_metadata(Reader *r, PyObject *unused) {
    if (r->fmt != 2 || r->js_state != 0) {
        PyErr_SetString(PyExc_ValueError, "json_metadata() needs a fresh JSON reader");
        return NULL;
    }
    U8Vec meta = {NULL, 0, 0};
    long long arr = 0;
    if (VEC_PUSH(meta, '{') < 0) return NULL;
    int rc = js_scan(r, &arr, &meta);
    r->js_state = 2;
    if (rc == OK && VEC_PUSH(meta, '}') < 0) rc = FAIL;
    if (rc != OK) {
        VEC_FREE(meta);
        if (rc == FAIL && !PyErr_ExceptionMatches(g_trace_error) &&
            !PyErr_ExceptionMatches(g_read_errors))
            return NULL; /* out of memory */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)meta.v, meta.n);
    VEC_FREE(meta);
    return out;
}

static PyObject *Reader_raise_error(Reader *r, PyObject *unused) {
    if (!r->etype) Py_RETURN_NONE;
    PyErr_Restore(r->etype, r->evalue, r->etb);
    r->etype = r->evalue = r->etb = NULL;
    return NULL;
}

static PyObject *Reader_unusual(Reader *r, PyObject *unused) {
    if (r->status != ST_UNUSUAL) Py_RETURN_NONE;
    PyObject *data = r->u_data ? r->u_data : Py_None;
    return Py_BuildValue("(LLO)", r->u_index, r->u_offset, data);
}

static PyObject *Reader_fingerprint(Reader *r, PyObject *unused) {
    uint64_t w[2] = {r->hash.a, r->hash.b};
    return PyBytes_FromStringAndSize((const char *)w, 16);
}

static PyObject *Reader_get_status(Reader *r, void *c) { return PyLong_FromLong(r->status); }
static PyObject *Reader_get_count(Reader *r, void *c) { return PyLong_FromLongLong(r->count); }
static PyObject *Reader_get_index(Reader *r, void *c) { return PyLong_FromLongLong(r->index); }

static void Reader_dealloc(Reader *r) {
    Py_XDECREF(r->stream);
    Py_XDECREF(r->name);
    Py_XDECREF(r->etype); Py_XDECREF(r->evalue); Py_XDECREF(r->etb);
    Py_XDECREF(r->u_data);
    if (!g_spare_buf && r->buf && r->cap <= SPARE_MAX) { g_spare_buf = r->buf; g_spare_cap = r->cap; }
    else PyMem_Free(r->buf);
    r->buf = NULL;
    rec_free(&r->rec);
    VEC_FREE(r->jx.ctrl2);
    cols_free(&r->cols);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int Reader_init(Reader *r, PyObject *args, PyObject *kw) {
    static char *names[] = {"stream", "fmt", "name", "initial", "base", "index", "chunk", "hashing", NULL};
    PyObject *stream, *name;
    Py_buffer initial;
    int fmt, hashing = 0;
    long long base = 0, index = 0;
    Py_ssize_t chunk = 1 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiUy*|LLnp", names, &stream, &fmt, &name, &initial,
                                     &base, &index, &chunk, &hashing))
        return -1;
    if (!g_ready) {
        PyBuffer_Release(&initial);
        PyErr_SetString(PyExc_RuntimeError, "stg.trace._chakra.setup() was not called");
        return -1;
    }
    if (fmt != 4 && fmt != 1 && fmt != 2) {
        PyBuffer_Release(&initial);
        PyErr_SetString(PyExc_ValueError, "fmt must be 4 (v0.0.4), 1 (v0.0.1) or 2 (json)");
        return -1;
    }
    Py_INCREF(stream); Py_XSETREF(r->stream, stream);
    Py_INCREF(name); Py_XSETREF(r->name, name);
    r->fmt = fmt;
    r->len = r->pos = 0;
    if (!r->buf && g_spare_buf) {
        r->buf = g_spare_buf; r->cap = g_spare_cap;
        g_spare_buf = NULL; g_spare_cap = 0;
    }
    r->readinto = PyObject_HasAttr(stream, s_readinto);
    if (initial.len) {
        if (grow((void **)&r->buf, &r->cap, initial.len, 1) < 0) { PyBuffer_Release(&initial); return -1; }
        memcpy(r->buf, initial.buf, (size_t)initial.len);
        r->len = initial.len;
    }
    PyBuffer_Release(&initial);
    r->base = base;
    r->index = index;
    r->chunk = chunk > 0 ? chunk : 1;
    r->hashing = hashing;
    r->hash.a = 0x243F6A8885A308D3ULL;
    r->hash.b = 0x13198A2E03707344ULL;
    r->eof = 0;
    r->status = ST_MORE;
    r->js_state = 0;
    r->count = 0;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The drain: stg.trace.stats.analyze over a compiled ETFeeder                                 */

typedef struct { int64_t *k; int64_t *v; uint8_t *u; size_t cap, n; } Map;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}
static void map_free(Map *m) { PyMem_Free(m->k); PyMem_Free(m->v); PyMem_Free(m->u); memset(m, 0, sizeof(*m)); }
static int map_rehash(Map *m, size_t cap) {
    int64_t *ok = m->k, *ov = m->v; uint8_t *ou = m->u; size_t ocap = m->cap;
    m->k = PyMem_Malloc(cap * 8); m->v = PyMem_Malloc(cap * 8); m->u = PyMem_Calloc(cap, 1);
    if (!m->k || !m->v || !m->u) { PyErr_NoMemory(); return -1; }
    m->cap = cap;
    for (size_t i = 0; i < ocap; i++) {
        if (!ou[i]) continue;
        size_t j = mix64((uint64_t)ok[i]) & (cap - 1);
        while (m->u[j]) j = (j + 1) & (cap - 1);
        m->u[j] = 1; m->k[j] = ok[i]; m->v[j] = ov[i];
    }
    PyMem_Free(ok); PyMem_Free(ov); PyMem_Free(ou);
    return 0;
}
static inline long long map_find(const Map *m, int64_t key) {
    if (!m->cap) return -1;
    size_t j = mix64((uint64_t)key) & (m->cap - 1);
    while (m->u[j]) {
        if (m->k[j] == key) return (long long)j;
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}
static int map_put(Map *m, int64_t key, int64_t val) {
    if ((m->n + 1) * 2 > m->cap && map_rehash(m, m->cap ? m->cap * 2 : 64) < 0) return -1;
    size_t j = mix64((uint64_t)key) & (m->cap - 1);
    while (m->u[j]) {
        if (m->k[j] == key) { m->v[j] = val; return 0; }
        j = (j + 1) & (m->cap - 1);
    }
    m->u[j] = 1; m->k[j] = key; m->v[j] = val; m->n++;
    return 0;
}
static void map_del_at(Map *m, size_t j) {
    size_t mask = m->cap - 1;
    m->u[j] = 0;
    m->n--;
    size_t i = (j + 1) & mask;
    while (m->u[i]) {
        size_t home = mix64((uint64_t)m->k[i]) & mask;
        /* move i back to j when j lies cyclically in [home, i) */
        if ((i > j && (home <= j || home > i)) || (i < j && (home <= j && home > i))) {
            m->k[j] = m->k[i]; m->v[j] = m->v[i]; m->u[j] = 1; m->u[i] = 0;
            j = i;
        }
        i = (i + 1) & mask;
    }
}

enum { S_BLOCKED, S_READY, S_ISSUED, S_FREED };

typedef struct {
    int64_t id;
    int state, pending;
    I32Vec children;
    int64_t *deps; int ndeps, deps_cap;
    int type, ctype;
    int64_t num_ops, tensor, csize, runtime;
} Slot;

typedef struct {
    Slot *slots; Py_ssize_t nslots, slots_cap;
    I32Vec free_slots;
    Map live, waiting, others;
    I32Vec *wls; Py_ssize_t nwls, wls_cap;
    I32Vec free_wls;
    I64Vec starts, ends;
    int64_t *heap; Py_ssize_t hn, hcap;
    int eof;
    long long blocked, in_flight;
    Py_ssize_t window, refill_below;
    int use_ctrl;
    /* depth and span per id */
    int64_t *dd, *ds; Py_ssize_t dcap; long long dcount;
    Map dmap;  /* id -> index into dxv */
    I64Vec dxd, dxs;
    I64Vec merged;
    long long read;  /* nodes read */
} Drain;

#define FALLBACK 2

static int heap_push(Drain *d, int64_t v) {
    if (grow((void **)&d->heap, &d->hcap, d->hn + 1, 8) < 0) return -1;
    Py_ssize_t i = d->hn++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (d->heap[p] <= v) break;
        d->heap[i] = d->heap[p];
        i = p;
    }
    d->heap[i] = v;
    return 0;
}
static int64_t heap_pop(Drain *d) {
    int64_t top = d->heap[0], last = d->heap[--d->hn];
    Py_ssize_t i = 0, n = d->hn;
    while (1) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && d->heap[c + 1] < d->heap[c]) c++;
        if (d->heap[c] >= last) break;
        d->heap[i] = d->heap[c];
        i = c;
    }
    if (n) d->heap[i] = last;
    return top;
}

static int seen_has(Drain *d, int64_t v) {
    Py_ssize_t n = d->ends.n;
    if (!n || d->ends.v[n - 1] <= v) return 0;
    if (map_find(&d->others, v) >= 0) return 1;
    Py_ssize_t lo = 0, hi = n; /* bisect_right(starts, v) */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (d->starts.v[mid] <= v) lo = mid + 1; else hi = mid;
    }
    Py_ssize_t i = lo - 1;
    return i >= 0 && v < d->ends.v[i];
}
static int seen_add(Drain *d, int64_t v) {
    Py_ssize_t n = d->ends.n;
    if (n && d->ends.v[n - 1] == v) {
        if (v == INT64_MAX) return FALLBACK;
        d->ends.v[n - 1] = v + 1;
        return 0;
    }
    if (!n || v > d->ends.v[n - 1]) {
        if (v == INT64_MAX) return FALLBACK;
        if (VEC_PUSH(d->starts, v) < 0 || VEC_PUSH(d->ends, v + 1) < 0) return -1;
        return 0;
    }
    return map_put(&d->others, v, 1);
}

static int dv_set(Drain *d, int64_t key, int64_t depth, int64_t span) {
    d->dcount++;
    if (key >= 0 && key < d->dcap) { d->dd[key] = depth; d->ds[key] = span; return 0; }
    if (key >= 0 && key < 2 * d->dcount + 65536) {
        Py_ssize_t cap = d->dcap * 2 > key + 1 ? d->dcap * 2 : key + 1;
        int64_t *a = PyMem_Realloc(d->dd, (size_t)cap * 8), *b;
        if (!a) { PyErr_NoMemory(); return -1; }
        d->dd = a;
        b = PyMem_Realloc(d->ds, (size_t)cap * 8);
        if (!b) { PyErr_NoMemory(); return -1; }
        d->ds = b;
        memset(d->dd + d->dcap, 0, (size_t)(cap - d->dcap) * 8);
        memset(d->ds + d->dcap, 0, (size_t)(cap - d->dcap) * 8);
        d->dcap = cap;
        d->dd[key] = depth; d->ds[key] = span;
        return 0;
    }
    long long j = map_find(&d->dmap, key);
    if (j >= 0) { d->dxd.v[d->dmap.v[j]] = depth; d->dxs.v[d->dmap.v[j]] = span; return 0; }
    if (map_put(&d->dmap, key, d->dxd.n) < 0) return -1;
    if (VEC_PUSH(d->dxd, depth) < 0 || VEC_PUSH(d->dxs, span) < 0) return -1;
    return 0;
}
static void dv_get(Drain *d, int64_t key, int64_t *depth, int64_t *span) {
    if (key >= 0 && key < d->dcap) { *depth = d->dd[key]; *span = d->ds[key]; return; }
    long long j = map_find(&d->dmap, key);
    if (j >= 0) { *depth = d->dxd.v[d->dmap.v[j]]; *span = d->dxs.v[d->dmap.v[j]]; return; }
    *depth = 0; *span = 0;
}

static int slot_alloc(Drain *d) {
    if (d->free_slots.n) return d->free_slots.v[--d->free_slots.n];
    if (grow((void **)&d->slots, &d->slots_cap, d->nslots + 1, sizeof(Slot)) < 0) return -1;
    memset(&d->slots[d->nslots], 0, sizeof(Slot));
    return (int)d->nslots++;
}

/* A scratch hash set of int64 for one node's deps (the GIL guards it): entries of an older
 * generation count as empty, so starting a set costs nothing. */
static int64_t *g_set_keys = NULL;
static uint32_t *g_set_gen = NULL;
static size_t g_set_cap = 0;
static uint32_t g_set_now = 0;

/* Start an empty set for up to n values: 0, -1 out of memory. */
static int set_begin(Py_ssize_t n) {
    size_t cap = 64;
    while (cap < (size_t)n * 2) cap <<= 1;
    if (cap > g_set_cap) {
        int64_t *k = PyMem_Realloc(g_set_keys, cap * 8);
        if (!k) { PyErr_NoMemory(); return -1; }
        g_set_keys = k;
        uint32_t *g = PyMem_Realloc(g_set_gen, cap * 4);
        if (!g) { PyErr_NoMemory(); return -1; }
        g_set_gen = g;
        memset(g_set_gen, 0, cap * 4);
        g_set_cap = cap;
        g_set_now = 0;
    }
    if (++g_set_now == 0) { memset(g_set_gen, 0, g_set_cap * 4); g_set_now = 1; }
    return 0;
}

/* Add x: 1 if it was there already, else 0. */
static inline int set_add(int64_t x) {
    size_t mask = g_set_cap - 1, h = (size_t)mix64((uint64_t)x) & mask;
    while (g_set_gen[h] == g_set_now) {
        if (g_set_keys[h] == x) return 1;
        h = (h + 1) & mask;
    }
    g_set_gen[h] = g_set_now;
    g_set_keys[h] = x;
    return 0;
}

static inline int set_has(int64_t x) {
    size_t mask = g_set_cap - 1, h = (size_t)mix64((uint64_t)x) & mask;
    while (g_set_gen[h] == g_set_now) {
        if (g_set_keys[h] == x) return 1;
        h = (h + 1) & mask;
    }
    return 0;
}

/* Whether v holds a value twice (-1: out of memory). */
static int has_dup(const int64_t *v, Py_ssize_t n) {
    if (n <= 24) {
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (v[i] == v[j]) return 1;
        return 0;
    }
    if (set_begin(n) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) if (set_add(v[i])) return 1;
    return 0;
}

/* Whether x is among v[0..n). */
static int contains(const int64_t *v, Py_ssize_t n, int64_t x) {
    for (Py_ssize_t i = 0; i < n; i++) if (v[i] == x) return 1;
    return 0;
}

static int dr_stuck(Drain *d) {
    return !(d->hn || d->in_flight || !d->blocked || d->waiting.n);
}

static int dr_fill(Drain *d, Reader *r) {
    while ((Py_ssize_t)d->live.n < d->window || d->waiting.n) {
        int rc = rd_next(r);
        if (rc < 0) return -1;
        if (rc == 0) { d->eof = 1; break; }
        if (rc == 2) return FALLBACK;
        Rec *rec = &r->rec;
        if (!rec_fits(rec)) return FALLBACK;
        d->read++;
        int64_t nid = (int64_t)rec->id;
        if (seen_has(d, nid)) return FALLBACK;          /* duplicate id */
        rc = seen_add(d, nid);
        if (rc) return rc;
        if (rec->data.n > 1 && (rc = has_dup(rec->data.v, rec->data.n))) return rc < 0 ? -1 : FALLBACK;
        d->merged.n = 0;
        for (Py_ssize_t i = 0; i < rec->data.n; i++) if (VEC_PUSH(d->merged, rec->data.v[i]) < 0) return -1;
        if (d->use_ctrl && rec->ctrl.n) {
            if (rec->ctrl.n > 1 && (rc = has_dup(rec->ctrl.v, rec->ctrl.n))) return rc < 0 ? -1 : FALLBACK;
            int hashed = rec->data.n > 16 && rec->ctrl.n > 4;
            if (hashed) {
                if (set_begin(rec->data.n) < 0) return -1;
                for (Py_ssize_t i = 0; i < rec->data.n; i++) set_add(rec->data.v[i]);
            }
            for (Py_ssize_t i = 0; i < rec->ctrl.n; i++) {
                int64_t p = rec->ctrl.v[i];
                int in_data = hashed ? set_has(p) : contains(rec->data.v, rec->data.n, p);
                if (!in_data && VEC_PUSH(d->merged, p) < 0) return -1;
            }
        }
        int si = slot_alloc(d);
        if (si < 0) return -1;
        Slot *s = &d->slots[si];
        s->id = nid;
        s->state = S_BLOCKED;
        s->pending = 0;
        s->children.n = 0;
        s->type = (int)rec->type;
        s->ctype = rec->comm_type;
        s->num_ops = rec->wk_has[WK_NUM_OPS] ? rec->wk_val[WK_NUM_OPS] : 0;
        s->tensor = rec->wk_has[WK_TENSOR] ? rec->wk_val[WK_TENSOR] : 0;
        s->csize = rec->wk_has[WK_COMM_SIZE] ? rec->wk_val[WK_COMM_SIZE] : 0;
        s->runtime = (int64_t)rec->dur;
        /* parents for the critical path: data deps, plus ctrl deps with data+ctrl */
        Py_ssize_t nd = rec->data.n + (d->use_ctrl ? rec->ctrl.n : 0);
        if (nd > s->deps_cap) {
            Py_ssize_t cap = s->deps_cap;
            if (grow((void **)&s->deps, &cap, nd, 8) < 0) return -1;
            s->deps_cap = (int)cap;
        }
        memcpy(s->deps, rec->data.v, (size_t)rec->data.n * 8);
        if (d->use_ctrl && rec->ctrl.n) memcpy(s->deps + rec->data.n, rec->ctrl.v, (size_t)rec->ctrl.n * 8);
        s->ndeps = (int)nd;
        int pending = 0;
        for (Py_ssize_t i = 0; i < d->merged.n; i++) {
            int64_t p = d->merged.v[i];
            long long j = map_find(&d->live, p);
            if (j >= 0) {
                Slot *ps = &d->slots[d->live.v[j]];
                if (ps->state != S_FREED) {
                    if (VEC_PUSH(ps->children, si) < 0) return -1;
                    s = &d->slots[si];
                    pending++;
                }
            } else if (p == nid) {
                return FALLBACK;                           /* depends on itself */
            } else if (!seen_has(d, p)) {
                pending++;
                long long w = map_find(&d->waiting, p);
                int wi;
                if (w >= 0) {
                    wi = (int)d->waiting.v[w];
                } else {
                    if (d->free_wls.n) wi = d->free_wls.v[--d->free_wls.n];
                    else {
                        if (grow((void **)&d->wls, &d->wls_cap, d->nwls + 1, sizeof(I32Vec)) < 0) return -1;
                        memset(&d->wls[d->nwls], 0, sizeof(I32Vec));
                        wi = (int)d->nwls++;
                    }
                    d->wls[wi].n = 0;
                    if (map_put(&d->waiting, p, wi) < 0) return -1;
                }
                if (VEC_PUSH(d->wls[wi], si) < 0) return -1;
            }
        }
        if (map_put(&d->live, nid, si) < 0) return -1;
        long long w = map_find(&d->waiting, nid);
        if (w >= 0) {
            int wi = (int)d->waiting.v[w];
            map_del_at(&d->waiting, (size_t)w);
            I32Vec t = s->children; s->children = d->wls[wi]; d->wls[wi] = t;
            d->wls[wi].n = 0;
            if (VEC_PUSH(d->free_wls, wi) < 0) return -1;
        }
        if (pending) {
            s->pending = pending;
            d->blocked++;
        } else {
            s->state = S_READY;
            if (heap_push(d, nid) < 0) return -1;
        }
    }
    if (d->eof && d->waiting.n) return FALLBACK;          /* a parent that never appears */
    return 0;
}

static void drain_free(Drain *d) {
    for (Py_ssize_t i = 0; i < d->nslots; i++) { VEC_FREE(d->slots[i].children); PyMem_Free(d->slots[i].deps); }
    PyMem_Free(d->slots);
    VEC_FREE(d->free_slots);
    map_free(&d->live); map_free(&d->waiting); map_free(&d->others); map_free(&d->dmap);
    for (Py_ssize_t i = 0; i < d->nwls; i++) VEC_FREE(d->wls[i]);
    PyMem_Free(d->wls);
    VEC_FREE(d->free_wls); VEC_FREE(d->starts); VEC_FREE(d->ends);
    PyMem_Free(d->heap);
    PyMem_Free(d->dd); PyMem_Free(d->ds);
    VEC_FREE(d->dxd); VEC_FREE(d->dxs); VEC_FREE(d->merged);
}

/* stats being gathered */
typedef struct {
    long long nodes, rounds, max_width, crit;
    int64_t crit_us;
    __int128 flops, tbytes, sbytes, rbytes;
    long long scount, rcount;
    long long type_count[8]; int type_order[8]; int ntypes;
    long long coll_count[11]; __int128 coll_bytes[11]; int coll_order[11]; int ncolls;
} Stats;

static int drain_run(Drain *d, Reader *r, Stats *st) {
    I32Vec wave = {0};
    int rc = dr_fill(d, r);
    while (rc == 0) {
        /* has_nodes_to_issue */
        if (!d->live.n) {
            if (d->eof) break;
            if ((rc = dr_fill(d, r))) break;
            if (!d->live.n) break;
        }
        if (!d->hn && dr_stuck(d)) { rc = FALLBACK; break; }
        wave.n = 0;
        while (1) { /* get_next_issuable_node until None */
            if (!d->hn) {
                if (!d->eof && (Py_ssize_t)d->live.n < d->window && (rc = dr_fill(d, r))) break;
                if (!d->hn) {
                    if (dr_stuck(d)) rc = FALLBACK;
                    break;
                }
            }
            int64_t nid = heap_pop(d);
            long long j = map_find(&d->live, nid);
            int si = (int)d->live.v[j];
            d->slots[si].state = S_ISSUED;
            d->in_flight++;
            if (VEC_PUSH(wave, si) < 0) { rc = -1; break; }
        }
        if (rc) break;
        if (!wave.n) { rc = FALLBACK; break; }
        st->rounds++;
        if (wave.n > st->max_width) st->max_width = wave.n;
        for (Py_ssize_t k = 0; k < wave.n; k++) {
            Slot *s = &d->slots[wave.v[k]];
            int64_t dep = 0, sp = 0;
            for (int i = 0; i < s->ndeps; i++) {
                int64_t pd, ps;
                dv_get(d, s->deps[i], &pd, &ps);
                if (pd > dep) dep = pd;
                if (ps > sp) sp = ps;
            }
            dep += 1;
            if (__builtin_add_overflow(sp, s->runtime, &sp)) { rc = FALLBACK; break; }
            if (dv_set(d, s->id, dep, sp) < 0) { rc = -1; break; }
            if (dep > st->crit) st->crit = dep;
            if (sp > st->crit_us) st->crit_us = sp;
            st->nodes++;
            if (!st->type_count[s->type]++) st->type_order[st->ntypes++] = s->type;
            if (s->type == 4) st->flops += s->num_ops;
            st->tbytes += s->tensor;
            if (s->type == 7) {
                int c = s->ctype + 1; /* 0 = UNSET */
                if (!st->coll_count[c]++) st->coll_order[st->ncolls++] = c;
                st->coll_bytes[c] += s->csize;
            } else if (s->type == 5) {
                st->scount++; st->sbytes += s->csize;
            } else if (s->type == 6) {
                st->rcount++; st->rbytes += s->csize;
            }
        }
        if (rc) break;
        for (Py_ssize_t k = 0; k < wave.n; k++) { /* free_children_nodes */
            Slot *s = &d->slots[wave.v[k]];
            s->state = S_FREED;
            d->in_flight--;
            for (Py_ssize_t c = 0; c < s->children.n; c++) {
                Slot *ch = &d->slots[s->children.v[c]];
                if (--ch->pending == 0) {
                    ch->state = S_READY;
                    d->blocked--;
                    if (heap_push(d, ch->id) < 0) { rc = -1; break; }
                }
            }
            if (rc) break;
        }
        if (rc) break;
        for (Py_ssize_t k = 0; k < wave.n; k++) { /* remove_node */
            int si = wave.v[k];
            long long j = map_find(&d->live, d->slots[si].id);
            map_del_at(&d->live, (size_t)j);
            d->slots[si].children.n = 0;
            if (VEC_PUSH(d->free_slots, si) < 0) { rc = -1; break; }
            if ((Py_ssize_t)d->live.n < d->refill_below && !d->eof && (rc = dr_fill(d, r))) break;
        }
        if (rc) break;
    }
    VEC_FREE(wave);
    return rc;
}

static PyObject *Reader_drain(Reader *r, PyObject *args) {
    Py_ssize_t window;
    int use_ctrl;
    if (!PyArg_ParseTuple(args, "np", &window, &use_ctrl)) return NULL;
    Drain d;
    memset(&d, 0, sizeof(d));
    d.window = window;
    d.refill_below = window - window / 8;
    d.use_ctrl = use_ctrl;
    Stats st;
    memset(&st, 0, sizeof(st));
    int rc = drain_run(&d, r, &st);
    drain_free(&d);
    if (rc == 0 && d.read == 0) rc = FALLBACK; /* no nodes: the reference rejects the file */
    if (rc < 0) {
        if (PyErr_ExceptionMatches(g_trace_error)) { PyErr_Clear(); Py_RETURN_NONE; }
        return NULL;
    }
    if (rc == FALLBACK) Py_RETURN_NONE;
    PyObject *types = PyList_New(st.ntypes), *colls = PyList_New(st.ncolls);
    if (!types || !colls) { Py_XDECREF(types); Py_XDECREF(colls); return NULL; }
    for (int i = 0; i < st.ntypes; i++) {
        int t = st.type_order[i];
        PyList_SET_ITEM(types, i, Py_BuildValue("(iL)", t, st.type_count[t]));
    }
    for (int i = 0; i < st.ncolls; i++) {
        int c = st.coll_order[i];
        PyObject *b = long_from_i128(st.coll_bytes[c]);
        PyObject *ct = c ? PyLong_FromLong(c - 1) : (Py_INCREF(Py_None), Py_None);
        PyList_SET_ITEM(colls, i, Py_BuildValue("(NLN)", ct, st.coll_count[c], b));
    }
    return Py_BuildValue("{sLsLsLsLsLsNsNsLsNsLsNsNsN}",
                         "nodes", st.nodes, "rounds", st.rounds, "max_width", st.max_width,
                         "critical_path", st.crit, "critical_path_us", (long long)st.crit_us,
                         "flops", long_from_i128(st.flops), "tensor_bytes", long_from_i128(st.tbytes),
                         "send_count", st.scount, "send_bytes", long_from_i128(st.sbytes),
                         "recv_count", st.rcount, "recv_bytes", long_from_i128(st.rbytes),
                         "by_type", types, "collectives", colls);
}

/* ------------------------------------------------------------------------------------------ */
/* Per-rank summaries: stg validate and stg predict                                            */

static inline int is_comm_type(int t) { return t == 5 || t == 6 || t == 7; }

static PyObject *none_or_raise(void) {
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(g_trace_error)) return NULL;
    PyErr_Clear();
    Py_RETURN_NONE;
}

/* rank_summary(world, rank, astra): the whole rank file through the checks of stg validate.
 * Returns None unless every node passes every per-node and structure check (then the
 * reference reports what is wrong), else a dict: nodes, colls (group, id, type, size),
 * sends and recvs (id, peer, tag, size), and the communication skeleton: skel_ids (the comm
 * nodes, in file order), skel_off/skel_par (their nearest comm ancestors, by id). */
static PyObject *Reader_rank_summary(Reader *r, PyObject *args) {
    long long world, rank;
    int astra;
    if (!PyArg_ParseTuple(args, "LLp", &world, &rank, &astra)) return NULL;
    I64Vec ids = {0}, off = {0}, par = {0}, colls = {0}, sends = {0}, recvs = {0};
    I64Vec ppos = {0}, order = {0}, fstart = {0}, flen = {0}, fval = {0}, sids = {0}, soff = {0}, spar = {0};
    U8Vec types = {0};
    int64_t *stamp = NULL, *indeg = NULL;
    I64Vec koff = {0}, kids = {0};
    Map pos = {0};
    PyObject *res = NULL;
    int ok = 1;
    if (VEC_PUSH(off, 0) < 0) goto fail;
    while (ok) {
        int rc = rd_next(r);
        if (rc < 0) { res = none_or_raise(); goto done; }
        if (rc == 0) break;
        if (rc == 2) { ok = 0; break; }
        Rec *x = &r->rec;
        if (!rec_fits(x) || x->special) { ok = 0; break; }
        /* a negative count of ops or bytes (the negative-size check): the reference reports it */
        if ((x->wk_has[WK_NUM_OPS] && x->wk_val[WK_NUM_OPS] < 0) ||
            (x->wk_has[WK_TENSOR] && x->wk_val[WK_TENSOR] < 0) ||
            (x->wk_has[WK_COMM_SIZE] && x->wk_val[WK_COMM_SIZE] < 0)) { ok = 0; break; }
        int t = (int)x->type;
        if (x->fmt == 4 && !x->has_cpu && (t == 4 || is_comm_type(t))) { ok = 0; break; }
        int64_t id = (int64_t)x->id;
        if (t == 4) {
            int64_t ops = x->wk_has[WK_NUM_OPS] ? x->wk_val[WK_NUM_OPS] : 0;
            int64_t size = x->wk_has[WK_TENSOR] ? x->wk_val[WK_TENSOR] : 0;
            if (ops <= 0 && size > 0) { ok = 0; break; }
        } else if (t == 7) {
            int c = x->comm_type;
            if (x->cpu || c < 0 || !(c == 0 || c == 2 || c == 6 || c == 7)) { ok = 0; break; }
            int64_t g = x->has_group ? x->group : 0;
            int64_t size = x->wk_has[WK_COMM_SIZE] ? x->wk_val[WK_COMM_SIZE] : 0;
            if (VEC_PUSH(colls, g) < 0 || VEC_PUSH(colls, id) < 0 || VEC_PUSH(colls, (int64_t)c) < 0 ||
                VEC_PUSH(colls, size) < 0) goto fail;
        } else if (t == 5 || t == 6) {
            int peer_wk = t == 5 ? WK_DST : WK_SRC, own_wk = t == 5 ? WK_SRC : WK_DST;
            if (x->cpu || !x->wk_has[peer_wk] || !x->wk_has[WK_TAG]) { ok = 0; break; }
            int64_t peer = x->wk_val[peer_wk], tag = x->wk_val[WK_TAG];
            if ((rank >= 0 && peer == rank) || peer < 0 || (world >= 0 && peer >= world)) { ok = 0; break; }
            if (tag < 0 || tag >= 500000000) { ok = 0; break; }
            if (x->wk_has[own_wk] && rank >= 0 && x->wk_val[own_wk] != rank) { ok = 0; break; }
            int64_t size = x->wk_has[WK_COMM_SIZE] ? x->wk_val[WK_COMM_SIZE] : 0;
            I64Vec *out = t == 5 ? &sends : &recvs;
            if (VEC_PUSH(*out, id) < 0 || VEC_PUSH(*out, peer) < 0 || VEC_PUSH(*out, tag) < 0 ||
                VEC_PUSH(*out, size) < 0) goto fail;
        }
        if (VEC_PUSH(ids, id) < 0 || VEC_PUSH(types, (uint8_t)t) < 0) goto fail;
        for (Py_ssize_t i = 0; i < x->data.n; i++) if (VEC_PUSH(par, x->data.v[i]) < 0) goto fail;
        for (Py_ssize_t i = 0; i < x->ctrl.n; i++) if (VEC_PUSH(par, x->ctrl.v[i]) < 0) goto fail;
        if (VEC_PUSH(off, (int64_t)par.n) < 0) goto fail;
    }
    Py_ssize_t n = ids.n;
    if (!ok || n == 0) { Py_INCREF(Py_None); res = Py_None; goto done; }
    /* ids unique; deps exist, each once per node */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (map_find(&pos, ids.v[i]) >= 0) { ok = 0; break; }
        if (map_put(&pos, ids.v[i], (int64_t)i) < 0) goto fail;
    }
    int backward = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int64_t a = off.v[i], b = off.v[i + 1];
        int dup = has_dup(par.v + a, b - a);
        if (dup < 0) goto fail;
        if (dup) ok = 0;
        for (int64_t k = a; ok && k < b; k++) {
            long long j = map_find(&pos, par.v[k]);
            if (j < 0) { ok = 0; break; }
            int64_t pp = pos.v[j];
            if (pp >= (int64_t)i) backward = 0;
            if (VEC_PUSH(ppos, pp) < 0) goto fail;
        }
    }
    if (!ok) { Py_INCREF(Py_None); res = Py_None; goto done; }
    /* a topological order: file order when every parent comes first, else Kahn's */
    if (backward) {
        for (Py_ssize_t i = 0; i < n; i++) if (VEC_PUSH(order, (int64_t)i) < 0) goto fail;
    } else {
        indeg = PyMem_Calloc((size_t)n, 8);
        if (!indeg) { PyErr_NoMemory(); goto fail; }
        int64_t *kahn_indeg = indeg;
        /* children CSR */
        int64_t *cnt = PyMem_Calloc((size_t)n + 1, 8);
        if (!cnt) { PyErr_NoMemory(); goto fail; }
        for (Py_ssize_t k = 0; k < ppos.n; k++) cnt[ppos.v[k] + 1]++;
        for (Py_ssize_t i = 0; i < n; i++) cnt[i + 1] += cnt[i];
        if (grow((void **)&kids.v, &kids.cap, ppos.n ? ppos.n : 1, 8) < 0) { PyMem_Free(cnt); goto fail; }
        kids.n = ppos.n;
        for (Py_ssize_t i = 0; i < n; i++) {
            indeg[i] = off.v[i + 1] - off.v[i];
            for (int64_t k = off.v[i]; k < off.v[i + 1]; k++) kids.v[cnt[ppos.v[k]]++] = (int64_t)i;
        }
        /* cnt[p] now ends p's children; starts are cnt[p-1] */
        for (Py_ssize_t i = 0; i < n; i++) if (!indeg[i] && VEC_PUSH(order, (int64_t)i) < 0) { PyMem_Free(cnt); goto fail; }
        for (Py_ssize_t h = 0; h < order.n; h++) {
            int64_t p = order.v[h];
            int64_t s0 = p ? cnt[p - 1] : 0;
            for (int64_t k = s0; k < cnt[p]; k++) {
                int64_t c = kids.v[k];
                if (--indeg[c] == 0 && VEC_PUSH(order, c) < 0) { PyMem_Free(cnt); goto fail; }
            }
        }
        PyMem_Free(cnt);
        PyMem_Free(kahn_indeg);
        indeg = NULL;
        if (order.n != n) { Py_INCREF(Py_None); res = Py_None; goto done; } /* a cycle */
    }
    /* nearest comm ancestors, in topological order */
    stamp = PyMem_Malloc((size_t)n * 8);
    indeg = PyMem_Malloc((size_t)n * 8); /* reused: skeleton index of each comm node */
    if (!stamp || !indeg) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t i = 0; i < n; i++) stamp[i] = -1;
    if (grow((void **)&fstart.v, &fstart.cap, n, 8) < 0 || grow((void **)&flen.v, &flen.cap, n, 8) < 0) goto fail;
    int full = 0;
    if (VEC_PUSH(soff, 0) < 0) goto fail;
    for (Py_ssize_t h = 0; h < n && !full; h++) {
        int64_t i = order.v[h];
        Py_ssize_t start = fval.n;
        /* the parent whose set is the largest: when the union adds nothing to it, share it */
        int64_t big = -1;
        for (int64_t k = off.v[i]; k < off.v[i + 1]; k++) {
            int64_t p = ppos.v[k];
            if (!is_comm_type(types.v[p]) && (big < 0 || flen.v[p] > flen.v[big])) big = p;
        }
        for (int64_t k = off.v[i]; k < off.v[i + 1]; k++) {
            int64_t p = ppos.v[k];
            if (is_comm_type(types.v[p])) {
                if (stamp[p] != i) { stamp[p] = i; if (VEC_PUSH(fval, p) < 0) goto fail; }
            } else {
                for (int64_t q = fstart.v[p]; q < fstart.v[p] + flen.v[p]; q++) {
                    int64_t a = fval.v[q];
                    if (stamp[a] != i) { stamp[a] = i; if (VEC_PUSH(fval, a) < 0) goto fail; }
                }
            }
        }
        if (fval.n - start > 65536 || fval.n > 64 * (Py_ssize_t)n + 1024) { full = 1; break; }
        if (!is_comm_type(types.v[i]) && big >= 0 && fval.n - start == flen.v[big]) {
            fval.n = start; /* the same set as that parent's */
            fstart.v[i] = fstart.v[big];
            flen.v[i] = flen.v[big];
            continue;
        }
        if (is_comm_type(types.v[i])) {
            fstart.v[i] = start; flen.v[i] = 0;
            indeg[i] = sids.n;
            if (VEC_PUSH(sids, ids.v[i]) < 0) goto fail;
            for (Py_ssize_t q = start; q < fval.n; q++) if (VEC_PUSH(spar, indeg[fval.v[q]]) < 0) goto fail;
            if (VEC_PUSH(soff, (int64_t)spar.n) < 0) goto fail;
            fval.n = start;
        } else {
            fstart.v[i] = start; flen.v[i] = fval.n - start;
        }
    }
    if (full) {
        /* nodes with very many comm ancestors: keep the whole graph as the skeleton */
        sids.n = spar.n = soff.n = 0;
        if (VEC_PUSH(soff, 0) < 0) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (VEC_PUSH(sids, ids.v[i]) < 0) goto fail;
            for (int64_t k = off.v[i]; k < off.v[i + 1]; k++) if (VEC_PUSH(spar, ppos.v[k]) < 0) goto fail;
            if (VEC_PUSH(soff, (int64_t)spar.n) < 0) goto fail;
        }
    }
    res = Py_BuildValue("{sns:y#s:y#s:y#s:y#s:y#s:y#s:O}",
                        "nodes", n,
                        "colls", PTR(colls.v), colls.n * 8,
                        "sends", PTR(sends.v), sends.n * 8,
                        "recvs", PTR(recvs.v), recvs.n * 8,
                        "skel_ids", PTR(sids.v), sids.n * 8,
                        "skel_off", PTR(soff.v), soff.n * 8,
                        "skel_par", PTR(spar.v), spar.n * 8,
                        "full", full ? Py_True : Py_False);
    goto done;
fail:
    res = NULL;
done:
    VEC_FREE(ids); VEC_FREE(off); VEC_FREE(par); VEC_FREE(colls); VEC_FREE(sends); VEC_FREE(recvs);
    VEC_FREE(ppos); VEC_FREE(order); VEC_FREE(fstart); VEC_FREE(flen); VEC_FREE(fval);
    VEC_FREE(sids); VEC_FREE(soff); VEC_FREE(spar); VEC_FREE(types); VEC_FREE(koff); VEC_FREE(kids);
    PyMem_Free(stamp); PyMem_Free(indeg);
    map_free(&pos);
    return res;
}

/* deadlock_free(skeletons, pairs, inst_off, members): stg validate's run of all ranks
 * together (the reference: validate._Checker.deadlock). skeletons: per rank (off, parents) of
 * its graph, parents as indices into that rank's nodes; pairs: int64 quadruples (send rank,
 * send node, recv rank, recv node) of matched sends and receives; inst_off/members: the
 * collective instances, members as int64 pairs (rank, node). Ranks are indices into
 * skeletons. True when every node can run. */
static PyObject *deadlock_free(PyObject *self, PyObject *args) {
    PyObject *skels;
    Py_buffer bp, bo, bm;
    if (!PyArg_ParseTuple(args, "O!y*y*y*", &PyList_Type, &skels, &bp, &bo, &bm)) return NULL;
    Py_ssize_t nr = PyList_GET_SIZE(skels);
    Py_buffer *views = PyMem_Calloc((size_t)(nr ? nr : 1) * 2, sizeof(Py_buffer));
    int64_t *base = PyMem_Calloc((size_t)nr + 1, 8);
    int64_t *indeg = NULL, *coff = NULL, *kids = NULL, *recv_of = NULL, *inst = NULL, *arrived = NULL, *queue = NULL;
    PyObject *res = NULL;
    Py_ssize_t got = 0, n = 0, e = 0;
    if (!views || !base) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t r = 0; r < nr; r++) {
        PyObject *t = PyList_GET_ITEM(skels, r);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) { PyErr_SetString(PyExc_TypeError, "skeletons: (off, parents) tuples"); goto done; }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 0), &views[2 * r], PyBUF_SIMPLE) < 0) goto done;
        got++;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 1), &views[2 * r + 1], PyBUF_SIMPLE) < 0) goto done;
        got++;
        base[r + 1] = base[r] + views[2 * r].len / 8 - 1;
        e += views[2 * r + 1].len / 8;
    }
    n = base[nr];
    const int64_t *pairs = bp.buf, *ioff = bo.buf, *mem = bm.buf;
    Py_ssize_t np = bp.len / 32, ni = bo.len / 8 - 1;
    size_t nn = (size_t)(n > 0 ? n : 1);
    indeg = PyMem_Calloc(nn, 8); coff = PyMem_Calloc(nn + 2, 8); kids = PyMem_Malloc((size_t)(e > 0 ? e : 1) * 8);
    recv_of = PyMem_Malloc(nn * 8); inst = PyMem_Malloc(nn * 8);
    arrived = PyMem_Calloc((size_t)(ni > 0 ? ni : 1), 8); queue = PyMem_Malloc(nn * 8);
    if (!indeg || !coff || !kids || !recv_of || !inst || !arrived || !queue) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) { recv_of[i] = -1; inst[i] = -1; }
    for (Py_ssize_t r = 0; r < nr; r++) {
        const int64_t *off = views[2 * r].buf, *par = views[2 * r + 1].buf;
        for (int64_t i = 0; i < base[r + 1] - base[r]; i++) {
            indeg[base[r] + i] = off[i + 1] - off[i];
            for (int64_t k = off[i]; k < off[i + 1]; k++) coff[base[r] + par[k] + 2]++;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) coff[i + 2] += coff[i + 1];
    for (Py_ssize_t r = 0; r < nr; r++) {
        const int64_t *off = views[2 * r].buf, *par = views[2 * r + 1].buf;
        for (int64_t i = 0; i < base[r + 1] - base[r]; i++)
            for (int64_t k = off[i]; k < off[i + 1]; k++) kids[coff[base[r] + par[k] + 1]++] = base[r] + i;
    }
    for (Py_ssize_t k = 0; k < np; k++) {
        int64_t snd = base[pairs[4 * k]] + pairs[4 * k + 1], rcv = base[pairs[4 * k + 2]] + pairs[4 * k + 3];
        recv_of[snd] = rcv;
        indeg[rcv]++;
    }
    for (Py_ssize_t k = 0; k < ni; k++)
        for (int64_t q = ioff[k]; q < ioff[k + 1]; q++) inst[base[mem[2 * q]] + mem[2 * q + 1]] = (int64_t)k;
    Py_ssize_t head = 0, tail = 0, released = 0;
    for (Py_ssize_t i = 0; i < n; i++) if (!indeg[i]) queue[tail++] = (int64_t)i;
    while (head < tail) {
        int64_t v = queue[head++];
        int64_t idx = inst[v];
        int64_t first = 0, last = 1;
        if (idx >= 0) {
            if (++arrived[idx] < ioff[idx + 1] - ioff[idx]) continue;
            first = ioff[idx];
            last = ioff[idx + 1];
        }
        for (int64_t q = first; q < last; q++) {
            int64_t u = idx >= 0 ? base[mem[2 * q]] + mem[2 * q + 1] : v;
            released++;
            for (int64_t k = coff[u]; k < coff[u + 1]; k++)
                if (--indeg[kids[k]] == 0) queue[tail++] = kids[k];
            if (recv_of[u] >= 0 && --indeg[recv_of[u]] == 0) queue[tail++] = recv_of[u];
        }
    }
    res = PyBool_FromLong(released == n);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views); PyMem_Free(base);
    PyMem_Free(indeg); PyMem_Free(coff); PyMem_Free(kids); PyMem_Free(recv_of);
    PyMem_Free(inst); PyMem_Free(arrived); PyMem_Free(queue);
    PyBuffer_Release(&bp); PyBuffer_Release(&bo); PyBuffer_Release(&bm);
    return res;
}

/* comm_summary(): for stg predict, the communicators and peers of a rank in file order: colls
 * (the group of each collective), sends (destinations), recvs (sources), with nodes (count),
 * problem (a collective without group or type, a send or receive without its peer: the
 * reference reports it) and the fingerprint (with hashing). None to defer to the reference. */
static PyObject *Reader_comm_summary(Reader *r, PyObject *unused) {
    I64Vec colls = {0}, sends = {0}, recvs = {0};
    long long n = 0;
    int problem = 0;
    PyObject *res = NULL;
    while (1) {
        int rc = rd_next(r);
        if (rc < 0) { res = none_or_raise(); goto done; }
        if (rc == 0) break;
        if (rc == 2) { Py_INCREF(Py_None); res = Py_None; goto done; }
        Rec *x = &r->rec;
        if (!rec_fits(x)) { Py_INCREF(Py_None); res = Py_None; goto done; }
        n++;
        int t = (int)x->type;
        int err = 0;
        if (t == 7) {
            if (!x->has_group || x->comm_type < 0) problem = 1;
            err = VEC_PUSH(colls, x->has_group ? x->group : -1);
        } else if (t == 5) {
            if (!x->wk_has[WK_DST]) problem = 1;
            err = VEC_PUSH(sends, x->wk_has[WK_DST] ? x->wk_val[WK_DST] : -1);
        } else if (t == 6) {
            if (!x->wk_has[WK_SRC]) problem = 1;
            err = VEC_PUSH(recvs, x->wk_has[WK_SRC] ? x->wk_val[WK_SRC] : -1);
        }
        if (err) goto done;
    }
    if (n == 0) { Py_INCREF(Py_None); res = Py_None; goto done; }
    uint64_t w[2] = {r->hash.a, r->hash.b};
    res = Py_BuildValue("{sLsOs:y#s:y#s:y#s:y#}", "nodes", n, "problem", problem ? Py_True : Py_False,
                        "colls", PTR(colls.v), colls.n * 8,
                        "sends", PTR(sends.v), sends.n * 8,
                        "recvs", PTR(recvs.v), recvs.n * 8,
                        "fingerprint", (const char *)w, (Py_ssize_t)16);
done:
    VEC_FREE(colls); VEC_FREE(sends); VEC_FREE(recvs);
    return res;
}

static PyMethodDef Reader_methods[] = {
    {"nodes", (PyCFunction)Reader_nodes, METH_VARARGS,
     "nodes(limit) -> list of up to limit Nodes; then see status"},
    {"columns", (PyCFunction)Reader_columns, METH_VARARGS,
     "columns(mask, limit) -> dict of column bytes for up to limit nodes (-1: all)"},
    {"drain", (PyCFunction)Reader_drain, METH_VARARGS,
     "drain(window, use_ctrl) -> statistics dict, or None to defer to the reference"},
    {"record", (PyCFunction)Reader_record, METH_NOARGS,
     "record() -> (index, offset, payload) of the next raw record, or None at the end"},
    {"json_metadata", (PyCFunction)Reader_json_metadata, METH_NOARGS,
     "json_metadata() -> bytes of the document less workload_graph, or None"},
    {"raise_error", (PyCFunction)Reader_raise_error, METH_NOARGS, "raise the stored error"},
    {"unusual", (PyCFunction)Reader_unusual, METH_NOARGS,
     "(index, offset, data) of the record handed back to the reference"},
    {"fingerprint", (PyCFunction)Reader_fingerprint, METH_NOARGS, "16-byte rank fingerprint"},
    {"rank_summary", (PyCFunction)Reader_rank_summary, METH_VARARGS,
     "rank_summary(world, rank, astra) -> the rank's communication for stg validate, or None"},
    {"comm_summary", (PyCFunction)Reader_comm_summary, METH_NOARGS,
     "comm_summary() -> communicators and peers for stg predict, or None"},
    {NULL}};

static PyGetSetDef Reader_getset[] = {
    {"status", (getter)Reader_get_status, NULL, "0 more, 1 end, 2 unusual record, 3 error", NULL},
    {"count", (getter)Reader_get_count, NULL, "nodes decoded", NULL},
    {"index", (getter)Reader_get_index, NULL, "index of the next record", NULL},
    {NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stg.trace._chakra.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(stream, fmt, name, initial, base=0, index=0, chunk=1<<20, hashing=False)",
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
    .tp_init = (initproc)Reader_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------------ */
/* Setup                                                                                       */

static int member_offset(PyObject *descr, Py_ssize_t *off) {
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "expected a slot member descriptor");
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY)) {
        PyErr_SetString(PyExc_TypeError, "expected a writable object slot");
        return -1;
    }
    *off = m->offset;
    return 0;
}

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *node_cls, *node_descrs, *extras, *attrs_cls, *attrs_descrs, *types, *colls, *terr,
        *rerrs;
    long long max_record;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!OO!L", &PyType_Type, &node_cls, &PyTuple_Type,
                          &node_descrs, &PyTuple_Type, &extras, &PyType_Type, &attrs_cls,
                          &PyTuple_Type, &attrs_descrs, &PyTuple_Type, &types, &PyTuple_Type,
                          &colls, &terr, &PyTuple_Type, &rerrs, &max_record))
        return NULL;
    if (PyTuple_GET_SIZE(node_descrs) != NF_COUNT || PyTuple_GET_SIZE(attrs_descrs) != 4 ||
        PyTuple_GET_SIZE(types) != 8 || PyTuple_GET_SIZE(colls) != 10) {
        PyErr_SetString(PyExc_ValueError, "setup: wrong tuple sizes");
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)attrs_cls, &PyDict_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup: the attrs class must subclass dict");
        return NULL;
    }
    for (int i = 0; i < NF_COUNT; i++)
        if (member_offset(PyTuple_GET_ITEM(node_descrs, i), &g_node_off[i]) < 0) return NULL;
    for (int i = 0; i < 4; i++)
        if (member_offset(PyTuple_GET_ITEM(attrs_descrs, i), &g_attrs_off[i]) < 0) return NULL;
    Py_ssize_t ne = PyTuple_GET_SIZE(extras);
    Py_ssize_t *eo = PyMem_Malloc((size_t)(ne ? ne : 1) * sizeof(Py_ssize_t));
    PyObject **ed = PyMem_Malloc((size_t)(ne ? ne : 1) * sizeof(PyObject *));
    if (!eo || !ed) { PyMem_Free(eo); PyMem_Free(ed); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < ne; i++) {
        PyObject *pair = PyTuple_GET_ITEM(extras, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            member_offset(PyTuple_GET_ITEM(pair, 0), &eo[i]) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "setup: extras are (descriptor, default)");
            PyMem_Free(eo); PyMem_Free(ed);
            return NULL;
        }
        ed[i] = PyTuple_GET_ITEM(pair, 1);
        Py_INCREF(ed[i]);
    }
    g_extra_off = eo;
    g_extra_def = ed;
    g_nextra = ne;
    Py_INCREF(node_cls); g_node_type = (PyTypeObject *)node_cls;
    Py_INCREF(attrs_cls); g_attrs_type = (PyTypeObject *)attrs_cls;
    for (int i = 0; i < 8; i++) { g_node_types[i] = PyTuple_GET_ITEM(types, i); Py_INCREF(g_node_types[i]); }
    for (int i = 0; i < 10; i++) { g_collectives[i] = PyTuple_GET_ITEM(colls, i); Py_INCREF(g_collectives[i]); }
    Py_INCREF(terr); g_trace_error = terr;
    Py_INCREF(rerrs); g_read_errors = rerrs;
    g_max_record = max_record;
    g_ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS, "bind the decoder to stg's Node classes (once)"},
    {"deadlock_free", deadlock_free, METH_VARARGS, "run all ranks' skeletons together"},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_chakra",
    "Compiled fast path of stg's trace reader (see stg.trace.decode).", -1, module_methods,
    NULL, NULL, NULL, NULL};

#define INTERN(var, text) do { if (!((var) = PyUnicode_InternFromString(text))) return NULL; } while (0)

PyMODINIT_FUNC PyInit__chakra(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) return NULL;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) return NULL;
    for (int k = 3; k <= 32; k++) INTERN(g_kind_names[k], kind_text[k]);
    INTERN(s_is_cpu_op, "is_cpu_op"); INTERN(s_num_ops, "num_ops"); INTERN(s_tensor_size, "tensor_size");
    INTERN(s_comm_type, "comm_type"); INTERN(s_comm_size, "comm_size"); INTERN(s_comm_src, "comm_src");
    INTERN(s_comm_dst, "comm_dst"); INTERN(s_comm_tag, "comm_tag"); INTERN(s_dtype, "dtype");
    INTERN(s_phase, "phase"); INTERN(s_op, "op");
    INTERN(s_pg_name, "pg_name"); INTERN(s_start, "start_time_micros"); INTERN(s_inputs, "inputs");
    INTERN(s_outputs, "outputs"); INTERN(s_tensor_loc, "tensor_loc");
    INTERN(s_input_tensor_loc, "input_tensor_loc"); INTERN(s_input_tensor_size, "input_tensor_size");
    INTERN(s_output_tensor_loc, "output_tensor_loc"); INTERN(s_output_tensor_size, "output_tensor_size");
    INTERN(s_comm_priority, "comm_priority"); INTERN(s_involved_dim, "involved_dim");
    INTERN(s_v001_invalid, "v001_comm_type_invalid"); INTERN(s_read, "read"); INTERN(s_readinto, "readinto");
    INTERN(s_string_val, "string_val"); INTERN(s_int32_val, "int32_val");
    INTERN(s_uint64_val, "uint64_val"); INTERN(s_bool_list, "bool_list");
    for (int k = 0; k < JK_N; k++) jk_len[k] = (Py_ssize_t)strlen(jk_names[k]);
    g_empty_tuple = PyTuple_New(0);
    if (!g_empty_tuple) return NULL;
    return m;
}
