/* The codec's short-tuple records in C: the compiled form of twisternet.smallrecords.
 *
 * encode(t, ndarray, head, limit, tuple_code) -> bytes | None
 *     The plain record of the tuple ``t`` as one bytes object: the record kind byte (0), the tuple's
 *     msgpack extension header, the list header and every item. Scalars, str, bytes, and lists and
 *     dicts of those are packed as msgpack-python packs them (strict_types, use_bin_type); a small
 *     C-contiguous numpy array (exact type ``ndarray``) is ``head(array)[1:]`` followed by its bytes.
 *     None (decline) for anything else, as SmallRecords.encode declines: the general encoder then
 *     takes the record.
 *
 * decode(record, tuple_code, ndarray_code, kinds, empty) -> value | DECLINE
 *     The value of a plain record whose msgpack holds only nil, booleans, integers, floats, str, bin,
 *     arrays (as lists), maps, tuples (extension ``tuple_code``) and arrays (extension ``ndarray_code``)
 *     of a kind remembered in ``kinds`` (KindsByLength's table: body length -> [(head, dtype, shape)];
 *     such an array is a new ``empty(shape, dtype)`` holding the bytes after the head). DECLINE for
 *     anything else, for a truncated or malformed record, or for extra bytes at its end: the general
 *     decoder then reads it (and raises for a corrupt one, remembers a new array kind). It never
 *     reads past the record.
 *
 * Python's SmallRecords and the general decoder are the reference: both paths produce the same bytes
 * and the same values (tests/twisternet/test_smallcodec.py compares them on random records).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* How deep lists and dicts may nest on this path (deeper ones go the general way). */
#define MAX_DEPTH 32
/* Room left in front of the items for the kind byte and the largest extension header (ext32). */
#define FRONT 7

static PyObject *DECLINE;   /* the module's DECLINE sentinel */

/* ------------------------------------------------------------------------------------------ encode */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    char small[2048];
} Out;

static int out_room(Out *o, Py_ssize_t n) {
    if (o->len + n <= o->cap)
        return 0;
    Py_ssize_t cap = o->cap * 2;
    while (cap < o->len + n)
        cap *= 2;
    char *b;
    if (o->buf == o->small) {
        b = PyMem_Malloc(cap);
        if (b != NULL)
            memcpy(b, o->buf, o->len);
    } else {
        b = PyMem_Realloc(o->buf, cap);
    }
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = b;
    o->cap = cap;
    return 0;
}

static inline void put_be(char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (char)(v & 0xff);
        v >>= 8;
    }
}

/* A marker byte then an n-byte big-endian value. */
static int put_tagged(Out *o, unsigned char tag, uint64_t v, int n) {
    if (out_room(o, 1 + n) < 0)
        return -1;
    o->buf[o->len] = (char)tag;
    put_be(o->buf + o->len + 1, v, n);
    o->len += 1 + n;
    return 0;
}

static int put_bytes(Out *o, const char *p, Py_ssize_t n) {
    if (out_room(o, n) < 0)
        return -1;
    memcpy(o->buf + o->len, p, n);
    o->len += n;
    return 0;
}

/* A length header of a family with a fix form (fixstr, fixarray, fixmap: ``fix`` | n below ``fixmax``)
 * or 8/16/32-bit forms (``t8`` may be 0: no 8-bit form). */
static int put_len(Out *o, Py_ssize_t n, unsigned char fix, Py_ssize_t fixmax, unsigned char t8,
                   unsigned char t16, unsigned char t32) {
    if (fix && n < fixmax) {
        unsigned char b = (unsigned char)(fix | n);
        return put_bytes(o, (const char *)&b, 1);
    }
    if (t8 && n < 0x100)
        return put_tagged(o, t8, (uint64_t)n, 1);
    if (n < 0x10000)
        return put_tagged(o, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= 0xffffffffULL)
        return put_tagged(o, t32, (uint64_t)n, 4);
    return 1;   /* too long: decline */
}

/* 0: packed; 1: decline (nothing else to do); -1: Python error. */
static int pack_value(Out *o, PyObject *x, int depth) {
    if (x == Py_None) {
        unsigned char b = 0xc0;
        return put_bytes(o, (const char *)&b, 1);
    }
    if (x == Py_True || x == Py_False) {
        unsigned char b = x == Py_True ? 0xc3 : 0xc2;
        return put_bytes(o, (const char *)&b, 1);
    }
    if (PyLong_CheckExact(x)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(x);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 1;   /* beyond 64 bits */
            }
            return put_tagged(o, 0xcf, u, 8);
        }
        if (overflow < 0)
            return 1;
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (v >= 0) {
            if (v < 0x80) {
                unsigned char b = (unsigned char)v;
                return put_bytes(o, (const char *)&b, 1);
            }
            if (v < 0x100)
                return put_tagged(o, 0xcc, (uint64_t)v, 1);
            if (v < 0x10000)
                return put_tagged(o, 0xcd, (uint64_t)v, 2);
            if (v <= 0xffffffffLL)
                return put_tagged(o, 0xce, (uint64_t)v, 4);
            return put_tagged(o, 0xcf, (uint64_t)v, 8);
        }
        if (v >= -32) {
            unsigned char b = (unsigned char)(v & 0xff);
            return put_bytes(o, (const char *)&b, 1);
        }
        if (v >= -128)
            return put_tagged(o, 0xd0, (uint64_t)v & 0xff, 1);
        if (v >= -32768)
            return put_tagged(o, 0xd1, (uint64_t)v & 0xffff, 2);
        if (v >= -2147483648LL)
            return put_tagged(o, 0xd2, (uint64_t)v & 0xffffffffULL, 4);
        return put_tagged(o, 0xd3, (uint64_t)v, 8);
    }
    if (PyFloat_CheckExact(x)) {
        double d = PyFloat_AS_DOUBLE(x);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return put_tagged(o, 0xcb, bits, 8);
    }
    if (PyUnicode_CheckExact(x)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(x, &n);
        if (s == NULL) {      /* e.g. lone surrogates: msgpack raises, the general encoder decides */
            PyErr_Clear();
            return 1;
        }
        int r = put_len(o, n, 0xa0, 32, 0xd9, 0xda, 0xdb);
        return r ? r : put_bytes(o, s, n);
    }
    if (PyBytes_CheckExact(x)) {
        Py_ssize_t n = PyBytes_GET_SIZE(x);
        int r = put_len(o, n, 0, 0, 0xc4, 0xc5, 0xc6);
        return r ? r : put_bytes(o, PyBytes_AS_STRING(x), n);
    }
    /* (no Python code runs while a value is packed: its lists and dicts cannot change meanwhile) */
    if (depth >= MAX_DEPTH)
        return 1;
    if (PyList_CheckExact(x)) {
        Py_ssize_t n = PyList_GET_SIZE(x);
        int r = put_len(o, n, 0x90, 16, 0, 0xdc, 0xdd);
        for (Py_ssize_t i = 0; i < n && !r; i++)
            r = pack_value(o, PyList_GET_ITEM(x, i), depth + 1);
        return r;
    }
    if (PyDict_CheckExact(x)) {
        int r = put_len(o, PyDict_GET_SIZE(x), 0x80, 16, 0, 0xde, 0xdf);
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (!r && PyDict_Next(x, &pos, &k, &v)) {
            r = pack_value(o, k, depth + 1);
            if (!r)
                r = pack_value(o, v, depth + 1);
        }
        return r;
    }
    return 1;
}

static PyObject *ext_record(Out *o, Py_ssize_t size, int code) {
    /* the kind byte and the extension header, right in front of the items (at FRONT) */
    unsigned char h[FRONT];
    int hl;
    if (size == 1 || size == 2 || size == 4 || size == 8 || size == 16) {
        static const unsigned char fix[17] = {0, 0xd4, 0xd5, 0, 0xd6, 0, 0, 0, 0xd7, 0, 0, 0, 0, 0, 0, 0, 0xd8};
        h[0] = fix[size];
        h[1] = (unsigned char)code;
        hl = 2;
    } else if (size < 0x100) {
        h[0] = 0xc7;
        h[1] = (unsigned char)size;
        h[2] = (unsigned char)code;
        hl = 3;
    } else if (size < 0x10000) {
        h[0] = 0xc8;
        put_be((char *)h + 1, (uint64_t)size, 2);
        h[3] = (unsigned char)code;
        hl = 4;
    } else if ((uint64_t)size <= 0xffffffffULL) {
        h[0] = 0xc9;
        put_be((char *)h + 1, (uint64_t)size, 4);
        h[5] = (unsigned char)code;
        hl = 6;
    } else {
        Py_RETURN_NONE;
    }
    char *start = o->buf + FRONT - hl - 1;
    start[0] = 0;   /* KIND_PLAIN */
    memcpy(start + 1, h, hl);
    return PyBytes_FromStringAndSize(start, size + hl + 1);
}

static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode(t, ndarray, head, limit, tuple_code)");
        return NULL;
    }
    PyObject *t = args[0], *ndarray = args[1], *head = args[2];
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    long code = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_CheckExact(t)) {
        PyErr_SetString(PyExc_TypeError, "encode: t must be a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (n > 15)
        Py_RETURN_NONE;
    Out o;
    o.buf = o.small;
    o.cap = sizeof(o.small);
    o.len = FRONT;
    o.buf[o.len++] = (char)(0x90 | n);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyTuple_GET_ITEM(t, i);
        if ((PyObject *)Py_TYPE(x) == ndarray) {
            PyObject *h = PyObject_CallOneArg(head, x);
            if (h == NULL)
                goto done;
            if (h == Py_None || !PyBytes_Check(h) || PyBytes_GET_SIZE(h) < 1) {
                Py_DECREF(h);
                goto decline;
            }
            Py_buffer view;
            if (PyObject_GetBuffer(x, &view, PyBUF_C_CONTIGUOUS) < 0) {
                PyErr_Clear();      /* not C-contiguous, or no buffer for this dtype */
                Py_DECREF(h);
                goto decline;
            }
            int r = 1;
            if (view.len < limit && put_bytes(&o, PyBytes_AS_STRING(h) + 1, PyBytes_GET_SIZE(h) - 1) == 0)
                r = put_bytes(&o, view.buf, view.len);
            PyBuffer_Release(&view);
            Py_DECREF(h);
            if (r < 0 && PyErr_Occurred())
                goto done;
            if (r)
                goto decline;
            continue;
        }
        Py_ssize_t before = o.len;
        int r = pack_value(&o, x, 0);
        if (r < 0)
            goto done;
        if (r > 0 || o.len - before >= limit)
            goto decline;
    }
    result = ext_record(&o, o.len - FRONT, (int)code);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    if (o.buf != o.small)
        PyMem_Free(o.buf);
    return result;
}

/* ------------------------------------------------------------------------------------------ decode */

typedef struct {
    const unsigned char *p, *end;
    int tuple_code, array_code;
    PyObject *kinds;    /* {body length: [(head, dtype, shape), ...]} (twisternet.smallarrays.KindsByLength) */
    PyObject *empty;    /* numpy.empty */
} In;

/* A new array (owning its memory, writable) holding the body of ``n`` bytes, if its length and head are
 * those of a remembered kind; else NULL with no error (decline: the general decoder reads it). */
static PyObject *known_array(In *in, const unsigned char *body, Py_ssize_t n) {
    PyObject *key = PyLong_FromSsize_t(n);
    if (key == NULL)
        return NULL;
    PyObject *list = PyDict_GetItemWithError(in->kinds, key);     /* borrowed */
    Py_DECREF(key);
    if (list == NULL || !PyList_Check(list))
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *kind = PyList_GET_ITEM(list, i);
        if (!PyTuple_Check(kind) || PyTuple_GET_SIZE(kind) != 3)
            return NULL;
        PyObject *head = PyTuple_GET_ITEM(kind, 0);
        if (!PyBytes_Check(head))
            return NULL;
        Py_ssize_t hl = PyBytes_GET_SIZE(head);
        if (hl > n || memcmp(body, PyBytes_AS_STRING(head), hl) != 0)
            continue;
        /* (held: the table is not ours, and the call may run other threads that change it) */
        Py_INCREF(kind);
        PyObject *arr = PyObject_CallFunctionObjArgs(in->empty, PyTuple_GET_ITEM(kind, 2),
                                                     PyTuple_GET_ITEM(kind, 1), NULL);
        Py_DECREF(kind);
        if (arr == NULL)
            return NULL;
        Py_buffer view;
        if (PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(arr);
            return NULL;
        }
        int fits = view.len == n - hl;
        if (fits)
            memcpy(view.buf, body + hl, n - hl);
        PyBuffer_Release(&view);
        if (!fits) {
            Py_DECREF(arr);
            return NULL;
        }
        return arr;
    }
    return NULL;
}

static inline uint64_t get_be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* NULL with no error set: decline; NULL with an error set: that error (only MemoryError and the
 * like; malformed input declines). */
static PyObject *unpack(In *in, int depth);

static PyObject *unpack_seq(In *in, Py_ssize_t n, int depth) {
    if (depth >= MAX_DEPTH || n > in->end - in->p)   /* each item is at least one byte */
        return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = unpack(in, depth + 1);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, v);
    }
    return list;
}

static PyObject *unpack_map(In *in, Py_ssize_t n, int depth) {
    if (depth >= MAX_DEPTH || n > (in->end - in->p) / 2)
        return NULL;
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = unpack(in, depth + 1);
        if (k == NULL)
            goto fail;
        PyObject *v = unpack(in, depth + 1);
        if (v == NULL) {
            Py_DECREF(k);
            goto fail;
        }
        int r = PyDict_SetItem(d, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (r < 0) {
            PyErr_Clear();      /* an unhashable key: the general decoder says what it makes of it */
            goto fail;
        }
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *unpack_ext(In *in, int code, Py_ssize_t n, int depth) {
    const unsigned char *body = in->p;
    in->p += n;
    if (code == in->tuple_code) {
        /* the body is one msgpack value, a list, filling it exactly */
        In sub = *in;
        sub.p = body;
        sub.end = body + n;
        PyObject *list = unpack(&sub, depth + 1);
        if (list == NULL)
            return NULL;
        if (!PyList_CheckExact(list) || sub.p != sub.end) {
            Py_DECREF(list);    /* (a tuple whose body is not a list: the general decoder's business) */
            return NULL;
        }
        PyObject *t = PyList_AsTuple(list);
        Py_DECREF(list);
        return t;
    }
    if (code == in->array_code)
        return known_array(in, body, n);
    return NULL;
}

static PyObject *unpack(In *in, int depth) {
    if (in->p >= in->end)
        return NULL;
    unsigned char b = *in->p++;
    Py_ssize_t left = in->end - in->p;
    if (b < 0x80)
        return PyLong_FromLong(b);
    if (b >= 0xe0)
        return PyLong_FromLong((long)(signed char)b);
    if ((b & 0xe0) == 0xa0) {   /* fixstr */
        Py_ssize_t n = b & 0x1f;
        if (n > left)
            return NULL;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)in->p, n, NULL);
        if (s == NULL)
            PyErr_Clear();
        in->p += n;
        return s;
    }
    if ((b & 0xf0) == 0x90)
        return unpack_seq(in, b & 0x0f, depth);
    if ((b & 0xf0) == 0x80)
        return unpack_map(in, b & 0x0f, depth);
    static const signed char fixed_len[256] = {
        [0xc0] = 0, [0xc2] = 0, [0xc3] = 0, [0xc4] = 1, [0xc5] = 2, [0xc6] = 4, [0xc7] = 1, [0xc8] = 2,
        [0xc9] = 4, [0xca] = 4, [0xcb] = 8, [0xcc] = 1, [0xcd] = 2, [0xce] = 4, [0xcf] = 8, [0xd0] = 1,
        [0xd1] = 2, [0xd2] = 4, [0xd3] = 8, [0xd4] = 1, [0xd5] = 1, [0xd6] = 1, [0xd7] = 1, [0xd8] = 1,
        [0xd9] = 1, [0xda] = 2, [0xdb] = 4, [0xdc] = 2, [0xdd] = 4, [0xde] = 2, [0xdf] = 4,
    };
    int k = fixed_len[b];
    if (k > left)
        return NULL;
    const unsigned char *q = in->p;
    uint64_t v = k ? get_be(q, k) : 0;
    switch (b) {
    case 0xc0:
        Py_RETURN_NONE;
    case 0xc2:
        Py_RETURN_FALSE;
    case 0xc3:
        Py_RETURN_TRUE;
    case 0xca: {
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, 4);
        in->p += 4;
        return PyFloat_FromDouble((double)f);
    }
    case 0xcb: {
        double d;
        memcpy(&d, &v, 8);
        in->p += 8;
        return PyFloat_FromDouble(d);
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        in->p += k;
        return PyLong_FromUnsignedLongLong(v);
    case 0xd0:
        in->p += 1;
        return PyLong_FromLong((long)(int8_t)v);
    case 0xd1:
        in->p += 2;
        return PyLong_FromLong((long)(int16_t)v);
    case 0xd2:
        in->p += 4;
        return PyLong_FromLong((long)(int32_t)v);
    case 0xd3:
        in->p += 8;
        return PyLong_FromLongLong((long long)(int64_t)v);
    case 0xd9: case 0xda: case 0xdb: {
        in->p += k;
        if ((uint64_t)(in->end - in->p) < v)
            return NULL;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)in->p, (Py_ssize_t)v, NULL);
        if (s == NULL)
            PyErr_Clear();
        in->p += v;
        return s;
    }
    case 0xc4: case 0xc5: case 0xc6: {
        in->p += k;
        if ((uint64_t)(in->end - in->p) < v)
            return NULL;
        PyObject *s = PyBytes_FromStringAndSize((const char *)in->p, (Py_ssize_t)v);
        in->p += v;
        return s;
    }
    case 0xdc: case 0xdd:
        in->p += k;
        if (v > (uint64_t)(in->end - in->p))
            return NULL;
        return unpack_seq(in, (Py_ssize_t)v, depth);
    case 0xde: case 0xdf:
        in->p += k;
        if (v > (uint64_t)(in->end - in->p))
            return NULL;
        return unpack_map(in, (Py_ssize_t)v, depth);
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: {
        static const int fixn[5] = {1, 2, 4, 8, 16};
        Py_ssize_t n = fixn[b - 0xd4];
        if (1 + n > left)
            return NULL;
        int code = (signed char)q[0];
        in->p += 1;
        return unpack_ext(in, code, n, depth);
    }
    case 0xc7: case 0xc8: case 0xc9: {
        if (k + 1 > left)
            return NULL;
        int code = (signed char)q[k];
        in->p += k + 1;
        if (v > (uint64_t)(in->end - in->p))
            return NULL;
        return unpack_ext(in, code, (Py_ssize_t)v, depth);
    }
    default:        /* 0xc1 (never used) */
        return NULL;
    }
}

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "decode(record, tuple_code, ndarray_code, kinds: dict, empty)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    In in;
    in.p = view.buf;
    in.end = in.p + view.len;
    in.tuple_code = (int)PyLong_AsLong(args[1]);
    in.array_code = (int)PyLong_AsLong(args[2]);
    in.kinds = args[3];
    in.empty = args[4];
    PyObject *v = NULL;
    if (PyErr_Occurred())
        goto out;
    if (view.len < 2 || in.p[0] != 0) {
        v = Py_NewRef(DECLINE);
        goto out;
    }
    in.p++;
    v = unpack(&in, 0);
    if (v != NULL && in.p != in.end) {
        Py_CLEAR(v);        /* extra bytes: the general decoder raises for them */
    }
    if (v == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError))
            PyErr_Clear();
        if (!PyErr_Occurred())
            v = Py_NewRef(DECLINE);
    }
out:
    PyBuffer_Release(&view);
    return v;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL,
     "encode(t, ndarray, head, limit, tuple_code) -> bytes | None: the plain record of a short tuple"},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(record, tuple_code, ndarray_code, kinds, empty) -> value | DECLINE: a plain record's value"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "twisternet._smallcodec",
    "Short-tuple records in C (see twisternet.smallrecords).", -1, methods,
};

PyMODINIT_FUNC PyInit__smallcodec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    DECLINE = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (DECLINE == NULL || PyModule_AddObjectRef(m, "DECLINE", DECLINE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
