/* The block walk of `txlog.walk_segments`, compiled: the chunks of many logs' segments
 * laid out in one buffer, checked and joined into records in one pass.
 *
 * A log is a 7-byte header and 32 KiB blocks of chunks, `crc32 | length | type | payload`
 * (little-endian u32, u16, u8). A record is one FULL chunk, or a FIRST, any MIDDLEs and a
 * LAST. A chunk never crosses a block; fewer than 7 bytes left in a block are its trailer,
 * and an all-zero chunk header pads the rest of its block. The CRC (zlib's CRC-32) covers
 * the type byte and the payload.
 *
 * For segment i, `buf[starts[i]:ends[i]]`, with `partials[i]` the pieces of the record an
 * earlier read left open: every record, in order. A record in one chunk is a span of
 * `buf`; one that spans chunks is copied into `joined` and given as a span past the end of
 * `buf` (the records are in `buf + joined`). A segment with a chunk of no known type or
 * running past its block, a bad CRC or a FIRST..LAST order broken is not ok and gives no
 * records: the caller's chunk loop reads it again and accounts for the damage. A segment
 * marked `ended` ends its log: its last chunk must end exactly at its end (unless that is a
 * block boundary) and no record may be left open.
 *
 * The pure-Python chunk loop (`txlog.iter_frames(walk=False)`) is the reference the tests
 * compare this with. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_SIZE 32768
#define CHUNK_HEADER_SIZE 7
enum { FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4 };

/* CRC-32 (the reflected polynomial 0xEDB88320, as zlib), eight bytes a step: table k holds
 * the CRC of a byte followed by k zero bytes. */
static uint32_t crc_table[8][256];

static void make_crc_table(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            crc_table[k][n] = (crc_table[k - 1][n] >> 8) ^ crc_table[0][crc_table[k - 1][n] & 0xff];
}

static uint32_t crc32_of(const uint8_t *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
            crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^ crc_table[3][p[4]] ^
            crc_table[2][p[5]] ^ crc_table[1][p[6]] ^ crc_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* A growing byte buffer. */
typedef struct {
    char *data;
    Py_ssize_t size, room;
} Bytes;

static int bytes_add(Bytes *b, const void *data, Py_ssize_t n)
{
    if (b->size + n > b->room) {
        Py_ssize_t room = b->room ? b->room : 4096;
        while (room < b->size + n)
            room *= 2;
        char *grown = PyMem_Realloc(b->data, room);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = grown;
        b->room = room;
    }
    if (n)
        memcpy(b->data + b->size, data, n);
    b->size += n;
    return 0;
}

static const int64_t *int64s(Py_buffer *view, Py_ssize_t count, const char *name)
{
    if (view->len != count * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd segments expected", name, count);
        return NULL;
    }
    return (const int64_t *)view->buf;
}

/* One segment's walk: its records appended to `spans` (start, end pairs) and `joined`.
 * Returns 1 if it is intact, 0 if not (what it appended is then taken back by the caller),
 * -1 on an error of Python's (no memory). `open` holds the record left open, `is_open`
 * whether there is one. */
static int walk_one(const uint8_t *buf, Py_ssize_t buf_len, int64_t start, int64_t end,
                    int ended, Bytes *open, int *is_open, Bytes *spans, Bytes *joined)
{
    int64_t pos = start;
    int64_t last_block = end % BLOCK_SIZE ? end - end % BLOCK_SIZE : -1;
    while (pos < end) {
        int64_t block = pos - pos % BLOCK_SIZE;
        int64_t block_end = block + BLOCK_SIZE < end ? block + BLOCK_SIZE : end;
        if (block_end - pos < CHUNK_HEADER_SIZE) {
            if (ended && block == last_block && pos != block_end)
                return 0; /* a chunk header cut off at the end of the log */
            pos = block + BLOCK_SIZE;
            continue;
        }
        const uint8_t *h = buf + pos;
        uint32_t checksum = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                            (uint32_t)h[3] << 24;
        int64_t length = (int64_t)h[4] | (int64_t)h[5] << 8;
        int kind = h[6];
        int64_t after = pos + CHUNK_HEADER_SIZE + length;
        if (kind < FULL || kind > LAST || after > block_end) {
            if (kind == 0 && length == 0 && checksum == 0) { /* padding: the block ends */
                if (ended && block == last_block)
                    return 0;
                pos = block + BLOCK_SIZE;
                continue;
            }
            return 0;
        }
        if (crc32_of(h + CHUNK_HEADER_SIZE - 1, (size_t)length + 1) != checksum)
            return 0;
        if ((kind == MIDDLE || kind == LAST) != *is_open)
            return 0;
        const uint8_t *payload = h + CHUNK_HEADER_SIZE;
        if (kind == FULL) {
            int64_t span[2] = {pos + CHUNK_HEADER_SIZE, after};
            if (bytes_add(spans, span, sizeof span) < 0)
                return -1;
        } else {
            if (kind == FIRST)
                open->size = 0;
            if (bytes_add(open, payload, length) < 0)
                return -1;
            *is_open = kind != LAST;
            if (kind == LAST) {
                int64_t span[2] = {buf_len + joined->size, buf_len + joined->size + open->size};
                if (bytes_add(joined, open->data, open->size) < 0 ||
                    bytes_add(spans, span, sizeof span) < 0)
                    return -1;
                open->size = 0;
            }
        }
        pos = after;
    }
    return !(ended && *is_open);
}

static PyObject *new_array(const void *data, Py_ssize_t n)
{
    return PyByteArray_FromStringAndSize(n ? data : "", n);
}

/* walk(buf, starts, ends, ended, partials) -> (joined, starts, ends, counts, ok, partials)
 *
 * `starts`, `ends`: int64 bytes, one per segment; `ended`: one byte per segment (0 or 1);
 * `partials`: a list per segment of the open record's pieces (bytes). The record starts,
 * ends and the counts per segment come back as int64 bytearrays, `ok` as a bytearray of
 * 0/1, and each segment's open record as a list of at most one bytes (an intact segment's
 * own; a damaged segment's as it was given). */
static PyObject *walk(PyObject *self, PyObject *args)
{
    Py_buffer buf_view, starts_view, ends_view, ended_view;
    PyObject *partials;
    if (!PyArg_ParseTuple(args, "y*y*y*y*O!", &buf_view, &starts_view, &ends_view,
                          &ended_view, &PyList_Type, &partials))
        return NULL;
    PyObject *result = NULL, *new_partials = NULL;
    Bytes spans = {0}, joined = {0}, open = {0}, counts = {0}, ok = {0};
    Py_ssize_t segments = PyList_GET_SIZE(partials);
    const int64_t *starts = int64s(&starts_view, segments, "starts");
    const int64_t *ends = starts ? int64s(&ends_view, segments, "ends") : NULL;
    if (ends == NULL)
        goto done;
    if (ended_view.len != segments) {
        PyErr_SetString(PyExc_ValueError, "ended: one byte per segment expected");
        goto done;
    }
    const uint8_t *ended = ended_view.buf;
    new_partials = PyList_New(segments);
    if (new_partials == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < segments; i++) {
        if (starts[i] < 0 || ends[i] < starts[i] || ends[i] > buf_view.len) {
            PyErr_SetString(PyExc_ValueError, "a segment lies outside the buffer");
            goto done;
        }
        PyObject *given = PyList_GET_ITEM(partials, i);
        if (!PyList_Check(given)) {
            PyErr_SetString(PyExc_TypeError, "partials: a list of bytes per segment expected");
            goto done;
        }
        int is_open = PyList_GET_SIZE(given) > 0;
        open.size = 0;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(given); k++) {
            PyObject *piece = PyList_GET_ITEM(given, k);
            if (!PyBytes_Check(piece)) {
                PyErr_SetString(PyExc_TypeError, "partials: a list of bytes per segment expected");
                goto done;
            }
            if (bytes_add(&open, PyBytes_AS_STRING(piece), PyBytes_GET_SIZE(piece)) < 0)
                goto done;
        }
        Py_ssize_t spans_before = spans.size, joined_before = joined.size;
        int intact = walk_one(buf_view.buf, buf_view.len, starts[i], ends[i], ended[i] != 0,
                              &open, &is_open, &spans, &joined);
        if (intact < 0)
            goto done;
        int64_t count = intact ? (spans.size - spans_before) / (2 * sizeof(int64_t)) : 0;
        uint8_t flag = (uint8_t)intact;
        if (bytes_add(&counts, &count, sizeof count) < 0 || bytes_add(&ok, &flag, 1) < 0)
            goto done;
        PyObject *kept;
        if (!intact) { /* its records are taken back; its open record is as it was given */
            spans.size = spans_before;
            joined.size = joined_before;
            kept = PyList_GetSlice(given, 0, PyList_GET_SIZE(given));
        } else if (is_open) {
            kept = Py_BuildValue("[y#]", open.data ? open.data : "", open.size);
        } else {
            kept = PyList_New(0);
        }
        if (kept == NULL)
            goto done;
        PyList_SET_ITEM(new_partials, i, kept);
    }
    /* the spans come as (start, end) pairs: split them into starts and ends */
    Py_ssize_t records = spans.size / (2 * sizeof(int64_t));
    PyObject *record_starts = PyByteArray_FromStringAndSize(NULL, records * sizeof(int64_t));
    PyObject *record_ends = PyByteArray_FromStringAndSize(NULL, records * sizeof(int64_t));
    if (record_starts == NULL || record_ends == NULL) {
        Py_XDECREF(record_starts);
        Py_XDECREF(record_ends);
        goto done;
    }
    int64_t *pairs = (int64_t *)spans.data, *s = (int64_t *)PyByteArray_AS_STRING(record_starts),
            *e = (int64_t *)PyByteArray_AS_STRING(record_ends);
    for (Py_ssize_t r = 0; r < records; r++) {
        s[r] = pairs[2 * r];
        e[r] = pairs[2 * r + 1];
    }
    result = Py_BuildValue("(y#NNNNO)", joined.data ? joined.data : "", joined.size,
                           record_starts, record_ends, new_array(counts.data, counts.size),
                           new_array(ok.data, ok.size), new_partials);
done:
    Py_XDECREF(new_partials);
    PyMem_Free(spans.data);
    PyMem_Free(joined.data);
    PyMem_Free(open.data);
    PyMem_Free(counts.data);
    PyMem_Free(ok.data);
    PyBuffer_Release(&buf_view);
    PyBuffer_Release(&starts_view);
    PyBuffer_Release(&ends_view);
    PyBuffer_Release(&ended_view);
    return result;
}

static PyObject *crc32_py(PyObject *self, PyObject *args)
{
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view))
        return NULL;
    uint32_t c = crc32_of(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "Walk the blocks of segments of logs (see the module's C)."},
    {"crc32", crc32_py, METH_VARARGS, "zlib's CRC-32 of a buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_walk", NULL, -1, methods};

PyMODINIT_FUNC PyInit__walk(void)
{
    make_crc_table();
    return PyModule_Create(&module);
}
