/* A type object another dlcp extension defines, found by importing it.
 *
 * gathered.h and segment.h share their objects' layouts across the
 * extensions; each looks its type up once with this and keeps it.
 */
#ifndef DLCP_IMPORTED_TYPE_H
#define DLCP_IMPORTED_TYPE_H

#include <Python.h>

/* module.name if it is a type of `size` bytes an instance (the layout the
 * caller shares), else NULL (not built, or another layout). A new reference,
 * kept by the caller for the module's life. Sets no exception. */
static inline PyTypeObject *
imported_type(const char *module, const char *name, Py_ssize_t size)
{
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *t = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    if (t == NULL || !PyType_Check(t) || ((PyTypeObject *)t)->tp_basicsize != size) {
        PyErr_Clear();
        Py_XDECREF(t);
        return NULL;
    }
    return (PyTypeObject *)t;
}

#endif
