/* The block format's chunk sums computed in C (cache/block_format.py's block_header): the
 * xxh3-64 of every chunk of a block, as Python's xxhash gives them, in one call that lets go
 * of the interpreter lock while it hashes (a fetched 8 MiB block is 128 chunks of 64 KiB).
 * Optional like the FUSE hot path: without it, block_format hashes chunk by chunk with
 * xxhash, the same sums. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_xxh3.h"

static uint64_t (*xxh3)(const void *, size_t) = shardfs_xxh3_plain;

/* chunk_sums(data, chunk) -> bytes: one little-endian 64-bit xxh3 per chunk of ``data``
 * (the last one may be short; none for empty data). */
static PyObject *chunk_sums(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "y*n", &data, &chunk))
        return NULL;
    if (chunk <= 0) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return NULL;
    }
    Py_ssize_t count = (data.len + chunk - 1) / chunk;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 8);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *sums = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *bytes = data.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t at = i * chunk;
        size_t len = (size_t)(data.len - at < chunk ? data.len - at : chunk);
        uint64_t sum = xxh3(bytes + at, len);
        for (int byte = 0; byte < 8; byte++)
            sums[8 * i + byte] = (unsigned char)(sum >> (8 * byte));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef sums_methods[] = {
    {"chunk_sums", chunk_sums, METH_VARARGS,
     "chunk_sums(data, chunk) -> bytes: each chunk's xxh3-64, little-endian."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sums_module = {
    PyModuleDef_HEAD_INIT, "_sums", "The block format's chunk sums, in C.", -1, sums_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sums(void) {
    if (shardfs_has_avx2())
        xxh3 = shardfs_xxh3_avx2;
    return PyModule_Create(&sums_module);
}
