"""Bytes: files that hash what is written to them, digests and the check on read, direct I/O,
kernel copies, reused buffers, positional reads of stored tensors and the read taps.

A read through a descriptor passes `objects.remote`'s hooks first (a mirror file of object
storage is fetched before the read): the one place `data` calls into `objects`.
"""
