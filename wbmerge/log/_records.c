/* The proof that history records are valid protobuf, compiled: `records.proven_history`.
 *
 * A row's step and items are read from a history record's bytes without protobuf (the
 * array walk of `records.history_rows`). That walk finds where the fields are, but it does
 * not look inside an item, so a record protobuf refuses (an item with bad UTF-8, or fields
 * that are not a HistoryItem's) would be read as a row. This pass proves, for each record,
 * that it is a `Record` in the shape wandb writes a history record, which protobuf parses:
 *
 *   Record        := (num: field 1, varint | history: field 2, bytes of History)*
 *   History       := (item: field 1, bytes of HistoryItem | step: field 2, bytes of Step)*
 *   HistoryItem   := (key: 1 | nested_key: 2 | text: 7 | json: 8 | value_json: 16, each
 *                      bytes of valid UTF-8 | none: 3 | boolean: 4 | integer: 5, varints
 *                      | number: 6, 8 bytes)*
 *   Step          := (num: field 1, varint)*
 *
 * Varints are at most 10 bytes, the 10th at most 1; a length must fit in what is left.
 * UTF-8 is checked strictly, as protobuf does for proto3 strings: no overlong forms, no
 * surrogates, nothing past U+10FFFF. Any other field, wire type or byte is not proven
 * (False), and the caller parses that record with protobuf, which decides. So a record
 * this says is valid is one protobuf parses; the tests check that on random and damaged
 * records, and that wandb's own records are proven.
 *
 * On the way it reads the row's `_step` as wandb-core will (`sentrows.item_step` is the
 * reference): the last item at the path `_step` decides. When that item's typed value is
 * an integer, or it has none and its JSON text is a plain integer (`json_int` below), that
 * is the step; a row with no such item has none; any other last `_step` item (a value
 * that is not an integer, perhaps not even JSON, or a path below `_step`) is left to the
 * reference. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The varint at p[at:end): its value in *value and where it ends, or -1. */
static Py_ssize_t varint(const uint8_t *p, Py_ssize_t at, Py_ssize_t end, uint64_t *value)
{
    uint64_t result = 0;
    for (int i = 0; i < 10; i++) {
        if (at >= end)
            return -1;
        uint8_t byte = p[at++];
        if (i == 9 && byte > 1)
            return -1;
        result |= (uint64_t)(byte & 0x7F) << (7 * i);
        if (!(byte & 0x80)) {
            *value = result;
            return at;
        }
    }
    return -1;
}

/* Whether s[0:n] is valid UTF-8 (RFC 3629: the byte ranges of its table 3-7). */
static int valid_utf8(const uint8_t *s, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int more;
        uint8_t lo = 0x80, hi = 0xBF; /* the range of the byte after the lead */
        if (c >= 0xC2 && c <= 0xDF)
            more = 1;
        else if (c == 0xE0)
            more = 2, lo = 0xA0;
        else if (c >= 0xE1 && c <= 0xEC)
            more = 2;
        else if (c == 0xED)
            more = 2, hi = 0x9F; /* not the surrogates D800-DFFF */
        else if (c >= 0xEE && c <= 0xEF)
            more = 2;
        else if (c == 0xF0)
            more = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3)
            more = 3;
        else if (c == 0xF4)
            more = 3, hi = 0x8F; /* nothing past U+10FFFF */
        else
            return 0;
        if (i + more >= n) /* its continuation bytes run past the end */
            return 0;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (int k = 2; k <= more; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return 0;
        i += more + 1;
    }
    return 1;
}

/* A length-delimited field's value: its bytes p[*start:*stop) after the length at `at`. */
static int delimited(const uint8_t *p, Py_ssize_t at, Py_ssize_t end, Py_ssize_t *start,
                     Py_ssize_t *stop)
{
    uint64_t length;
    at = varint(p, at, end, &length);
    if (at < 0 || length > (uint64_t)(end - at))
        return 0;
    *start = at;
    *stop = at + (Py_ssize_t)length;
    return 1;
}

/* What an item does to the row's `_step`. */
enum { NOT_STEP, STEP_INT, STEP_OTHER };

static int is_space(uint8_t c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* Whether p[at:end) is a JSON integer as wandb-core's parser reads one, and its value.
 * That parser takes the longest run of number characters (digits, `-`, and `.+eEIinfatyN`,
 * which make it a float), between blanks: `0100` is 100, ` 7 ` is 7, `+7` and `7.0` are
 * floats. A run longer than int64's text (leading zeros count) or above it is a float too.
 * Anything else (`1-2`, `-`, `7x`) is not an integer; whether it is JSON at all is for the
 * reference. */
static int json_int(const uint8_t *p, Py_ssize_t at, Py_ssize_t end, int64_t *value)
{
    while (at < end && is_space(p[at]))
        at++;
    while (end > at && is_space(p[end - 1]))
        end--;
    int negative = at < end && p[at] == '-';
    Py_ssize_t digits = at + negative;
    if (digits >= end)
        return 0;
    for (Py_ssize_t i = digits; i < end; i++)
        if (p[i] < '0' || p[i] > '9')
            return 0;
    const char *limit = negative ? "9223372036854775808" : "9223372036854775807";
    Py_ssize_t length = end - digits;
    if (length > 19 || (length == 19 && memcmp(p + digits, limit, 19) > 0))
        return 0;
    uint64_t magnitude = 0;
    for (Py_ssize_t i = digits; i < end; i++)
        magnitude = magnitude * 10 + (uint64_t)(p[i] - '0');
    *value = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
    return 1;
}

/* A HistoryItem's typed value, one of these fields (the last set wins; wandb writes one
 * beside value_json when told to, and wandb-core reads it first): none 3 (an enum),
 * boolean 4, integer 5 (a zigzag varint, sint64), number 6 (a double), text 7, json 8. */
enum { UNTYPED = 0, TYPED_INTEGER = 5 };

/* A HistoryItem at p[at:end): whether it is valid, and in *effect what it does to `_step`
 * (its path is its nested_key when it has one, else its key; strings set twice keep the
 * last, as protobuf reads them). */
static int valid_item(const uint8_t *p, Py_ssize_t at, Py_ssize_t end, int *effect,
                      int64_t *step)
{
    Py_ssize_t key = -1, key_end = -1, value = -1, value_end = -1, first = -1, first_end = -1;
    int nested = 0, typed = UNTYPED;
    uint64_t integer = 0;
    while (at < end) {
        uint64_t tag, number;
        Py_ssize_t start, stop;
        at = varint(p, at, end, &tag);
        if (at < 0)
            return 0;
        uint64_t field = tag >> 3, wire = tag & 7;
        if (field >= 3 && field <= 5 && wire == 0) { /* none, boolean, integer */
            at = varint(p, at, end, &number);
            if (at < 0)
                return 0;
            typed = (int)field, integer = number;
            continue;
        }
        if (field == 6 && wire == 1) { /* number: the 8 bytes of a double */
            if (end - at < 8)
                return 0;
            typed = 6, at += 8;
            continue;
        }
        if (wire != 2 || !(field == 1 || field == 2 || field == 7 || field == 8 || field == 16))
            return 0;
        if (!delimited(p, at, end, &start, &stop) || !valid_utf8(p + start, stop - start))
            return 0;
        if (field == 1)
            key = start, key_end = stop;
        else if (field == 16)
            value = start, value_end = stop;
        else if (field == 2 && nested++ == 0)
            first = start, first_end = stop;
        else if (field == 7 || field == 8)
            typed = (int)field;
        at = stop;
    }
    Py_ssize_t name = nested ? first : key, name_end = nested ? first_end : key_end;
    if (name < 0 || name_end - name != 5 || memcmp(p + name, "_step", 5) != 0)
        *effect = NOT_STEP;
    else if (nested <= 1 && typed == TYPED_INTEGER)
        *effect = STEP_INT, *step = (int64_t)(integer >> 1) ^ -(int64_t)(integer & 1);
    else if (nested <= 1 && typed == UNTYPED && value >= 0 && json_int(p, value, value_end, step))
        *effect = STEP_INT;
    else
        *effect = STEP_OTHER;
    return 1;
}

static int valid_step(const uint8_t *p, Py_ssize_t at, Py_ssize_t end)
{
    while (at < end) {
        uint64_t tag, value;
        at = varint(p, at, end, &tag);
        if (at < 0 || tag != 0x08) /* num: field 1, a varint */
            return 0;
        at = varint(p, at, end, &value);
        if (at < 0)
            return 0;
    }
    return 1;
}

/* The row's `_step` as its items leave it (see the top), in *outcome. */
enum { PROVEN_NO_STEP = 1, PROVEN_STEP = 2, PROVEN_STEP_UNKNOWN = 3 };

static int valid_history(const uint8_t *p, Py_ssize_t at, Py_ssize_t end, int *outcome,
                         int64_t *step)
{
    while (at < end) {
        uint64_t tag;
        Py_ssize_t start, stop;
        at = varint(p, at, end, &tag);
        if (at < 0 || (tag != 0x0A && tag != 0x12) || !delimited(p, at, end, &start, &stop))
            return 0;
        if (tag == 0x0A) {
            int effect;
            int64_t value = 0;
            if (!valid_item(p, start, stop, &effect, &value))
                return 0;
            if (effect == STEP_INT)
                *outcome = PROVEN_STEP, *step = value;
            else if (effect == STEP_OTHER)
                *outcome = PROVEN_STEP_UNKNOWN;
        } else if (!valid_step(p, start, stop)) {
            return 0;
        }
        at = stop;
    }
    return 1;
}

/* The outcome for the record at p[at:end): 0 when not proven, else PROVEN_*. */
static int prove_record(const uint8_t *p, Py_ssize_t at, Py_ssize_t end, int64_t *step)
{
    int outcome = PROVEN_NO_STEP;
    while (at < end) {
        uint64_t tag, value;
        Py_ssize_t start, stop;
        at = varint(p, at, end, &tag);
        if (at < 0)
            return 0;
        if (tag == 0x08) { /* num */
            at = varint(p, at, end, &value);
            if (at < 0)
                return 0;
        } else if (tag == 0x12) { /* history */
            if (!delimited(p, at, end, &start, &stop) ||
                !valid_history(p, start, stop, &outcome, step))
                return 0;
            at = stop;
        } else {
            return 0;
        }
    }
    return outcome;
}

/* proven(data, starts, ends) -> (outcomes, steps): for each record data[starts[i]:ends[i]],
 * a byte (0: not proven; else PROVEN_*) and an int64 (the step, for PROVEN_STEP). */
static PyObject *proven(PyObject *self, PyObject *args)
{
    Py_buffer data, starts, ends;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data, &starts, &ends))
        return NULL;
    PyObject *outcomes = NULL, *steps = NULL, *result = NULL;
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    if (ends.len != starts.len || starts.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "starts and ends must be int64 arrays of one size");
        goto done;
    }
    outcomes = PyBytes_FromStringAndSize(NULL, n);
    steps = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (outcomes == NULL || steps == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(outcomes);
    int64_t *step = (int64_t *)PyBytes_AS_STRING(steps);
    const int64_t *s = starts.buf, *e = ends.buf;
    const uint8_t *p = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        step[i] = 0;
        int ok = 0 <= s[i] && s[i] <= e[i] && e[i] <= data.len;
        out[i] = (uint8_t)(ok ? prove_record(p, s[i], e[i], &step[i]) : 0);
    }
    result = PyTuple_Pack(2, outcomes, steps);
done:
    Py_XDECREF(outcomes);
    Py_XDECREF(steps);
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    return result;
}

/* XXH64 of p[0:n] with `seed`, as the xxHash library defines it: the 64-bit hashes whose
 * sums are the source check's digests (`digest.span_hashes`; `xxhash.xxh64_intdigest` is
 * the reference the tests compare it with). */
#define XXH_P1 11400714785074694791ULL
#define XXH_P2 14029467366897019727ULL
#define XXH_P3 1609587929392839161ULL
#define XXH_P4 9650029242287828579ULL
#define XXH_P5 2870177450012600261ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline uint64_t le32(const uint8_t *p)
{
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t input)
{
    acc += input * XXH_P2;
    return rotl64(acc, 31) * XXH_P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t value)
{
    acc ^= xxh_round(0, value);
    return acc * XXH_P1 + XXH_P4;
}

static uint64_t xxh64(const uint8_t *p, Py_ssize_t n, uint64_t seed)
{
    const uint8_t *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = seed + XXH_P1 + XXH_P2, v2 = seed + XXH_P2, v3 = seed, v4 = seed - XXH_P1;
        do {
            v1 = xxh_round(v1, le64(p));
            v2 = xxh_round(v2, le64(p + 8));
            v3 = xxh_round(v3, le64(p + 16));
            v4 = xxh_round(v4, le64(p + 24));
            p += 32;
        } while (end - p >= 32);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh_merge(h, v1);
        h = xxh_merge(h, v2);
        h = xxh_merge(h, v3);
        h = xxh_merge(h, v4);
    } else {
        h = seed + XXH_P5;
    }
    h += (uint64_t)n;
    while (end - p >= 8) {
        h ^= xxh_round(0, le64(p));
        h = rotl64(h, 27) * XXH_P1 + XXH_P4;
        p += 8;
    }
    if (end - p >= 4) {
        h ^= le32(p) * XXH_P1;
        h = rotl64(h, 23) * XXH_P2 + XXH_P3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p++) * XXH_P5;
        h = rotl64(h, 11) * XXH_P1;
    }
    h ^= h >> 33;
    h *= XXH_P2;
    h ^= h >> 29;
    h *= XXH_P3;
    h ^= h >> 32;
    return h;
}

/* hashes(data, starts, ends, seed) -> bytes: the XXH64 with `seed` of each
 * data[starts[i]:ends[i]], as uint64 in the machine's order. */
static PyObject *hashes(PyObject *self, PyObject *args)
{
    Py_buffer data, starts, ends;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*y*y*K", &data, &starts, &ends, &seed))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    if (ends.len != starts.len || starts.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "starts and ends must be int64 arrays of one size");
        goto done;
    }
    const int64_t *s = starts.buf, *e = ends.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(0 <= s[i] && s[i] <= e[i] && e[i] <= data.len)) {
            PyErr_SetString(PyExc_ValueError, "a span outside the data");
            goto done;
        }
    }
    result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (result == NULL)
        goto done;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(result);
    const uint8_t *p = data.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = xxh64(p + s[i], (Py_ssize_t)(e[i] - s[i]), (uint64_t)seed);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    return result;
}

/* flat_items(record) -> (keys, texts) or None.
 *
 * The items of a history record's bytes, for `sentrows.flat_row`, read without protobuf:
 * for each item its name (its one nested key, else its key, else None for an empty key)
 * and its JSON text ("" when it has none). Only a record in the shape wandb writes is read
 * so, every field once where protobuf would merge or repeat it:
 *
 *   Record      := (num: field 1, varint | history: field 2 once, bytes of History)*
 *   History     := (item: field 1, bytes of HistoryItem | step: field 2 once, bytes of Step)*
 *   HistoryItem := (key: 1 | nested_key: 2 | value_json: 16, each at most once, bytes of
 *                   valid UTF-8)*
 *   Step        := (num: field 1, varint)*
 *
 * Anything else (a typed value, two nested keys, another field, bad UTF-8) gives None, and
 * the caller reads the record with protobuf, which decides. */
static PyObject *flat_items(PyObject *self, PyObject *args)
{
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    const uint8_t *p = data.buf;
    Py_ssize_t end = data.len, at = 0, hs = -1, he = -1, s, e;
    uint64_t number;
    PyObject *keys = NULL, *texts = NULL, *result = NULL;
    while (at < end) {
        uint8_t tag = p[at++];
        if (tag == 0x08) {
            if ((at = varint(p, at, end, &number)) < 0)
                goto none;
        } else if (tag == 0x12 && hs < 0) {
            if (!delimited(p, at, end, &hs, &he))
                goto none;
            at = he;
        } else
            goto none;
    }
    if (hs < 0)
        goto none;
    keys = PyList_New(0);
    texts = PyList_New(0);
    if (keys == NULL || texts == NULL)
        goto done;
    int stepped = 0;
    at = hs;
    while (at < he) {
        uint8_t tag = p[at++];
        if (!delimited(p, at, he, &s, &e))
            goto none;
        at = e;
        if (tag == 0x12 && !stepped) {
            stepped = 1;
            for (Py_ssize_t q = s; q < e;)
                if (p[q++] != 0x08 || (q = varint(p, q, e, &number)) < 0)
                    goto none;
            continue;
        }
        if (tag != 0x0A)
            goto none;
        /* the item's fields: [start, stop) of key, nested key and text; -1 when absent */
        Py_ssize_t field[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
        for (Py_ssize_t q = s; q < e;) {
            uint8_t inner = p[q++];
            int which;
            if (inner == 0x0A)
                which = 0;
            else if (inner == 0x12)
                which = 1;
            else if (inner == 0x82 && q < e && p[q] == 0x01) {
                q++;
                which = 2;
            } else
                goto none;
            if (field[which][0] >= 0 ||
                !delimited(p, q, e, &field[which][0], &field[which][1]))
                goto none;
            q = field[which][1];
            if (!valid_utf8(p + field[which][0], field[which][1] - field[which][0]))
                goto none;
        }
        int named = field[1][0] >= 0 ? 1 : (field[0][1] > field[0][0] ? 0 : -1);
        PyObject *key = named < 0 ? Py_NewRef(Py_None)
                                  : PyUnicode_DecodeUTF8((const char *)p + field[named][0],
                                                         field[named][1] - field[named][0], NULL);
        PyObject *text = field[2][0] < 0
                             ? PyUnicode_New(0, 0)
                             : PyUnicode_DecodeUTF8((const char *)p + field[2][0],
                                                    field[2][1] - field[2][0], NULL);
        int failed = key == NULL || text == NULL || PyList_Append(keys, key) < 0 ||
                     PyList_Append(texts, text) < 0;
        Py_XDECREF(key);
        Py_XDECREF(text);
        if (failed)
            goto done;
    }
    result = PyTuple_Pack(2, keys, texts);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    Py_XDECREF(texts);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"proven", proven, METH_VARARGS, "Which history records are proven valid, and their `_step` (see the C)."},
    {"hashes", hashes, METH_VARARGS, "The XXH64 of each span of the data (see the C)."},
    {"flat_items", flat_items, METH_VARARGS, "A flat history record's names and texts (see the C)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_records", NULL, -1, methods};

PyMODINIT_FUNC PyInit__records(void)
{
    return PyModule_Create(&module);
}
